"""Outputs of conversions and exports: every precondition is checked before the input is read, and a
writer killed midway leaves `<output>.partial`, which a rerun replaces instead of being blocked."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from paxlite.checkpointing import pretrained
from paxlite.cli.convert import ConvertRequest, Source, Target, convert
from paxlite.interop import hf
from paxlite.paths import PARTIAL_MARKER, OutputExistsError, OutputPathError
from tests.xla_test_flags import COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAMS = {"embedding": {"embedding": np.arange(32, dtype=np.float32).reshape(4, 8)}}


class _ReadStarted(Exception):
    """Raised by the rigged readers: the input was touched."""


@pytest.fixture
def reading_fails(monkeypatch):
    """Reading any input raises _ReadStarted: a check that comes after the read never runs."""
    def fail(*args, **kwargs):
        raise _ReadStarted
    monkeypatch.setattr(hf, "load", fail)
    monkeypatch.setattr(hf, "from_meta", fail)


def _request(input_path, output, source=Source.HF):
    return ConvertRequest(source=source, target=Target.PAXLITE, input=str(input_path),
                          output=str(output))


def test_output_preconditions_come_before_reading_the_input(tmp_path, reading_fails):
    source = tmp_path / "hf_in"
    source.mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("a user's file")
    with pytest.raises(OutputExistsError, match="not empty; refusing to overwrite"):
        convert(_request(source, taken))
    with pytest.raises(OutputPathError, match="is \\(or holds\\) the input"):
        convert(_request(source, source))
    with pytest.raises(OutputPathError, match="is \\(or holds\\) the input"):
        convert(_request(source / "sub", tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="not a directory"):
        convert(_request(source, tmp_path / "file"))
    with pytest.raises(ValueError, match="--output='gs://b/out': gs:// paths are not supported"):
        convert(_request(source, "gs://b/out"))
    with pytest.raises(_ReadStarted):  # a fine output: only then is the input read
        convert(_request(source, tmp_path / "new"))
    assert (taken / "mine.txt").read_text() == "a user's file"
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()


def test_a_killed_save_leaves_partial_which_a_rerun_replaces(tmp_path, caplog):
    out = tmp_path / "out"
    # Killed (os._exit: no cleanup runs) while Orbax writes the checkpoint.
    script = (
        "import os, numpy as np, orbax.checkpoint as ocp\n"
        "from paxlite.checkpointing import pretrained\n"
        "def killed(self, *a, **k):\n"
        "    os.makedirs(os.path.join(str(self.directory), "
        "'checkpoint_00000000.orbax-checkpoint-tmp-1'))\n    os._exit(9)\n"
        "ocp.CheckpointManager.save = killed\n"
        f"pretrained.save_params({str(out)!r}, {{'w': np.ones((2, 2), np.float32)}})\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 9, result.stderr[-2000:]
    assert not out.exists() and (tmp_path / "out.partial" / PARTIAL_MARKER).exists()
    step_dir = pretrained.save_params(out, PARAMS, step=3)  # the rerun is not blocked
    assert step_dir == out / "checkpoints" / "checkpoint_00000003"
    assert not (tmp_path / "out.partial").exists()
    assert any("left by an interrupted run" in m for m in caplog.messages)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        "embedding": {"embedding": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=sharding)}
    }
    step, restored = pretrained.restore_params(out, abstract)
    assert step == 3
    np.testing.assert_array_equal(np.asarray(restored["embedding"]["embedding"]),
                                  PARAMS["embedding"]["embedding"])


def test_a_partial_directory_paxlite_did_not_write_is_never_removed(tmp_path):
    theirs = tmp_path / "out.partial"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="was not written by paxlite"):
        pretrained.save_params(tmp_path / "out", PARAMS)
    assert (theirs / "notes.txt").read_text() == "keep me"


def test_a_failed_hf_save_leaves_nothing_behind(tmp_path, monkeypatch, llama_gqa):
    from paxlite.interop import hf_write

    directory, _ = llama_gqa
    model = hf.load(directory)

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(hf_write.os, "pwrite", broken)  # the shard writes fail
    with pytest.raises(OSError, match="disk full"):
        hf.save(model, tmp_path / "hf_out")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    hf.save(model, tmp_path / "hf_out")  # and the rerun writes it whole
    assert sorted(os.listdir(tmp_path)) == ["hf_out"]
    assert sorted(os.listdir(tmp_path / "hf_out")) == [
        "config.json", "generation_config.json", "model.safetensors"]


def test_overwrite_replaces_an_earlier_conversion_only_once_the_new_one_is_complete(
        tmp_path, llama_gqa, gpt2, monkeypatch):
    """Without --overwrite an existing output is refused (the message names the flag); with it, a
    conversion's output is replaced, but only after the new one is complete: a failure midway
    leaves the earlier output whole. A directory holding anything a conversion does not write, or
    the input, is never replaced."""
    from paxlite.__main__ import main
    from paxlite.interop import stream

    out = tmp_path / "out"
    assert (
        main(["convert", "--from=hf", "--to=paxlite", f"--input={gpt2[0]}", f"--output={out}"]) == 0
    )
    before = hf.from_paxlite(out).num_params
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        convert(_request(llama_gqa[0], out))

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(stream, "write_paxlite", broken)
    with pytest.raises(OSError, match="disk full"):
        convert(dataclasses.replace(_request(llama_gqa[0], out), overwrite=True))
    monkeypatch.undo()
    assert hf.from_paxlite(out).num_params == before  # the earlier output, untouched
    assert sorted(os.listdir(tmp_path)) == ["out"]

    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={llama_gqa[0]}",
                 f"--output={out}", "--overwrite"]) == 0
    assert hf.from_paxlite(out).num_params == hf.load(llama_gqa[0]).num_params != before
    assert sorted(os.listdir(tmp_path)) == ["out"]

    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="holds 'notes.txt'.*earlier conversion's output"):
        convert(dataclasses.replace(_request(llama_gqa[0], out), overwrite=True))
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(OutputPathError, match="is \\(or holds\\) the input"):
        convert(ConvertRequest(source=Source.PAXLITE, target=Target.HF, input=str(out),
                               output=str(tmp_path), overwrite=True))
