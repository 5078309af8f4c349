"""Weighted mixtures (data/mixture.py) on tiny hand-made token datasets.

Each source's token ids lie in a range of their own, so every row says which source it came from
without asking the mixture. References: Grain's mix computed here over plain index ranges, a hand
count of the shares, and each source read alone through TextData.
"""

from __future__ import annotations

import sys

import grain
import numpy as np
import pytest

from paxlite.data.errors import DatasetError, VocabError
from paxlite.data.mixture import MixtureData, MixtureDataConfig, MixtureSource, grain_proportions
from paxlite.data.pipeline import TextData, TextDataConfig
from tests.data.test_pipeline import token_manifest, write_dataset

SEQ = 8
RANGES = {"web": (3, 20), "code": (20, 40), "books": (40, 60)}  # token ids of each source: [lo, hi)


def _docs(name: str, count: int, *, seed: int) -> list[list[int]]:
    lo, hi = RANGES[name]
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, size=int(rng.integers(1, 13))).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    counts = {"web": 120, "code": 60, "books": 3}  # books runs out many times over
    return {name: write_dataset(root / name, {"train": _docs(name, n, seed=i),
                                              "validation": _docs(name, 5, seed=10 + i)},
                                tokenizer=token_manifest(), num_shards=2)
            for i, (name, n) in enumerate(counts.items())}


def _text_config(directory: str, **kwargs) -> TextDataConfig:
    return TextDataConfig(data_dir=directory, vocab_path=None, vocab_size=64, seq_len=SEQ, **kwargs)


def _config(
    dirs, weights: dict[str, float], *, reweight: bool = False, **kwargs
) -> MixtureDataConfig:
    return MixtureDataConfig(
        reweight=reweight,
        sources=[
            MixtureSource(name=name, weight=w, data=_text_config(dirs[name], **kwargs))
            for name, w in weights.items()
        ],
    )


def _source_of_rows(batch: dict[str, np.ndarray]) -> list[str]:
    """Which source each row came from, by its token ids (EOS = 1 and padding 0 are shared)."""
    out = []
    for row in batch["targets"]:
        ids = row[row > 1]
        names = {n for n, (lo, hi) in RANGES.items() if ((ids >= lo) & (ids < hi)).all()}
        assert len(names) == 1, row
        out.append(names.pop())
    return out


def _grain_sources(weights: list[float], rows: range) -> list[int]:
    """Grain's own mix over disjoint index ranges (source = value // M), read at `rows`."""
    m = sys.maxsize // 4
    mixed = grain.MapDataset.mix(
        [grain.MapDataset.range(i * m, (i + 1) * m) for i in range(len(weights))],
        list(grain_proportions(weights)),
    )
    return [mixed[k] // m for k in rows]


def _alone(
    directory: str, count: int, *, process_index=0, process_count=1, **kwargs
) -> dict[str, np.ndarray]:
    """The first `count` rows of one source read alone (one row per call)."""
    data = TextData(_text_config(directory, **kwargs), global_batch_size=process_count,
                    process_index=process_index, process_count=process_count)
    it = data.train_iterator()
    rows = [next(it) for _ in range(count)]
    return {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("process_count", [1, 2])
def test_rows_follow_grains_mix_and_each_sources_own_stream(dirs, packed, process_count):
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    batch, steps = 8, 25
    local = batch // process_count
    for process in range(process_count):
        data = MixtureData(_config(dirs, weights, packed=packed), global_batch_size=batch,
                           process_index=process, process_count=process_count)
        batches = [next(it) for it in [data.train_iterator()] for _ in range(steps)]
        got = [name for b in batches for name in _source_of_rows(b)]
        rows = [s * batch + process * local + r for s in range(steps) for r in range(local)]
        names = list(weights)
        assert got == [names[i] for i in _grain_sources(list(weights.values()), rows)]
        for name in names:  # the rows of each source are its own stream's, in order
            mine = [
                (b, r)
                for b, x in enumerate(batches)
                for r, n in enumerate(_source_of_rows(x))
                if n == name
            ]
            alone = _alone(dirs[name], len(mine), packed=packed, process_index=process,
                           process_count=process_count)
            for key in alone:
                np.testing.assert_array_equal(
                    np.stack([batches[b][key][r] for b, r in mine]),
                    alone[key],
                    err_msg=f"{name} {key}",
                )


def test_shares_stay_within_one_row_of_the_weights(dirs):
    """A hand count: over every first N rows each source's count is within one row of weight x N."""
    weights = {"web": 0.6, "code": 0.3, "books": 0.1}
    it = MixtureData(_config(dirs, weights), global_batch_size=10).train_iterator()
    got = np.array([name for _ in range(40) for name in _source_of_rows(next(it))])
    n = np.arange(1, len(got) + 1)
    for name, w in weights.items():
        assert np.abs(np.cumsum(got == name) - w * n).max() <= 1.0, name


def test_a_small_source_re_epochs_alone(dirs):
    weights = {"web": 1.0, "books": 1.0}  # books has 3 documents
    it = MixtureData(_config(dirs, weights), global_batch_size=8).train_iterator()
    batches = [next(it) for _ in range(12)]
    state = it.get_state()["streams"]
    assert state["books"]["epoch"] >= 5 and state["web"]["epoch"] == 0, state
    mine = [
        (b, r)
        for b, x in enumerate(batches)
        for r, n in enumerate(_source_of_rows(x))
        if n == "books"
    ]
    np.testing.assert_array_equal(np.stack([batches[b]["targets"][r] for b, r in mine]),
                                  _alone(dirs["books"], len(mine))["targets"])


@pytest.mark.parametrize("process_count", [1, 2])
def test_resume_mid_document_continues_bit_for_bit(dirs, process_count):
    weights = {"web": 2.0, "code": 1.0, "books": 1.0}
    for process in range(process_count):
        def make(process=process):
            return MixtureData(_config(dirs, weights), global_batch_size=4, process_index=process,
                               process_count=process_count).train_iterator()
        straight = make()
        want = [next(straight) for _ in range(9)]
        first = make()
        for _ in range(4):
            next(first)
        state = first.get_state()
        assert any(s["offset"] > 0 for s in state["streams"].values()), state  # inside a document
        assert state["selection"] == 16 and sum(state["weighted_tokens"].values()) > 0
        resumed = make()
        resumed.set_state(state)
        for want_batch in want[4:]:
            got = next(resumed)
            for key in want_batch:
                np.testing.assert_array_equal(got[key], want_batch[key], err_msg=key)
        assert resumed.get_state() == straight.get_state()


def test_other_weights_or_sources_are_errors_naming_both(dirs):
    old = MixtureData(
        _config(dirs, {"web": 0.7, "code": 0.3}), global_batch_size=4
    ).train_iterator()
    for _ in range(3):
        next(old)
    state = old.get_state()
    other = MixtureData(
        _config(dirs, {"web": 0.5, "code": 0.5}), global_batch_size=4
    ).train_iterator()
    with pytest.raises(DatasetError, match=r"0\.7.*0\.5.*DATA_MIXTURE_REWEIGHT=true"):
        other.set_state(state)
    renamed = MixtureData(
        _config(dirs, {"web": 0.7, "books": 0.3}), global_batch_size=4
    ).train_iterator()
    with pytest.raises(DatasetError, match=r"\['web', 'code'\].*\['web', 'books'\]"):
        renamed.set_state(state)
    single = TextData(_text_config(dirs["web"]), global_batch_size=4).train_iterator()
    with pytest.raises(DatasetError, match="DATA_MIXTURE run of sources"):
        single.set_state(state)
    with pytest.raises(DatasetError, match="not a mixture's"):
        other.set_state(single.get_state())


def test_reweight_keeps_positions_and_mixes_with_the_new_weights_from_the_resume_row(dirs):
    old = MixtureData(
        _config(dirs, {"web": 0.7, "code": 0.3}), global_batch_size=4
    ).train_iterator()
    before = [next(old) for _ in range(5)]
    state = old.get_state()
    new_weights = {"web": 0.2, "code": 0.8}
    it = MixtureData(
        _config(dirs, new_weights, reweight=True), global_batch_size=4
    ).train_iterator()
    it.set_state(state)
    after = [next(it) for _ in range(6)]
    got = [name for b in after for name in _source_of_rows(b)]
    assert got == [["web", "code"][i] for i in _grain_sources([0.2, 0.8], range(20, 44))]
    for name in new_weights:  # each source continues its own stream: nothing repeated or skipped
        rows = [
            b["targets"][r]
            for b in before + after
            for r, n in enumerate(_source_of_rows(b))
            if n == name
        ]
        np.testing.assert_array_equal(np.stack(rows), _alone(dirs[name], len(rows))["targets"])
    saved = it.get_state()
    assert saved["weights"] == [0.2, 0.8] and saved["selection"] == 44
    assert all(saved["weighted_tokens"][n] >= state["weighted_tokens"][n] for n in new_weights)


def test_eval_batches_are_each_sources_own(dirs):
    data = MixtureData(_config(dirs, {"web": 1.0, "books": 3.0}), global_batch_size=4)
    assert list(data.eval_sources()) == ["web", "books"]
    pooled = list(data.eval_batches(2))
    alone = [
        b
        for name in ("web", "books")
        for b in TextData(_text_config(dirs[name]), global_batch_size=4).eval_batches(2)
    ]
    assert len(pooled) == len(alone) == 4
    for got, want in zip(pooled, alone, strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_config_checks(dirs):
    web = _text_config(dirs["web"])
    with pytest.raises(ValueError, match="at least one source"):
        MixtureDataConfig(sources=[])
    with pytest.raises(ValueError, match="unique"):
        MixtureDataConfig(sources=[MixtureSource(name="a", weight=1, data=web)] * 2)
    with pytest.raises(ValueError, match="weight -1"):
        MixtureDataConfig(sources=[MixtureSource(name="a", weight=-1, data=web)])
    with pytest.raises(ValueError, match="seq_len"):
        MixtureDataConfig(
            sources=[
                MixtureSource(name="a", weight=1, data=web),
                MixtureSource(
                    name="b",
                    weight=1,
                    data=TextDataConfig(
                        data_dir=dirs["code"], vocab_path=None, vocab_size=64, seq_len=4
                    ),
                ),
            ]
        )


def test_fractions_count_weighted_tokens_over_all_processes(dirs):
    """Unpacked rows have padding (weight 0), so tokens and rows differ: the fractions are the
    weighted tokens of each source's rows, summed over both processes, counted here row by row."""
    from paxlite.data.mixture import mixture_fractions

    weights = {"web": 1.0, "code": 1.0, "books": 2.0}
    states, counts = [], dict.fromkeys(weights, 0.0)
    for process in range(2):
        it = MixtureData(
            _config(dirs, weights, packed=False),
            global_batch_size=8,
            process_index=process,
            process_count=2,
        ).train_iterator()
        for _ in range(7):
            batch = next(it)
            for row, name in enumerate(_source_of_rows(batch)):
                counts[name] += float(batch["weights"][row].sum())
        states.append(it.get_state())
    total = sum(counts.values())
    got = mixture_fractions(states + [states[1]])  # a second process of feed 1 is not counted twice
    assert got == pytest.approx({name: c / total for name, c in counts.items()}, abs=1e-12)
    rows = {
        name: sum(
            1
            for s in range(7)
            for k in range(8)
            if _grain_sources([1.0, 1.0, 2.0], [s * 8 + k])[0] == i
        )
        for i, name in enumerate(weights)
    }
    # not a row share
    assert got != pytest.approx({name: r / 56 for name, r in rows.items()}, abs=1e-3)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.7, 0.3], [1.0], [0.013, 1.0, 0.4, 2.5]])
def test_selection_table_is_grains_choice_anywhere(weights):
    """One period read from Grain stands for every row: checked against Grain itself far from 0."""
    from paxlite.data.mixture import Selection

    selection = Selection(weights)
    assert selection.period == sum(grain_proportions(weights))
    for start in (0, 7, selection.period * 3 + 5, 10**12 + 3, 2**61 + 11):
        np.testing.assert_array_equal(
            selection.sources(start, 300), selection.from_grain(start, 300)
        )
        np.testing.assert_array_equal(
            selection.sources(start, 300), _grain_sources(weights, range(start, start + 300))
        )


def test_rows_start_with_the_sources_start_id(dirs):
    """Each mixed row's segments start with the sources' document start (one tokenizer, so one
    id): the streams' `start_id` (TextData sets it from DOCUMENT_START and the tokenizer)."""
    it = MixtureData(_config(dirs, {"web": 1.0, "books": 3.0}), global_batch_size=4
                     ).train_iterator()
    zero = next(it)
    np.testing.assert_array_equal(zero["inputs"][zero["positions"] == 0], 0)
    for stream in it._streams:
        stream.start_id = 9
    batch = next(it)
    first = batch["positions"] == 0
    assert np.count_nonzero(first & (batch["weights"] > 0)) >= 4
    np.testing.assert_array_equal(batch["inputs"][first], 9)
    with pytest.raises(VocabError, match="no tokenizer is given"):
        MixtureData(_config(dirs, {"web": 1.0}, document_start="bos"), global_batch_size=4)
