"""Rows (one dict each) from where users keep them: JSONL, Parquet, `save_to_disk` folders.

Every row comes with `where` ("file:line" for JSONL, lines counted from 1 as editors count them;
"file:row N" for Parquet and Arrow, rows counted from 0 as pyarrow and `datasets` index them), so
a bad row's error names the place to look. Files are streamed: JSONL a line at a time, Parquet
and Arrow a record batch at a time, so a corpus larger than memory is fine.

A folder is read recursively in sorted path order (as `prepare` has always read folders); a folder
written by `datasets.Dataset.save_to_disk` inside it is read as one dataset, its Arrow files in
the order its state.json lists them. A folder written from a `DatasetDict` (dataset_dict.json and
one folder per split) needs the split named. `datasets` itself is never imported here: pyarrow
reads its files directly.

Row checks: `check_row` tests the columns a caller needs (present, of the right type, not empty).
A bad row, or an unreadable JSONL line, is a DatasetError of one line naming `where`, the column
and what was expected; with `BadRows.SKIP` it is skipped and counted in a `SkippedRows` the caller
reads for its log and metrics. Nothing is dropped without being counted.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from paxlite.data.errors import DatasetError

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIX = ".parquet"
COMPRESSIONS = (".gz", ".zst")
DATASET_STATE = "state.json"  # save_to_disk of a Dataset
DATASET_DICT = "dataset_dict.json"  # save_to_disk of a DatasetDict: {"splits": [...]}
_BATCH_ROWS = 1024  # rows converted to Python at a time from Parquet (Arrow keeps its batches)


class BadRows(enum.Enum):
    """What happens to a row that fails its checks."""

    RAISE = "raise"  # a DatasetError naming the row: the default, nothing is lost unnoticed
    SKIP = "skip"  # skipped and counted in a SkippedRows


class SkippedRows:
    """Rows skipped under BadRows.SKIP, by reason; the caller reports them (log, metrics.jsonl)."""

    def __init__(self) -> None:
        self._by_reason: collections.Counter[str] = collections.Counter()
        self.first: str | None = None  # the first skipped row's error line, to show an example

    def add(self, *, reason: str, message: str) -> None:
        self._by_reason[reason] += 1
        if self.first is None:
            self.first = message

    @property
    def total(self) -> int:
        return sum(self._by_reason.values())

    @property
    def by_reason(self) -> dict[str, int]:
        """Counts per short reason ("missing column 'text'"), in order of first appearance."""
        return dict(self._by_reason)

    def summary(self) -> str:
        """One line for a log: how many, why, and the first one ('' when none was skipped)."""
        if not self.total:
            return ""
        reasons = ", ".join(f"{count} {reason}" for reason, count in self._by_reason.items())
        return f"skipped {self.total} bad rows ({reasons}); the first: {self.first}"


@dataclasses.dataclass(frozen=True)
class Column:
    """A column a caller needs: its name, the Python types its values may have, and in words
    what is expected (for the error line). `hint` ends the error ("; choose it with --x")."""

    name: str
    types: tuple[type, ...]
    expected: str
    may_be_empty: bool = False
    hint: str = ""


def reject_row(
    where: str, *, reason: str, detail: str, on_bad_row: BadRows, skipped: SkippedRows | None
) -> None:
    """Raises the row's one-line DatasetError, or counts it in `skipped` under BadRows.SKIP.

    Callers with checks of their own (an empty conversation, a role the template rejects) use it
    too, so every bad row follows the same rule.
    """
    message = f"{where}: {detail}"
    if on_bad_row is BadRows.RAISE:
        raise DatasetError(message)
    if skipped is None:
        raise ValueError("BadRows.SKIP needs a SkippedRows to count the skipped rows in")
    skipped.add(reason=reason, message=message)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _column_problem(row: dict[str, Any], column: Column) -> tuple[str, str] | None:
    """(reason, detail) of what is wrong with `column` in `row`, or None."""
    name = column.name
    if name not in row:
        found = ", ".join(repr(k) for k in row) or "none"
        return (f"missing column {name!r}",
                f"no column {name!r} (the row has {found}); expected {column.expected}"
                + column.hint)
    value = row[name]
    wrong_bool = isinstance(value, bool) and bool not in column.types
    if value is None or wrong_bool or not isinstance(value, column.types):
        return (f"wrong type in {name!r}",
                f"column {name!r} is {_type_name(value)}, expected {column.expected}"
                + column.hint)
    empty = not value.strip() if isinstance(value, str) else hasattr(value, "__len__") and (
        len(value) == 0)
    if empty and not column.may_be_empty:
        return f"empty {name!r}", f"column {name!r} is empty, expected {column.expected}"
    return None


def check_row(
    where: str,
    row: dict[str, Any],
    *,
    columns: Sequence[Column],
    on_bad_row: BadRows,
    skipped: SkippedRows | None,
) -> bool:
    """True when every column is as expected; otherwise reject_row (raise, or count and False)."""
    for column in columns:
        problem = _column_problem(row, column)
        if problem is not None:
            reason, detail = problem
            reject_row(where, reason=reason, detail=detail, on_bad_row=on_bad_row,
                       skipped=skipped)
            return False
    return True


# --------------------------------------------------------------------------------------------------
# Which paths are row files.


def file_format(path: str) -> tuple[str, str] | None:
    """('jsonl' | 'parquet', compression suffix or '') for a row file's name, else None."""
    name = os.path.basename(path).lower()
    if name.endswith(PARQUET_SUFFIX):
        return "parquet", ""
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    if name[: len(name) - len(compression)].endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    return None


def is_saved_dataset(path: str) -> bool:
    """A folder written by `save_to_disk`, of a Dataset or of a DatasetDict."""
    return os.path.isfile(os.path.join(path, DATASET_STATE)) or os.path.isfile(
        os.path.join(path, DATASET_DICT))


def is_dataset_dict(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DATASET_DICT))


def find_inputs(directory: str, *, accept: Callable[[str], bool]) -> list[str]:
    """Files under `directory` that `accept` takes, and the save_to_disk folders (each one
    input, not descended into), recursively, in sorted path order."""
    found: list[str] = []
    for root, dirs, names in os.walk(directory):
        saved = [d for d in dirs if is_saved_dataset(os.path.join(root, d))]
        found.extend(os.path.join(root, d) for d in saved)
        dirs[:] = [d for d in dirs if d not in saved]
        found.extend(os.path.join(root, name) for name in names if accept(name))
    return sorted(found)


def _supported() -> str:
    jsonl = [b + c for b in JSONL_SUFFIXES for c in ("",) + COMPRESSIONS]
    return ", ".join([*jsonl, PARQUET_SUFFIX]) + " files and save_to_disk folders"


def row_inputs(path: str) -> list[str]:
    """The files and save_to_disk folders `path` stands for (checked now, read later)."""
    if os.path.isdir(path):
        if is_saved_dataset(path):
            return [path]
        found = find_inputs(path, accept=lambda name: file_format(name) is not None)
        if not found:
            raise DatasetError(f"folder {path} holds no row files (supported: {_supported()})")
        return found
    if os.path.isfile(path):
        if file_format(path) is None:
            raise DatasetError(f"unsupported row file {path}: expected {_supported()}")
        return [path]
    raise DatasetError(f"input path {path} does not exist")


# --------------------------------------------------------------------------------------------------
# Reading.


def open_text(path: str, compression: str) -> TextIO:
    """A text stream of a plain, gzip or zstandard file (zstandard imported only when needed)."""
    if compression == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if compression == ".zst":
        try:
            import zstandard
        except ImportError as e:
            raise DatasetError(
                f"reading {path} needs the zstandard package: pip install zstandard"
            ) from e
        raw = zstandard.ZstdDecompressor().stream_reader(
            open(path, "rb"),  # noqa: SIM115  the returned reader owns and closes it (closefd)
            read_across_frames=True, closefd=True,
        )
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, encoding="utf-8")


@contextlib.contextmanager
def read_errors(path: str, compression: str) -> Iterator[None]:
    """Reading the text file `path` fails as one DatasetError naming it: bad UTF-8, a corrupt .gz
    or .zst, an OS error (inputs.py's documents and the rows here)."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path} is not valid UTF-8 ({e})") from e
    except (gzip.BadGzipFile, EOFError) as e:
        raise DatasetError(f"{path} is not a valid {compression or 'text'} file ({e})") from e
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e}") from e
    except Exception as e:
        # zstandard.ZstdError is not an OSError; told by name to keep the import lazy.
        if type(e).__name__ == "ZstdError":
            raise DatasetError(f"{path} is not a valid .zst file ({e})") from e
        raise


def _pyarrow(path: str):
    try:
        import pyarrow
        import pyarrow.parquet  # the submodule: pyarrow.parquet.ParquetFile
    except ImportError as e:
        raise DatasetError(
            f"reading {path} needs the pyarrow package: pip install pyarrow (in paxlite[hf])"
        ) from e
    return pyarrow


def _jsonl_rows(path: str, compression: str, *, on_bad_row: BadRows,
                skipped: SkippedRows | None) -> Iterator[tuple[str, dict[str, Any]]]:
    with read_errors(path, compression), open_text(path, compression) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a blank line is no row
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                reject_row(where, reason="invalid JSON",
                           detail=f"not valid JSON ({e.msg}); expected one object per line",
                           on_bad_row=on_bad_row, skipped=skipped)
                continue
            if not isinstance(row, dict):
                reject_row(where, reason="not a JSON object",
                           detail=f"a JSON {type(row).__name__}, expected an object",
                           on_bad_row=on_bad_row, skipped=skipped)
                continue
            yield where, row


def _projection(names: Sequence[str], columns: Sequence[str] | None) -> list[str] | None:
    """The columns to read: all of them when one asked for is absent, so its error lists them."""
    if not columns or not set(columns) <= set(names):
        return None
    return [name for name in names if name in columns]


def _batch_rows(path: str, batches, *, start: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
    number = start
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{path}:row {number}", row
            number += 1


def _parquet_rows(path: str, *, columns: Sequence[str] | None):
    pa = _pyarrow(path)
    try:
        parquet = pa.parquet.ParquetFile(path)
        read = _projection(parquet.schema_arrow.names, columns)
        yield from _batch_rows(path, parquet.iter_batches(batch_size=_BATCH_ROWS, columns=read))
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path} is not a readable Parquet file ({e})") from e


def _arrow_rows(path: str, *, columns: Sequence[str] | None):
    """An Arrow IPC stream file, as `save_to_disk` writes them, memory-mapped."""
    pa = _pyarrow(path)
    try:
        with pa.memory_map(path) as source:
            reader = pa.ipc.open_stream(source)
            read = _projection(reader.schema.names, columns)
            batches = reader if read is None else (batch.select(read) for batch in reader)
            yield from _batch_rows(path, batches)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path} is not a readable Arrow file ({e})") from e


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read {path}: {e}") from e


def saved_dataset_files(path: str, *, split: str | None, split_setting: str = "--split"
                        ) -> list[str]:
    """The Arrow files of a save_to_disk folder in its state.json's order; for a DatasetDict
    folder, those of `split` (an error naming the splits when it is None or not one of them)."""
    if is_dataset_dict(path):
        splits = _read_json(os.path.join(path, DATASET_DICT)).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DatasetError(f"{os.path.join(path, DATASET_DICT)}: 'splits' is not a list of "
                               f"names: {splits!r:.80}")
        if split not in splits:
            what = "needs a split" if split is None else f"has no split {split!r}"
            raise DatasetError(f"{path} is a DatasetDict folder and {what}: choose one of "
                               f"{', '.join(splits)} with {split_setting}")
        path = os.path.join(path, split)
    state_path = os.path.join(path, DATASET_STATE)
    state = _read_json(state_path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries):
        raise DatasetError(f"{state_path}: no list of data files ('_data_files'); "
                           "expected a folder written by datasets' save_to_disk")
    files = [os.path.join(path, e["filename"]) for e in entries]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise DatasetError(f"{state_path} lists {missing[0]}, which does not exist")
    return files


def _one_input_rows(path: str, *, split: str | None, split_setting: str,
                    columns: Sequence[str] | None, on_bad_row: BadRows,
                    skipped: SkippedRows | None) -> Iterator[tuple[str, dict[str, Any]]]:
    if os.path.isdir(path):
        for arrow_file in saved_dataset_files(path, split=split, split_setting=split_setting):
            yield from _arrow_rows(arrow_file, columns=columns)
        return
    form, compression = file_format(path) or ("", "")
    if form == "parquet":
        yield from _parquet_rows(path, columns=columns)
    else:
        yield from _jsonl_rows(path, compression, on_bad_row=on_bad_row, skipped=skipped)


def iter_rows(
    path: str | os.PathLike,
    *,
    split: str | None = None,
    split_setting: str = "--split",
    columns: Sequence[str] | None = None,
    on_bad_row: BadRows = BadRows.RAISE,
    skipped: SkippedRows | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row `path` holds: a JSONL file (plain, .gz, .zst), a Parquet file,
    a save_to_disk folder, or a folder of them (recursive, sorted).

    `split` chooses the split of DatasetDict folders (`split_setting` is the setting its error
    names); other inputs have none and ignore it. `columns`, when given, are the columns the
    caller needs: Parquet and Arrow read only those (all of them when one is absent, so that the
    check's error can list what is there); JSONL rows are always whole. Lines that are not a
    JSON object are bad rows under `on_bad_row`. The path is checked now (DatasetError for a
    missing path, an unknown suffix, a folder without row files); reading is lazy.
    """
    inputs = row_inputs(os.fspath(path))

    def generate() -> Iterator[tuple[str, dict[str, Any]]]:
        for one in inputs:
            yield from _one_input_rows(one, split=split, split_setting=split_setting,
                                       columns=columns, on_bad_row=on_bad_row, skipped=skipped)

    return generate()


def iter_checked_rows(
    path: str | os.PathLike,
    *,
    columns: Sequence[Column],
    split: str | None = None,
    split_setting: str = "--split",
    on_bad_row: BadRows = BadRows.RAISE,
    skipped: SkippedRows | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """iter_rows with check_row on `columns`: only good rows come out; bad ones raise, or are
    counted in `skipped` under BadRows.SKIP."""
    if on_bad_row is BadRows.SKIP and skipped is None:
        raise ValueError("BadRows.SKIP needs a SkippedRows to count the skipped rows in")
    rows = iter_rows(path, split=split, split_setting=split_setting,
                     columns=[c.name for c in columns], on_bad_row=on_bad_row, skipped=skipped)
    return ((where, row) for where, row in rows
            if check_row(where, row, columns=columns, on_bad_row=on_bad_row, skipped=skipped))
