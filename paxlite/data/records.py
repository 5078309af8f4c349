"""Writing and reading paxlite dataset directories (ArrayRecord + manifest).

On disk: `DIR/paxlite_dataset.json` (the manifest) and `{split}-NNNNN-of-NNNNN.array_record` shards,
one document per record (UTF-8 text, or little-endian int32 token ids without EOS).

The writer stages every record once in a scratch ArrayRecord file, so memory stays flat however
large the corpus is; then it picks the validation documents and the shuffle from the exact document
count, copies the records into their shards, and writes the manifest last: a crashed run leaves no
manifest, so a half-written dataset is never read.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from array_record.python import array_record_module

from paxlite.data.errors import DatasetError
from paxlite.data.inputs import Progress
from paxlite.paths import NOT_EMPTY, output_dir_problem

if TYPE_CHECKING:
    from paxlite.data.tokenizer import Tokenizer

MANIFEST = "paxlite_dataset.json"
FORMAT_VERSION = 1
# Default shard size when the caller does not fix the number of shards.
SHARD_BYTES = 64 * 2**20
_STAGING = ".paxlite_staging.array_record"
_ENCODE_BATCH = 512
_READ_BATCH = 1024




class Kind(str, enum.Enum):
    """What one record holds."""

    TEXT = "text"  # one document as UTF-8 bytes
    TOKENS = "tokens"  # one document's token ids as little-endian int32, no EOS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitInfo:
    shards: tuple[str, ...]  # relative to the dataset directory
    documents: int
    tokens: int | None  # stored ids (no EOS); None for text counted without a tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    directory: str  # absolute
    kind: str  # a Kind value
    splits: dict[str, SplitInfo]
    tokenizer: dict | None
    sources: tuple[str, ...]


def _parse_kind(kind: str) -> Kind:
    try:
        return Kind(kind)
    except ValueError:
        valid = [k.value for k in Kind]
        raise DatasetError(f"unknown dataset kind {kind!r}; valid: {valid}") from None


def validation_count(num_documents: int, fraction: float) -> int:
    """round(fraction * N); at least 1 if fraction > 0 and N >= 2; leaves one for training."""
    if num_documents < 2 or fraction <= 0:
        return 0
    return min(max(1, round(fraction * num_documents)), num_documents - 1)


def _shard_count(requested: int | None, *, documents: int, nbytes: int) -> int:
    count = requested if requested is not None else math.ceil(nbytes / SHARD_BYTES)
    return max(1, min(count, documents))


def _prepare_directory(directory: str) -> bool:
    """Creates `directory` if needed; returns whether it was created. Refuses anything non-empty."""
    if problem := output_dir_problem(directory):
        raise DatasetError(f"output path {directory} {problem}" + (
            "; choose a new or empty directory (existing data is never overwritten)"
            if problem == NOT_EMPTY else ""))
    if os.path.isdir(directory):
        return False
    os.makedirs(directory)
    return True


def _tokenizer_entry(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "path": tokenizer.path,
        "sha256": tokenizer.sha256(),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
    }


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise DatasetError(f"documents must be str, got {type(item).__name__}: {item!r:.80}")
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# One record per chunk (group_size:1) for random access. Token ids barely compress (zstd saved 16%
# on Shakespeare's) while decompressing each tiny chunk cost more than reading it, so they are
# stored raw.
_SHARD_OPTIONS = {Kind.TOKENS: "group_size:1,uncompressed", Kind.TEXT: "group_size:1"}


def _stage(
    path: str,
    documents: Iterable[str],
    *,
    kind: Kind,
    tokenizer: Tokenizer | None,
    counts: array.array,
    sizes: array.array,
    progress: Progress,
) -> None:
    """Writes each document's record to `path` in input order, noting token counts and sizes."""
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    try:
        total = 0
        for batch in _batched(documents, _ENCODE_BATCH):
            ids = tokenizer.encode_batch(batch) if tokenizer is not None else None
            for i, doc in enumerate(batch):
                if kind is Kind.TOKENS:
                    record = np.asarray(ids[i], dtype="<i4").tobytes()
                else:
                    record = doc.encode("utf-8")
                writer.write(record)
                sizes.append(len(record))
                total += len(record)
                if ids is not None:
                    counts.append(len(ids[i]))
            progress.update(f"reading: {len(sizes):,} documents, {total / 2**20:,.1f} MiB")
    finally:
        writer.close()


def _write_shards(
    directory: str,
    staging: str,
    *,
    split: str,
    order: np.ndarray,
    num_shards: int,
    written: list[str],
    progress: Progress,
    options: str,
) -> tuple[str, ...]:
    """Copies staged records `order` into shards round-robin: the j-th goes to shard j % n."""
    reader = array_record_module.ArrayRecordReader(staging, "readahead_buffer_size:0")
    names = []
    try:
        for shard in range(num_shards):
            name = f"{split}-{shard:05d}-of-{num_shards:05d}.array_record"
            path = os.path.join(directory, name)
            written.append(path)
            writer = array_record_module.ArrayRecordWriter(path, options)
            try:
                indices = order[shard::num_shards]
                for start in range(0, len(indices), _READ_BATCH):
                    for record in reader.read(indices[start : start + _READ_BATCH].tolist()):
                        writer.write(record)
                    progress.update(
                        f"writing {split} shard {shard + 1}/{num_shards}: "
                        f"{min(start + _READ_BATCH, len(indices)):,}/{len(indices):,} documents"
                    )
            finally:
                writer.close()
            names.append(name)
    finally:
        reader.close()
    return tuple(names)


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(directory, MANIFEST)
    scratch = path + ".partial"
    with open(scratch, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    os.replace(scratch, path)


def write_dataset(
    directory: str | os.PathLike,
    documents: Iterable[str],
    *,
    kind: str,
    tokenizer: Tokenizer | None,
    num_shards: int | None,
    validation_fraction: float,
    seed: int,
    sources: Sequence[str],
    progress: bool = False,
) -> DatasetInfo:
    """Writes a prepared dataset into a new or empty `directory` and returns what read_info sees.

    kind "tokens" stores `tokenizer.encode(doc)` per record; kind "text" stores UTF-8 text and, when
    a tokenizer is given, counts tokens for the manifest. `num_shards` fixes the train split's shard
    count (None: about one per 64 MiB); validation gets a proportional share, at least one. The
    validation/train assignment and the shuffle are seeded: same input and seed, same files.
    On any failure the files written so far are removed and no manifest exists.
    """
    kind_ = _parse_kind(kind)
    if kind_ is Kind.TOKENS and tokenizer is None:
        raise DatasetError('kind "tokens" needs a tokenizer (pass --vocab_path)')
    if num_shards is not None and num_shards < 1:
        raise DatasetError(f"num_shards must be >= 1 (or None for automatic), got {num_shards}")
    if not 0.0 <= validation_fraction < 1.0:
        raise DatasetError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    directory = os.path.abspath(os.fspath(directory))
    created = _prepare_directory(directory)
    written: list[str] = []
    status = Progress(enabled=progress)
    try:
        staging = os.path.join(directory, _STAGING)
        written.append(staging)
        counts, sizes = array.array("q"), array.array("q")
        _stage(staging, documents, kind=kind_, tokenizer=tokenizer, counts=counts, sizes=sizes,
               progress=status)
        total = len(sizes)
        if total == 0:
            named = ", ".join(os.fspath(s) for s in sources) or "an empty iterable"
            raise DatasetError(f"no documents in the input ({named})")
        order = np.random.default_rng(seed).permutation(total)
        num_validation = validation_count(total, validation_fraction)
        orders = {"train": order[num_validation:]}
        if num_validation:
            orders["validation"] = order[:num_validation]
        size_of = np.frombuffer(sizes, dtype=np.int64)
        count_of = np.frombuffer(counts, dtype=np.int64) if tokenizer is not None else None
        splits: dict[str, Any] = {}
        for split, split_order in orders.items():
            requested = num_shards
            if num_shards is not None and split != "train":
                requested = round(num_shards * len(split_order) / total)
            shards = _write_shards(
                directory,
                staging,
                split=split,
                order=split_order,
                num_shards=_shard_count(
                    requested, documents=len(split_order), nbytes=int(size_of[split_order].sum())
                ),
                written=written,
                progress=status,
                options=_SHARD_OPTIONS[kind_],
            )
            splits[split] = {
                "shards": list(shards),
                "documents": len(split_order),
                "tokens": None if count_of is None else int(count_of[split_order].sum()),
            }
        os.remove(staging)
        written.remove(staging)
        written.append(os.path.join(directory, MANIFEST + ".partial"))
        _write_manifest(
            directory,
            {
                "format_version": FORMAT_VERSION,
                "kind": kind_.value,
                "splits": splits,
                "tokenizer": None if tokenizer is None else _tokenizer_entry(tokenizer),
                "sources": [os.fspath(s) for s in sources],
            },
        )
    except BaseException:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        if created and not os.listdir(directory):
            os.rmdir(directory)
        raise
    finally:
        status.close()
    return read_info(directory)


# --------------------------------------------------------------------------------------------------
# Reading a dataset.


def _split_from_json(name: str, raw: Any, *, where: str) -> SplitInfo:
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: split {name!r} must be an object, got {raw!r:.80}")
    shards, documents, tokens = raw.get("shards"), raw.get("documents"), raw.get("tokens")
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise DatasetError(f"{where}: split {name!r} needs a list of shards, got {shards!r:.80}")
    if not isinstance(documents, int) or documents < 0:
        raise DatasetError(f"{where}: split {name!r} has an invalid document count {documents!r}")
    if tokens is not None and (not isinstance(tokens, int) or tokens < 0):
        raise DatasetError(f"{where}: split {name!r} has an invalid token count {tokens!r}")
    return SplitInfo(shards=tuple(shards), documents=documents, tokens=tokens)


def read_info(directory: str | os.PathLike) -> DatasetInfo:
    """Loads and checks a dataset's manifest: it parses, its fields are valid, its shards exist."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise DatasetError(f"dataset directory {directory} does not exist")
    where = os.path.join(directory, MANIFEST)
    if not os.path.isfile(where):
        raise DatasetError(
            f"{directory} has no {MANIFEST}: it is not a prepared dataset, or its preparation did "
            "not finish (make one with python -m paxlite.data.prepare)"
        )
    try:
        with open(where, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"cannot read {where}: {e}") from e
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: expected a JSON object")
    if raw.get("format_version") != FORMAT_VERSION:
        raise DatasetError(
            f"{where}: format_version {raw.get('format_version')!r} is not supported "
            f"(expected {FORMAT_VERSION})"
        )
    kind = raw.get("kind")
    if kind not in [k.value for k in Kind]:
        raise DatasetError(f"{where}: unknown kind {kind!r}; valid: {[k.value for k in Kind]}")
    tokenizer = raw.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, dict):
        raise DatasetError(f"{where}: tokenizer must be an object or null, got {tokenizer!r:.80}")
    if kind == Kind.TOKENS.value and tokenizer is None:
        raise DatasetError(f'{where}: kind "tokens" requires a tokenizer entry')
    raw_splits = raw.get("splits")
    if not isinstance(raw_splits, dict) or not raw_splits:
        raise DatasetError(f"{where}: no splits")
    splits = {name: _split_from_json(name, raw_splits[name], where=where) for name in raw_splits}
    for name, split in splits.items():
        for shard in split.shards:
            if not os.path.isfile(os.path.join(directory, shard)):
                raise DatasetError(
                    f"{where}: shard {shard} of split {name!r} is missing; put it back (or "
                    "remount its filesystem), or prepare the dataset again, and run the same "
                    "command again")
    sources = raw.get("sources", [])
    if not isinstance(sources, list):
        raise DatasetError(f"{where}: sources must be a list, got {sources!r:.80}")
    return DatasetInfo(
        directory=directory,
        kind=kind,
        splits=splits,
        tokenizer=tokenizer,
        sources=tuple(str(s) for s in sources),
    )


def shard_paths(info: DatasetInfo, split: str) -> list[str]:
    """Absolute paths of one split's shards; an unknown or empty split is an error."""
    if split not in info.splits:
        raise DatasetError(
            f"dataset {info.directory} has no split {split!r}; available: {sorted(info.splits)}"
        )
    found = info.splits[split]
    if not found.shards or found.documents == 0:
        raise DatasetError(
            f"dataset {info.directory}: split {split!r} is empty "
            f"({len(found.shards)} shards, {found.documents} documents)"
        )
    return [os.path.join(info.directory, shard) for shard in info.splits[split].shards]


def decode_record(kind: str, record: bytes) -> str | np.ndarray:
    """A record's document: str for kind "text", an int32 array of token ids for kind "tokens"."""
    kind_ = _parse_kind(kind)
    if kind_ is Kind.TEXT:
        try:
            return record.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"text record is not valid UTF-8: {e}") from e
    if len(record) % 4:
        raise DatasetError(f"token record has {len(record)} bytes, not a multiple of 4 (int32 ids)")
    return np.frombuffer(record, dtype="<i4").astype(np.int32)
