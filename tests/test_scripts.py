"""scripts_gpu/run_*.sh with Pax's positional arguments, run for real on a tiny model and dataset
(CPU)."""

import json
import os
import pathlib
import random
import subprocess

import pytest

from paxlite.data.prepare import prepare
from paxlite.data.train_tokenizer import train_tokenizer
from tests.fork_server import paxlite_python
from tests.xla_test_flags import COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--fdl.NUM_LAYERS=1", "--fdl.MODEL_DIMS=32", "--fdl.NUM_HEADS=4", "--fdl.DIMS_PER_HEAD=8",
        "--fdl.HIDDEN_DIMS=64", "--fdl.VOCAB_SIZE=512", "--fdl.MAX_SEQ_LEN=32"]


def _env(*, preset=True):
    """The scripts' environment. preset=False sets Pax's BASE_XLA_FLAGS to nothing, so the script
    takes no preset flags and skips the probe of the installed jaxlib that picks their spellings
    (a JAX start-up, ~0.8 CPU-s): for the tests about something else (failures, stop signals,
    refused settings). The presets have tests of their own (test_xla_presets.py), and the runs
    that train and evaluate keep them."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PATH": os.path.dirname(paxlite_python()) + ":" + os.environ["PATH"],
    }
    env["XLA_FLAGS"] = COMPILE_FLAGS
    if preset:
        env.pop("BASE_XLA_FLAGS", None)
    else:
        env["BASE_XLA_FLAGS"] = ""
    return env


def _script(name, *args, preset=True):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts_gpu", name), *args],
        capture_output=True,
        text=True,
        env=_env(preset=preset),
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    rng = random.Random(0)
    words = "a king rode out to the sea and the queen sang of rain and gold".split()
    (root / "c.txt").write_text(
        "\n\n".join(" ".join(rng.choice(words) for _ in range(30)) for _ in range(80))
    )
    vocab = train_tokenizer([str(root / "c.txt")], str(root / "spm"), vocab_size=280)
    prepare([str(root / "c.txt")], str(root / "data"), vocab_path=vocab, validation_fraction=0.05)
    (root / "lambada").mkdir()
    (root / "lambada" / "lambada_test.jsonl").write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(12))}) + "\n"
            for _ in range(5)
        )
    )
    return root, vocab


def test_pile_then_lambada_singlenode(tmp_path, assets):
    root, vocab = assets
    log_dir = tmp_path / "logs"
    trained = _script(
        "run_pile_singlenode.sh",
        str(root / "data"),
        vocab,
        "float32",
        "1",
        "2",
        str(log_dir),
        *TINY,
        "--fdl.MAX_STEPS=2",
        "--fdl.CHECKPOINT_EVERY_N_STEPS=2",
    )
    assert trained.returncode == 0, trained.stdout[-3000:]
    assert "Run succeeded!" in trained.stdout
    assert (log_dir / "pile_output.log").exists()
    config = json.loads((log_dir / "config.json").read_text())
    assert config["experiment"] == "Pile126M" and config["hparams"]["PERCORE_BATCH_SIZE"] == 2.0
    assert config["hparams"]["ICI_MESH_SHAPE"] == [1, 1, 1]

    evaluated = _script(
        "run_lambada_singlenode.sh",
        str(root / "lambada"),
        vocab,
        "float32",
        "1",
        "2",
        str(log_dir),
        *TINY,
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:]
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2 and "eval/lambada_acc_strict" in lines[-1]


def test_failure_is_reported(tmp_path, assets):
    _, vocab = assets
    result = _script(
        "run_pile_singlenode.sh",
        str(tmp_path / "no_data"),
        vocab,
        "float32",
        "1",
        "2",
        str(tmp_path / "logs"),
        *TINY,
        preset=False,
    )
    assert result.returncode == 2
    assert "Run failed" in result.stdout and "no_data" in result.stdout


def test_pile_and_lambada_from_a_pax_tfds_data_dir(tmp_path, assets):
    """Pax's layout: one TFDS_DATA_DIR made by the download scripts, passed as the first argument to
    both."""
    from paxlite.data import tfds_datasets

    root, vocab = assets
    pile = tmp_path / "pile"
    (pile / "train").mkdir(parents=True)
    texts = (root / "c.txt").read_text().split("\n\n")
    (pile / "train" / "00.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[:70])
    )
    (pile / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[70:]))
    tfds_dir = str(tmp_path / "tfds")
    tfds_datasets.build(tfds_datasets.THE_PILE, data_dir=tfds_dir, local_dir=str(pile))
    tfds_datasets.build(tfds_datasets.LAMBADA, data_dir=tfds_dir,
                        local_file=str(root / "lambada" / "lambada_test.jsonl"))
    log_dir = tmp_path / "logs"
    trained = _script("run_pile_singlenode.sh", tfds_dir, vocab, "float32", "1", "2", str(log_dir),
                      *TINY, "--fdl.MAX_STEPS=2", "--fdl.CHECKPOINT_EVERY_N_STEPS=2")
    assert trained.returncode == 0, trained.stdout[-3000:]
    config = json.loads((log_dir / "config.json").read_text())
    assert config["hparams"]["TFDS_DATA_DIR"] == tfds_dir and config["hparams"]["DATA_DIR"] is None
    assert "data.tfds_name: str | None = 'the_pile:1.0.0'" in (log_dir / "config.txt").read_text()
    evaluated = _script(
        "run_lambada_singlenode.sh", tfds_dir, vocab, "float32", "1", "2", str(log_dir), *TINY
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:]
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2 and "eval/lambada_acc_strict" in lines[-1]


# ---------------------------------------------------------------- run_llama_boolq.sh and the Slurm
# files
TINY_LLAMA_ENV = {
    "CONFIG": "paxlite.experiments.tiny.TinyLLaMA",
    "ICI_MESH_SHAPE": "[1,1,1]",
    "DCN_MESH_SHAPE": "[1,1,1]",
    "PERCORE_BATCH_SIZE": "2",
    "MAX_SEQ_LEN": "64",
    "MAX_STEPS": "2",
    "LR_COS_WARMUP": "1",
}
# Extra flags the script passes to each of its runs: one layer, which is all the checks need and
# shortens every run's trace and compile (the eval-only run must name the same model).
TINY_LLAMA_FLAGS = ("--fdl.NUM_LAYERS=1",)


def _llama(env, *args):
    full = {**_env(), **env}
    return subprocess.run(["bash", os.path.join(ROOT, "scripts_gpu", "run_llama_boolq.sh"), *args],
                          capture_output=True, text=True, env=full, timeout=600, check=False)


@pytest.fixture(scope="module")
def boolq_assets(tmp_path_factory):
    """A tokenizer with single pieces for 'yes' and 'no', and TFDS super_glue/boolq:1.0.2
    (ArrayRecord)."""
    import sentencepiece as spm

    from paxlite.data import tfds_datasets

    root = tmp_path_factory.mktemp("boolq")
    rng = random.Random(1)
    words = "a king rode out to the sea and the queen sang of rain and gold".split()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(
            [
                " ".join(rng.choice(words) for _ in range(10)) + "?\nanswer: yes no"
                for _ in range(200)
            ]
        ),
        model_prefix=str(root / "spm"),
        model_type="bpe",
        vocab_size=80,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=1,
        minloglevel=2,
        user_defined_symbols=["\u2581yes", "\u2581no"],
    )
    (root / "raw").mkdir()
    for split, n in (("train", 4), ("val", 6)):
        (root / "raw" / f"{split}.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "question": " ".join(rng.choice(words) for _ in range(4)),
                        "idx": i,
                        "label": i % 2 == 0,
                        "passage": " ".join(rng.choice(words) for _ in range(15)),
                    }
                )
                + "\n"
                for i in range(n)
            )
        )
    tfds_datasets.build(
        tfds_datasets.BOOLQ, data_dir=str(root / "tfds"), local_dir=str(root / "raw")
    )
    return str(root / "spm.model"), str(root / "tfds")


def _boolq_lines(job_dir):
    lines = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "eval/boolq_acc" in line]


def test_llama_boolq_trains_then_evaluates_and_eval_only(tmp_path, boolq_assets):
    vocab, tfds_dir = boolq_assets
    env = {
        "VOCAB_PATH": vocab,
        "TFDS_DATA_DIR": tfds_dir,
        "LOG_DIR": str(tmp_path / "llama"),
        **TINY_LLAMA_ENV,
    }
    # No BoolQ training feed: the tiny model trains on synthetic tokens, then BoolQ is scored.
    result = _llama(env, "--fdl.SYNTHETIC_DATA=true", *TINY_LLAMA_FLAGS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job = tmp_path / "llama" / "llama-TinyLLaMA-mbs-2-te-0-lora-0"
    assert (tmp_path / "llama" / "logs" / "llama-TinyLLaMA-mbs-2-te-0-lora-0.txt").exists()
    config = json.loads((job / "config.json").read_text())["hparams"]
    # Pax's SFT branch, with DECAY_START following the warm-up and the cosine ending at MAX_STEPS
    assert config["LEARNING_RATE"] == 1e-6 and config["LR_SCHEDULE"] == "linear_rampup_cosine_decay"
    assert (config["LR_COS_WARMUP"], config["LR_COS_DECAY_START"], config["LR_COS_DECAY_END"]) == (
        1,
        2,
        2,
    )
    assert config["EVAL_TASK"] == "boolq" and config["EVAL_LOOP_NUM_BATCHES"] == -1
    trained = _boolq_lines(job)
    assert [line["step"] for line in trained] == [2, 2]  # during training, then --mode=eval
    assert trained[0]["eval/boolq_acc"] == trained[1]["eval/boolq_acc"]

    # EVAL_ONLY=1 scores the checkpoint the path names (here the checkpoints directory itself).
    only = _llama({**env, "EVAL_ONLY": "1", "CHECKPOINT_RESTORE_PATH": str(job / "checkpoints")},
                  *TINY_LLAMA_FLAGS)
    assert only.returncode == 0, only.stdout[-3000:] + only.stderr[-3000:]
    lines = _boolq_lines(job)
    assert len(lines) == 3 and lines[-1]["eval/boolq_acc"] == trained[0]["eval/boolq_acc"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TFDS_DATA_DIR": "/x"}, "Need to set both VOCAB_PATH"),
        ({"VOCAB_PATH": "/x"}, "Need to set both VOCAB_PATH"),
        (
            {"VOCAB_PATH": "/x", "TFDS_DATA_DIR": "/x", "EVAL_ONLY": "1"},
            "EVAL_ONLY=1 needs CHECKPOINT_RESTORE_PATH",
        ),
        (
            {"VOCAB_PATH": "/x", "TFDS_DATA_DIR": "/x", "USE_LORA": "maybe"},
            "USE_LORA=maybe: expected 1/true",
        ),
        (
            {
                "VOCAB_PATH": "/x",
                "TFDS_DATA_DIR": "/x",
                "EVAL_ONLY": "1",
                "CHECKPOINT_RESTORE_PATH": "/nonexistent",
            },
            "holds no checkpoints/",
        ),
    ],
)
def test_llama_boolq_refuses_missing_settings(tmp_path, env, message):
    base = {k: v for k, v in _env(preset=False).items()
            if k not in ("VOCAB_PATH", "TFDS_DATA_DIR")}
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts_gpu", "run_llama_boolq.sh")],
        capture_output=True,
        text=True,
        env={**base, "LOG_DIR": str(tmp_path), "ENABLE_TE": "1", **env},
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and message in result.stderr, result.stderr


def _fake_srun(tmp_path):
    """An `srun` that records its arguments and environment instead of launching anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_RECORD.args"\n'
                                  'env > "$SRUN_RECORD.env"\n')
    (bin_dir / "srun").chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize(
    "sub, script, args, exported",
    [
        (
            "example_slurm_llama.sub",
            "run_llama_boolq.sh",
            [],
            {
                "VOCAB_PATH": "/mnt/vocab",
                "TFDS_DATA_DIR": "/mnt/datasets",
                "CONFIG": "LLaMA7B",
                "USE_LORA": "0",
                "EVAL_ONLY": "0",
                "ENABLE_TE": "0",
                "USE_MULTIPROCESS": "1",
                "CHECKPOINT_RESTORE_PATH": "{ROOT}/workspace/llama-checkpoint",
                "LOG_DIR": "{ROOT}/workspace/llama_boolq",
            },
        ),
        (
            "example_slurm_pile.sub",
            "run_pile_multinode.sh",
            ["/mnt/datasets", "/mnt/vocab", "bfloat16", "8", "4", "{ROOT}/workspace/log_dir"],
            {"ENABLE_TE": "0"},
        ),
        (
            "launch_base_script.sub",
            "run_base_config_multinode.sh",
            ["Synthetic126M", "bfloat16", "8", "{ROOT}/workspace/log_dir", "None", "", ""],
            {"ENABLE_TE": "0"},
        ),
    ],
)
def test_slurm_files_launch_an_existing_script_with_its_settings(
    tmp_path, sub, script, args, exported
):
    path = os.path.join(ROOT, "slurm", sub)
    assert subprocess.run(["bash", "-n", path], check=False).returncode == 0
    record = str(tmp_path / "srun")
    env = {
        **_env(),
        "PATH": _fake_srun(tmp_path) + ":" + _env()["PATH"],
        "SRUN_RECORD": record,
        "CONTAINER": "registry/paxlite:test",
        "BASE_WORKSPACE_DIR": str(tmp_path / "ws"),
        "BASE_TFDS_DATA_DIR": str(tmp_path / "tfds"),
        "BASE_VOCAB_PATH": str(tmp_path / "spm.model"),
        "BASE_CHECKPOINT_RESTORE_PATH": str(tmp_path / "ckpt"),
        "PAXLITE_DIR": ROOT,
    }
    if sub == "launch_base_script.sub":  # a synthetic experiment: no data, no vocabulary
        env = {k: v for k, v in env.items() if k not in ("BASE_TFDS_DATA_DIR", "BASE_VOCAB_PATH")}
    result = subprocess.run(
        ["bash", path], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    argv = pathlib.Path(record + ".args").read_text().split("\n")[:-1]
    assert "--container-image=registry/paxlite:test" in argv and "--export=ALL" in argv
    mounts = next(a for a in argv if a.startswith("--container-mounts="))
    assert f"{tmp_path / 'ws'}:{ROOT}/workspace" in mounts
    launched = argv.index("bash")
    assert argv[launched + 1] == os.path.join(ROOT, "scripts_gpu", script)
    assert (
        os.path.isfile(argv[launched + 1])
        and subprocess.run(["bash", "-n", argv[launched + 1]], check=False).returncode == 0
    )
    assert argv[launched + 2:] == [a.replace("{ROOT}", ROOT) for a in args]
    recorded = dict(
        line.split("=", 1)
        for line in pathlib.Path(record + ".env").read_text().splitlines()
        if "=" in line
    )
    text = pathlib.Path(argv[launched + 1]).read_text()
    for name, value in exported.items():
        assert recorded.get(name) == value.replace("{ROOT}", ROOT), name
        assert name in text or name == "ENABLE_TE", f"{script} does not read {name}"


@pytest.mark.parametrize("to", ["process_group", "script_only"])
def test_a_stop_signal_reaches_paxlite_and_the_script_waits_for_its_checkpoint(
    tmp_path, assets, to
):
    """Slurm and a terminal signal every process of the job (the script, python, tee); a container
    whose first process is the script signals the script alone. Either way paxlite checkpoints,
    once, and the log keeps its last lines."""
    import signal
    import time

    root, vocab = assets
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [
            "bash",
            os.path.join(ROOT, "scripts_gpu", "run_pile_singlenode.sh"),
            str(root / "data"),
            vocab,
            "float32",
            "1",
            "2",
            str(log_dir),
            *TINY,
            "--fdl.MAX_STEPS=1000000",
            "--fdl.SUMMARY_INTERVAL_STEPS=1",
            "--fdl.EVAL_INTERVAL_STEPS=1000000",
            "--fdl.CHECKPOINT_EVERY_N_STEPS=1000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(preset=False),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        metrics = log_dir / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        if to == "process_group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "Run stopped by SIGTERM after a checkpoint; the same command resumes it" in out
    log = (log_dir / "pile_output.log").read_text()
    # one request, one checkpoint
    assert "stopped after step" in log and "second stop signal" not in log
    stop = int(log.split("stopped after step ", 1)[1].split()[0])
    assert os.listdir(log_dir / "checkpoints") == [f"checkpoint_{stop:08d}"]
