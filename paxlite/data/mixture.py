"""Weighted mixtures of prepared datasets (DATA_MIXTURE on the default, Grain, input path).

Which source fills each row is Grain's own deterministic interleave, `grain.MapDataset.mix`: for
global row k it names one source from k and the integer proportions alone (exact integer
arithmetic, no random state, no history), and over any first N rows each source supplies within one
row of its share of N. The interleave is read as a pure function of the global row index, so there
is nothing to save for it but the index of the next row. The rows themselves do not come from
Grain's mixed dataset: each source keeps its own `packing.DocumentStream` (the same documents, order
and packing as that source alone as DATA_DIR), which re-epochs on its own when it runs out, so a
small source is repeated, never dropped, and the mixture never ends. Grain's `MapDataset.mix`
would end at the shortest source, and its iterator stops at the first exhausted one.

Grain resolves weights to integer proportions, the smallest weight becoming 100
(`_float_to_int_proportions`); they are passed here already as those integers (rounded, not
truncated), so the interleave is exactly the one `grain_proportions` reports: a source's share is
its proportion over their sum, within 1/100 of the smallest weight of what was asked. The mixed
length Grain computes is about sys.maxsize / number of sources rows (6e18 for three), beyond any
run.

Rows are chosen per *global* row (row r of step s is mixture row s x global batch + r), so the
mixture of a global batch is the same whatever the process count, and a process picks its own rows
`[process x local batch, (process + 1) x local batch)` of each batch without talking to the others.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from absl import logging

from paxlite.compat import GRAIN_SMALLEST_PROPORTION
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import local_batch_size
from paxlite.data.packing import DocumentStream, lm_features
from paxlite.data.pipeline import TextData, TextDataConfig

_STATE_VERSION = 1
REWEIGHT_FLAG = "--fdl.DATA_MIXTURE_REWEIGHT=true"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureSource:
    """One source of a mixture: its data, its weight (> 0; weights are normalised) and the unique
    name its metrics carry (`data/mixture/<name>`, `eval/<name>/loss`)."""

    name: str
    weight: float
    data: TextDataConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureDataConfig:
    """Weighted sources read as one stream of rows.

    Attributes:
        sources: at least one; names unique; every source cut into rows the same way (seq_len,
            packing, shuffle seed, vocab_size), since they fill the same batches.
        reweight: a resume whose saved weights differ from these continues with these (the saved
            document positions are kept) instead of failing; see `MixtureIterator.set_state`.
    """

    sources: Sequence[MixtureSource]
    reweight: bool = False

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources:
            raise ValueError("a data mixture needs at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture source names must be unique, got {names}")
        for source in self.sources:
            if not source.name or "/" in source.name:
                raise ValueError(f"mixture source name {source.name!r} must be non-empty and "
                                 "without '/'")
            for problem in weight_problems(source.name, source.weight):
                raise ValueError(f"mixture {problem}")
        first = self.sources[0].data
        for source in self.sources[1:]:
            for field in ("seq_len", "packed", "shuffle", "seed", "vocab_size", "train_split"):
                if getattr(source.data, field) != getattr(first, field):
                    raise ValueError(
                        f"mixture sources cut rows differently: {self.sources[0].name!r} has "
                        f"{field}={getattr(first, field)!r}, {source.name!r} has "
                        f"{getattr(source.data, field)!r}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def weights(self) -> list[float]:
        """The weights normalised to sum to 1 (what a checkpoint records)."""
        total = math.fsum(s.weight for s in self.sources)
        return [s.weight / total for s in self.sources]


def weight_problems(source: str, weight: Any) -> list[str]:
    """The rule for one source's weight, for every mixture (these sources, and DATA_MIXTURE's
    SeqIO form, which the experiments check with it): a finite number > 0."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
            math.isfinite(weight) and weight > 0):
        return [(f"source {source!r} has weight {weight!r}: weights must be numbers > 0 (finite; "
                "they are normalised to sum to 1)")]
    return []


def grain_proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """The integer proportions Grain mixes with: the smallest weight is 100, the others in ratio."""
    smallest = min(weights)
    return tuple(max(1, round(w / smallest * GRAIN_SMALLEST_PROPORTION)) for w in weights)


class Selection:
    """Which source fills each global row: Grain's `MapDataset.mix` over one endless index range
    per source, source i's range holding i, i + n, i + 2n, ..., so an element names its source.

    Grain's choice for row k is periodic in k with period P = sum of the proportions (its floor
    arithmetic shifts by whole numbers when k grows by P, level by level), so one period is read
    from Grain once and looked up after (`tests/data/test_mixture.py` checks the table against
    Grain far from 0). Reading Grain per row cost ~3.4 us, as much as packing the row's tokens at
    short rows. A period over `_MAX_PERIOD` rows (weights 10,000 times apart) is read per row.
    """

    _MAX_PERIOD = 1 << 20

    def __init__(self, weights: Sequence[float]):
        import grain  # here, not with the module: data/pipeline.py says why

        self.proportions = grain_proportions(weights)
        n = len(self.proportions)
        self._n = n
        self._mixed = grain.MapDataset.mix(
            [grain.MapDataset.range(i, sys.maxsize, n) for i in range(n)], self.proportions)
        self.period = sum(self.proportions)
        self._table = self.from_grain(0, self.period) if self.period <= self._MAX_PERIOD else None

    def from_grain(self, start: int, count: int) -> np.ndarray:
        """int64 [count]: the source index of global rows start .. start + count - 1, asking
        Grain."""
        mixed = self._mixed
        picks = np.fromiter(
            (mixed[k] for k in range(start, start + count)), dtype=np.int64, count=count
        )
        return picks % self._n

    def sources(self, start: int, count: int) -> np.ndarray:
        """int64 [count]: the source index of global rows start .. start + count - 1."""
        if self._table is None:
            return self.from_grain(start, count)
        return self._table[(start + np.arange(count, dtype=np.int64)) % self.period]


class MixtureIterator:
    """Infinite iterator over this process's rows of each global batch of a mixture, resumable.

    The state (JSON, saved in every checkpoint) holds every source's stream position, the global row
    the selection continues at, each source's weighted tokens supplied by this process so far, and
    the names and normalised weights, so a resume with other sources or weights is caught.
    """

    def __init__(
        self,
        streams: Sequence[DocumentStream],
        *,
        config: MixtureDataConfig,
        global_batch_size: int,
        process_index: int,
        process_count: int,
    ):
        self._streams = list(streams)
        self._config = config
        self._names = config.names
        self._weights = config.weights
        self._selection = Selection(self._weights)
        self._global = global_batch_size
        self._local = local_batch_size(
            global_batch_size=global_batch_size,
            process_index=process_index,
            process_count=process_count,
        )
        self._first_row = process_index * self._local
        self._next_row = 0  # global mixture row of the next batch's first row
        self._weighted = [0] * len(self._streams)
        data = config.sources[0].data
        self._meta = {
            "split": data.train_split,
            "packed": data.packed,
            "shuffle": data.shuffle,
            "seed": data.seed,
            "seq_len": data.seq_len,
            "global_batch_size": global_batch_size,
            "process_index": process_index,
            "process_count": process_count,
        }

    def __iter__(self) -> MixtureIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        picks = self._selection.sources(self._next_row + self._first_row, self._local)
        cut = {key: np.empty((self._local, self._meta["seq_len"]), dtype=np.int32)
               for key in ("targets", "segment_ids", "positions")}
        for index, stream in enumerate(self._streams):
            rows = np.flatnonzero(picks == index)
            if len(rows):
                got = stream.take(len(rows), features=False)
                # weight 1 where > 0
                self._weighted[index] += int(np.count_nonzero(got["segment_ids"]))
                for key, value in got.items():
                    cut[key][rows] = value
        self._next_row += self._global
        return lm_features(cut, start_id=self._streams[0].start_id)  # one tokenizer (MixtureData)

    def get_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            **self._meta,
            "names": list(self._names),
            "weights": list(self._weights),
            "selection": self._next_row,
            "streams": {
                name: s.get_state() for name, s in zip(self._names, self._streams, strict=True)
            },
            "weighted_tokens": dict(zip(self._names, self._weighted, strict=True)),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Other sources (names) are an error; other weights are an error
        unless the config says `reweight`: then every source continues from its saved document
        position, the counts since step 0 are kept, and the selection continues at the saved global
        row with the new weights, i.e. rows from the resume point on are chosen as a run that had
        used the new weights from step 0 chooses those rows (the interleave is a function of the
        row index); the next checkpoint records the new weights."""
        if not isinstance(state, dict) or "names" not in state or "streams" not in state:
            raise DatasetError(
                "the checkpoint's data position is not a mixture's (it was saved by a run reading "
                f"one source, DATA_DIR); this run mixes {self._names}: resume with the same data "
                "settings")
        if state.get("version") != _STATE_VERSION:
            raise DatasetError(f"not a paxlite mixture state (version {_STATE_VERSION}): "
                               f"{str(state)[:200]}")
        if state["names"] != self._names:
            raise DatasetError(
                f"the checkpoint was written by a mixture of sources {state['names']} and this run "
                f"mixes {self._names}: resume with the same DATA_MIXTURE sources")
        for key, expected in self._meta.items():
            if state.get(key) != expected:
                raise DatasetError(
                    f"data iterator state was saved with {key}={state.get(key)!r} but this "
                    f"pipeline has {key}={expected!r}; resume with the same data settings")
        saved = [float(w) for w in state["weights"]]
        if not np.allclose(saved, self._weights, rtol=1e-9, atol=1e-12):
            if not self._config.reweight:
                raise DatasetError(
                    "the checkpoint's mixture weights "
                    f"{dict(zip(self._names, saved, strict=True))} differ from this run's "
                    f"{dict(zip(self._names, self._weights, strict=True))}: restore the weights, "
                    f"or pass {REWEIGHT_FLAG} to re-weight from the checkpoint on")
            logging.warning(
                "DATA_MIXTURE_REWEIGHT: mixture weights %s -> %s from global row %d "
                "on; every source continues from its saved position",
                saved,
                self._weights,
                state["selection"],
            )
        for name, stream in zip(self._names, self._streams, strict=True):
            stream.set_state(state["streams"][name])
        self._next_row = int(state["selection"])
        self._weighted = [int(state["weighted_tokens"][name]) for name in self._names]


def mixture_fractions(states: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each source's share of the weighted tokens since step 0, from processes' iterator states
    (`MixtureIterator.get_state`); processes reading the same slice (the same `process_index`,
    i.e. feed) are counted once. All zero (nothing read yet): every share is 0."""
    by_feed = {state["process_index"]: state["weighted_tokens"] for state in states}
    names = states[0]["names"]
    totals = {name: sum(int(counts[name]) for counts in by_feed.values()) for name in names}
    total = sum(totals.values())
    return {name: (count / total if total else 0.0) for name, count in totals.items()}


class MixtureData:
    """Host-side batches of a mixture for one process: one `TextData` per source (so every check a
    single source gets runs for each), the sources' tokenizers checked to agree."""

    def __init__(self, config: MixtureDataConfig, *, global_batch_size: int, process_index: int = 0,
                 process_count: int = 1):
        self.config = config
        self.global_batch_size = global_batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.sources = {
            source.name: TextData(source.data, global_batch_size=global_batch_size,
                                  process_index=process_index, process_count=process_count)
            for source in config.sources
        }
        self.local_batch_size = next(iter(self.sources.values())).local_batch_size
        self._check_same_tokenizer()

    def _check_same_tokenizer(self) -> None:
        """Sources fill the same rows, so their ids must mean the same pieces: equal EOS ids and,
        for pre-tokenised sources, the same tokenizer sha256 in their manifests."""
        named = list(self.sources.items())
        first_name, first = named[0]
        for name, data in named[1:]:
            if data.eos_id != first.eos_id:
                raise DatasetError(f"mixture sources {first_name!r} and {name!r} have EOS ids "
                                   f"{first.eos_id} and {data.eos_id}: they must share one "
                                   "tokenizer")
        hashed = [(name, data.info.tokenizer["sha256"]) for name, data in named
                  if data.info.kind == "tokens" and data.info.tokenizer]
        for (name_a, sha_a), (name_b, sha_b) in itertools.pairwise(hashed):
            if sha_a != sha_b:
                raise DatasetError(f"mixture sources {name_a!r} (tokenizer sha256 {sha_a}) and "
                                   f"{name_b!r} (sha256 {sha_b}) were tokenised differently: they "
                                   "must share one tokenizer")

    @property
    def has_eval_data(self) -> bool:
        return any(data.has_eval_data for data in self.sources.values())

    def eval_sources(self) -> dict[str, TextData]:
        """The sources with a validation split, by name, in mixture order."""
        return {name: data for name, data in self.sources.items() if data.has_eval_data}

    def train_iterator(self) -> MixtureIterator:
        return MixtureIterator(
            [data.document_stream() for data in self.sources.values()],
            config=self.config,
            global_batch_size=self.global_batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
        )

    def num_eval_batches(self) -> int:
        return sum(data.num_eval_batches() for data in self.eval_sources().values())

    def eval_batches(self, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
        """Every source's own eval batches in turn (`num_batches` each; -1: each whole split): the
        pooled evaluation over all sources with a validation split."""
        for data in self.eval_sources().values():
            yield from data.eval_batches(num_batches)
