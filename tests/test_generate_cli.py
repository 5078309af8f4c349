"""`python -m paxlite generate` end to end on a job trained for 2 steps, and its bad-input
errors."""

import functools
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.__main__ import main
from tests.fork_server import paxlite_python
from tests.xla_test_flags import COMPILE_FLAGS

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV["XLA_FLAGS"] = COMPILE_FLAGS  # one CPU device, as on a plain machine
PROMPTS = ([5, 9, 200, 17], [42])
NEW = 5


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job = tmp_path_factory.mktemp("gen") / "job"
    trained = subprocess.run(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=TinySynthetic", "--fdl.MAX_STEPS=2",
         f"--job_log_dir={job}"], capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return job


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    words = ["the", "king", "queen", "speaks", "of", "night", "and", "day", "to", "a", "fool"]
    rng = np.random.default_rng(0)
    (root / "corpus.txt").write_text(
        "\n".join(" ".join(rng.choice(words, size=8)) for _ in range(200)) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(root / "spm"), model_type="bpe",
        vocab_size=60, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        character_coverage=1.0, num_threads=1, minloglevel=2)
    return str(root / "spm.model")


REFERENCE_LEN = 16  # every prompt and continuation of the greedy references fits


@functools.cache
def _full_forward(job):
    """The job's model on its saved params, as one jitted forward pass over REFERENCE_LEN tokens:
    compiled once for all references (run op by op, each new length costs seconds)."""
    import fiddle as fdl

    from paxlite.checkpointing.pretrained import read_state
    from paxlite.experiments.build import load_experiment
    from paxlite.models.transformer import Transformer

    model = Transformer(fdl.build(load_experiment("TinySynthetic", ["MAX_STEPS=2"]).model_config()))
    params = read_state(job)[2]["params"]
    return functools.partial(jax.jit(lambda p, tokens: model.apply({"params": p}, tokens)), params)


def _greedy_reference(job, prompt, new):
    """Full forward pass (no cache) on the saved params, argmax at every step. The sequence is
    padded on the right to REFERENCE_LEN: the model is causal, so the logits at its last token do
    not see the padding."""
    seq = list(prompt)
    for _ in range(new):
        tokens = np.zeros((1, REFERENCE_LEN), np.int32)
        tokens[0, : len(seq)] = seq
        logits = _full_forward(job)(jnp.asarray(tokens))
        seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
    return seq[len(prompt):]


def test_generate_json_from_a_job_dir_is_the_greedy_continuation(job, capsys):
    # In this process (`python -m paxlite` calls the same main): a process of its own would cost
    # an interpreter and a JAX start-up for the same tokens.
    assert main(["generate", f"--job_log_dir={job}",
                 *[f"--prompt_ids={','.join(map(str, p))}" for p in PROMPTS],
                 f"--max_new_tokens={NEW}", "--temperature=0", "--format=json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_ids"] for r in records] == [list(p) for p in PROMPTS]
    assert all("text" not in r for r in records)  # TinySynthetic has no tokenizer
    for record, prompt in zip(records, PROMPTS, strict=True):
        assert record["ids"] == _greedy_reference(job, prompt, NEW)


def test_text_prompts_with_a_tokenizer_and_seeded_sampling(job, vocab, capsys):
    from paxlite.data.tokenizer import Tokenizer

    flags = ["generate", f"--job_log_dir={job}", f"--fdl.VOCAB_PATH={vocab}", "--prompt=the king",
             "--prompt=a fool speaks", "--max_new_tokens=4", "--temperature=1.0", "--top_k=20",
             "--top_p=0.9", "--format=json"]
    runs = []
    for seed in (7, 7):
        assert main([*flags, f"--seed={seed}"]) == 0
        runs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1]
    tokenizer = Tokenizer(vocab)
    for record, text in zip(runs[0], ["the king", "a fool speaks"], strict=True):
        assert record["prompt_ids"] == tokenizer.encode(text)
        whole = tokenizer.decode(record["prompt_ids"] + record["ids"])
        assert record["prompt"] + record["text"] == whole and record["prompt"] == text
        # the model's whole vocabulary (256) is sampled, as transformers samples it; ids past the
        # tokenizer's 60 decode to nothing
        assert 1 <= len(record["ids"]) <= 4 and all(0 <= i < 256 for i in record["ids"])
        assert tokenizer.decode([i for i in record["ids"] if i >= 60]) == ""


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt_ids=1"], "give exactly one of --job_log_dir=DIR and --checkpoint=PATH"),
        (["--job_log_dir={job}", "--checkpoint={job}", "--prompt_ids=1"], "not both"),
        (["--job_log_dir={job}", "--prompt=hello"], "text prompts need a tokenizer"),
        (["--job_log_dir={job}", "--prompt_ids=1", "--top_p=0"], "top_p must be in (0, 1]"),
        (["--job_log_dir={job}", "--prompt_ids=1", "--top_p=1.5"], "top_p must be in (0, 1]"),
        (["--job_log_dir={job}", "--prompt_ids=1", "--temperature=-1"], "temperature must be >= 0"),
        (["--job_log_dir={job}", "--prompt_ids=1,x"], "not a comma-separated list of integers"),
        (["--job_log_dir={job}", "--prompt_ids=1", "--prompt=hi"], "not both"),
        (["--job_log_dir={job}"], "no prompt"),
        (["--job_log_dir={job}", "--prompt_ids=1,2", "--max_new_tokens=63"], "max_seq_len=64"),
        (["--job_log_dir={job}", "--prompt_ids=256"], "outside the vocabulary [0, 256)"),
        (["--checkpoint=/absent/dir", "--prompt_ids=1"], "does not exist"),
        (["--job_log_dir={job}", "--prompt_file=/absent/prompts.txt"], "does not exist"),
        (["--job_log_dir={job}", "--prompt_ids=1", "--max_new_tokens=0"], "must be at least 1"),
        (
            ["--job_log_dir={job}", "--prompt_ids=1", "--add_bos=true"],
            "--add_bos=true applies to text prompts; --prompt_ids are used as given",
        ),
        (
            ["--job_log_dir={job}", "--prompt_ids=1", "--multiprocess_gpu"],
            "--multiprocess_gpu needs --server_addr",
        ),
        (
            ["--fdl_config=TinySynthetic", "--prompt_ids=1"],
            ("--fdl_config=TinySynthetic alone names no parameters: add "
            "--fdl.CHECKPOINT_RESTORE_PATH=PATH"),
        ),
        (
            ["--job_log_dir={job}", "--fdl.CHECKPOINT_RESTORE_PATH={job}", "--prompt_ids=1"],
            ("--fdl.CHECKPOINT_RESTORE_PATH and --job_log_dir / --checkpoint both name the "
            "parameters"),
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(job, capsys, flags, message):
    assert main(["generate", *[f.format(job=job) for f in flags]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_fdl_config_with_checkpoint_restore_path_reads_the_jobs_parameters(job, capsys):
    """--fdl_config=NAME --fdl.CHECKPOINT_RESTORE_PATH=PATH (as a training run restores) decodes
    what
    --job_log_dir decodes from the same checkpoint."""
    flags = ["--prompt_ids=3,1,4", "--max_new_tokens=3", "--format=json"]
    outputs = []
    for source in (
        [f"--job_log_dir={job}"],
        ["--fdl_config=TinySynthetic", f"--fdl.CHECKPOINT_RESTORE_PATH={job}/checkpoints"],
    ):
        assert main(["generate", *source, *flags]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["ids"])
    assert outputs[0] == outputs[1] == _greedy_reference(job, [3, 1, 4], 3)


@pytest.mark.parametrize("fdl_config, adds", [
    (None, False), ("TinyGLaM", False),  # GPT family (the job's TinySynthetic), GLaM: no BOS
    ("paxlite.experiments.tiny.TinyLLaMA", True), ("TinyMixtral", True), ("FujiTestV1", True),
])
def test_text_prompts_get_bos_as_the_experiment_family_was_trained(job, tmp_path, fdl_config,
                                                                   adds):
    """--add_bos=auto: LLaMA, Mixtral and Fuji experiments start text prompts with the tokenizer's
    BOS, GPT and GLaM do not (read off the experiment the job names or --fdl_config replaces;
    the model is not run: a LLaMA experiment cannot read this GPT job's parameters)."""
    import argparse

    from paxlite.cli.model_source import BosChoice, bos_id, resolve_model
    from paxlite.data.tokenizer import Tokenizer
    from tests.interop.test_hf_export import train_bpe

    tokenizer = Tokenizer(train_bpe(tmp_path))  # defines BOS (id 1)
    args = argparse.Namespace(job_log_dir=str(job), checkpoint=None, fdl_config=fdl_config)
    model = resolve_model(args, [])
    assert bos_id(BosChoice.AUTO, model, tokenizer) == (1 if adds else None)
    assert bos_id(BosChoice.TRUE, model, tokenizer) == 1
    assert bos_id(BosChoice.FALSE, model, tokenizer) is None


def test_bos_on_the_command_line_and_a_tokenizer_without_one(job, vocab, tmp_path, capsys):
    """The GPT job with a BOS-defining tokenizer: none by default, BOS first with --add_bos=true;
    with a tokenizer that has no BOS, --add_bos=true is an error (auto adds none)."""
    import sentencepiece as spm

    from tests.interop.test_hf_export import train_bpe

    with_bos = train_bpe(tmp_path)
    sp = spm.SentencePieceProcessor(model_file=with_bos)
    flags = ["generate", f"--job_log_dir={job}", f"--fdl.VOCAB_PATH={with_bos}",
             "--prompt=the quick brown fox", "--max_new_tokens=2", "--format=json"]
    ids = {}
    for extra in ([], ["--add_bos=true"]):
        assert main([*flags, *extra]) == 0
        ids[len(extra)] = json.loads(capsys.readouterr().out)["prompt_ids"]
    assert ids == {0: sp.encode("the quick brown fox"), 1: [1, *sp.encode("the quick brown fox")]}
    assert (
        main(
            [
                "generate",
                f"--job_log_dir={job}",
                f"--fdl.VOCAB_PATH={vocab}",
                "--prompt=the king",
                "--add_bos=true",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "--add_bos=true but the tokenizer" in err and "defines no BOS" in err, err
    assert len(err.splitlines()) == 1
