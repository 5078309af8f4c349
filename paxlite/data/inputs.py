"""Reading raw corpora as documents: text files, JSONL (plain, .gz, .zst), Parquet, save_to_disk
folders and directories of them.

In `.txt` files a document is a paragraph (blank-line separated) unless each file is one document;
in JSONL a document is one line's text field, in Parquet and save_to_disk folders one row's text
column (read by paxlite.data.row_files). Also a small progress line for long-running tools.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TextIO

from paxlite.data.errors import DatasetError
from paxlite.data.row_files import (
    PARQUET_SUFFIX,
    BadRows,
    Column,
    find_inputs,
    is_saved_dataset,
    iter_checked_rows,
    open_text,
    read_errors,
)

_TEXT_SUFFIXES = (".txt",)
_JSONL_SUFFIXES = (".jsonl", ".json")
_COMPRESSIONS = (".gz", ".zst")


class Progress:
    """One status line on stderr: redrawn in place on a terminal, else printed every `interval_s` s.

    A log file therefore gets a readable line now and then instead of thousands of carriage returns.
    """

    def __init__(
        self, *, enabled: bool, stream: TextIO | None = None, interval_s: float | None = None
    ):
        self._stream = sys.stderr if stream is None else stream
        self._enabled = enabled
        self._tty = enabled and self._stream.isatty()
        self._interval = interval_s if interval_s is not None else (0.2 if self._tty else 10.0)
        self._last = time.monotonic()
        self._width = 0

    def update(self, message: str, *, force: bool = False) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        if self._tty:
            self._stream.write("\r" + message.ljust(self._width))
            self._width = len(message)
        else:
            self._stream.write(message + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Ends the status line so later output starts on a fresh line."""
        if self._tty and self._width:
            self._stream.write("\n")
            self._stream.flush()
            self._width = 0


# --------------------------------------------------------------------------------------------------
# Raw input: text, JSONL, compressed, directories.


def _input_format(path: str) -> tuple[str, str] | None:
    """('text' | 'jsonl' | 'parquet', compression suffix or '') for a supported file name."""
    name = os.path.basename(path).lower()
    if name.endswith(PARQUET_SUFFIX):
        return "parquet", ""
    compression = next((c for c in _COMPRESSIONS if name.endswith(c)), "")
    base = name[: len(name) - len(compression)]
    if base.endswith(_TEXT_SUFFIXES):
        return "text", compression
    if base.endswith(_JSONL_SUFFIXES):
        return "jsonl", compression
    return None


def _supported() -> str:
    bases = _TEXT_SUFFIXES + _JSONL_SUFFIXES
    compressed = ", ".join(b + c for b in bases for c in ("",) + _COMPRESSIONS)
    return f"{compressed}, {PARQUET_SUFFIX}"


def list_input_files(paths: Sequence[str | os.PathLike]) -> list[str]:
    """The files `paths` name: files as given, directories expanded recursively in sorted order;
    a save_to_disk folder (named, or found in a directory) is one input.

    Checks everything up front so a typo fails before any output is created.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DatasetError("no input paths given")
    files: list[str] = []
    for raw in paths:
        path = os.fspath(raw)
        if os.path.isdir(path) and is_saved_dataset(path):
            files.append(path)
        elif os.path.isdir(path):
            found = find_inputs(path, accept=lambda name: _input_format(name) is not None)
            if not found:
                raise DatasetError(
                    f"directory {path} holds no input files (supported: {_supported()}, "
                    "save_to_disk folders)"
                )
            files.extend(found)
        elif os.path.isfile(path):
            if _input_format(path) is None:
                raise DatasetError(
                    f"unsupported input file {path}: the name must end in one of {_supported()}"
                )
            files.append(path)
        else:
            raise DatasetError(f"input path {path} does not exist")
    return files


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Documents separated by blank (or whitespace-only) lines; inner newlines are kept."""
    buffer: list[str] = []
    for line in lines:
        if line.strip():
            buffer.append(line)
        elif buffer:
            yield "".join(buffer).rstrip("\n")
            buffer = []
    if buffer:
        yield "".join(buffer).rstrip("\n")


def _jsonl_documents(
    lines: Iterable[str], *, path: str, text_field: str, text_setting: str
) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path}:{number}: not valid JSON ({e.msg}); "
                "expected JSON Lines, one object per line"
            ) from e
        if not isinstance(obj, dict) or text_field not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DatasetError(
                f"{path}:{number}: no {text_field!r} field (found {keys}); "
                f"choose the field with {text_setting}"
            )
        text = obj[text_field]
        if not isinstance(text, str):
            raise DatasetError(
                f"{path}:{number}: field {text_field!r} is {type(text).__name__}, expected a string"
            )
        if text.strip():
            yield text


def _table_documents(
    path: str, *, text_field: str, text_setting: str, split: str | None
) -> Iterator[str]:
    """Parquet and save_to_disk rows' `text_field` values; like JSONL's, empty ones are skipped."""
    column = Column(text_field, (str,), "a string", may_be_empty=True,
                    hint=f"; choose the column with {text_setting}")
    rows = iter_checked_rows(path, columns=[column], split=split, on_bad_row=BadRows.RAISE)
    return (row[text_field] for _, row in rows if row[text_field].strip())


def _file_documents(
    path: str, *, text_field: str, text_setting: str, document_per_file: bool
) -> Iterator[str]:
    form, compression = _input_format(path) or ("", "")
    with read_errors(path, compression), open_text(path, compression) as f:
        if form == "jsonl":
            yield from _jsonl_documents(f, path=path, text_field=text_field,
                                        text_setting=text_setting)
        elif document_per_file:
            text = f.read().rstrip("\n")
            if text.strip():
                yield text
        else:
            yield from _paragraphs(f)


def iter_documents(
    paths: Sequence[str | os.PathLike],
    *,
    text_field: str = "text",
    document_per_file: bool = False,
    split: str | None = None,
    text_setting: str = "--text_field",
) -> Iterator[str]:
    """Documents from text/JSONL files (plain, .gz or .zst), Parquet files, save_to_disk folders
    or directories of them.

    `.txt`: documents are paragraphs separated by blank lines (whole files with
    `document_per_file`). `.jsonl`/`.json`: one JSON object per line, the document in `text_field`;
    Parquet and save_to_disk rows: the document in column `text_field` (`split` picks a
    DatasetDict folder's split; `text_setting` is the flag a missing column's error names).
    Empty documents are skipped. Paths are checked now (DatasetError for a missing path or an
    unknown suffix); reading is lazy.
    """
    files = list_input_files(paths)

    def generate() -> Iterator[str]:
        for path in files:
            if os.path.isdir(path) or _input_format(path) == ("parquet", ""):
                yield from _table_documents(path, text_field=text_field,
                                            text_setting=text_setting, split=split)
                continue
            yield from _file_documents(path, text_field=text_field, text_setting=text_setting,
                                       document_per_file=document_per_file)

    return generate()


# --------------------------------------------------------------------------------------------------
# Writing a dataset.
