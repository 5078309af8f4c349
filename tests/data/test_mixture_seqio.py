"""DATA_MIXTURE on the SeqIO path: a registered mixture by name, [name, weight] pairs, unknown
names.

Reuses test_seqio_pipeline's tiny TFDS datasets and tokenizer (the `seqio` extra, as there).
"""

import itertools

import numpy as np
import pytest

from paxlite.config.errors import ConfigError
from paxlite.data import seqio_pipeline as sp
from paxlite.data import seqio_tasks as st
from paxlite.data.errors import DatasetError
from paxlite.experiments.build import build_run_config
from tests.data.test_seqio_pipeline import assert_same, config, take, tfds_dir, vocab  # noqa: F401 (fixtures)


def _mixture(tfds_dir, vocab, mixture, **overrides):  # noqa: F811
    return sp.SeqIODataConfig(
        **(dict(config(tfds_dir, vocab).__dict__, task=None, mixture=mixture) | overrides)
    )


@pytest.fixture(scope="module")
def pile_batches(tfds_dir, vocab):  # noqa: F811
    """The first 6 batches of the_pile_lm read as a task (unshuffled: deterministic), for the
    tests below to compare against without building that pipeline twice."""
    return take(sp.SeqIOData(config(tfds_dir, vocab), global_batch_size=4).train_iterator(), 6)


def test_one_task_mixture_reads_that_task(tfds_dir, vocab, pile_batches):  # noqa: F811
    """A mixture of one task is that task: the same batches as reading the task itself."""
    want = {key: value[: 4 * 4] for key, value in pile_batches.items()}  # the first 4 batches
    got = take(sp.SeqIOData(_mixture(tfds_dir, vocab, [["the_pile_lm", 1.0]]), global_batch_size=4)
               .train_iterator(), 4)
    assert_same(got, want)


def test_pairs_are_registered_as_the_mixture_a_user_would_register(
    tfds_dir, vocab, pile_batches  # noqa: F811
):
    import seqio  # here, not at the top: see test_seqio_pipeline's docstring

    pairs = (("the_pile_lm", 0.7), ("c4_lm_v301_gpt", 0.3))
    data = sp.SeqIOData(_mixture(tfds_dir, vocab, pairs), global_batch_size=4)
    name = st.mixture_name(pairs)
    assert seqio.get_mixture_or_task(name).get_rate(seqio.get_mixture_or_task("the_pile_lm")) == 0.7
    if "user_mix" in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove("user_mix")
    seqio.MixtureRegistry.add("user_mix", list(pairs))  # what an experiment module would do
    by_name = sp.SeqIOData(_mixture(tfds_dir, vocab, "user_mix"), global_batch_size=4)
    got, want = take(data.train_iterator(), 6), take(by_name.train_iterator(), 6)
    assert_same(got, want)
    assert got["targets"].shape == (24, 16)
    assert not np.array_equal(got["targets"], pile_batches["targets"])  # C4 feeds it too
    resumed = data.train_iterator()
    resumed.set_state({**resumed.get_state(), "batches_consumed": 4})
    assert_same(take(resumed, 2), {k: v[16:] for k, v in got.items()})
    evals = list(itertools.islice(data.eval_batches(1), 1))
    assert evals[0]["targets"].shape == (4, 16) and np.any(evals[0]["weights"])


def test_unknown_name_lists_what_is_registered(tfds_dir, vocab):  # noqa: F811
    with pytest.raises(DatasetError, match=r"'the_pile_lmm'.*did you mean "
                                           r"'the_pile_lm'.*registered: \[") as info:
        sp.SeqIOData(_mixture(tfds_dir, vocab, [["the_pile_lmm", 1.0]]), global_batch_size=4)
    assert "\n" not in str(info.value)


def test_experiment_maps_data_mixture_to_seqio(tfds_dir, vocab):  # noqa: F811
    base = [f"VOCAB_PATH={vocab}", f"TFDS_DATA_DIR={tfds_dir}", "INPUT_PIPELINE='seqio'"]
    _, run = build_run_config("TinyShakespeare", [*base, "DATA_MIXTURE='user_mix'"])
    assert run.data.mixture == "user_mix" and run.data.task is None
    _, run = build_run_config("TinyShakespeare", [*base, ("DATA_MIXTURE=[['the_pile_lm', 2], "
                                                         "['c4_lm_v301_gpt', 1]]")])
    assert run.data.mixture == (("the_pile_lm", 2.0), ("c4_lm_v301_gpt", 1.0))
    with pytest.raises(ConfigError, match="weights must be numbers > 0"):
        build_run_config("TinyShakespeare", [*base, "DATA_MIXTURE=[['the_pile_lm', 0]]"])
