"""Merged export of a LoRA run: the base model's parameters with the adapters folded in.

`python -m paxlite export_merged --input=JOB_DIR --output=DIR` reads the latest checkpoint of a LoRA
job (or a `checkpoints/` or `checkpoint_<STEP>` directory), computes `kernel + (alpha / r) * A @ B`
for every adapted projection (models/lora_merge.py:merge_lora) and writes an ordinary pretrained
checkpoint (checkpointing/pretrained.py: `DIR/checkpoints/checkpoint_<STEP>/state`, and
`DIR/model_config.json` with the base model's config, no LoRA). That is what the Hugging Face
converter and CHECKPOINT_RESTORE_PATH read, and it runs at the base model's speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import flax.linen as nn
import jax
import numpy as np
from etils import epath
from flax import traverse_util

from paxlite.checkpointing import pretrained
from paxlite.checkpointing.stream_read import CheckpointReader
from paxlite.checkpointing.stream_write import write_subtrees
from paxlite.errors import NotFoundError, SettingError
from paxlite.models.lora_merge import merge_lora
from paxlite.models.transformer import TransformerConfig, abstract_variables
from paxlite.paths import check_output_dir


def base_model_config(config: TransformerConfig) -> TransformerConfig:
    """`config` without its LoRA adapters: the model a merged export fits. Without FP8 too: an
    export holds weights only, not the FP8 scaling state of training (docs/fp8.md)."""
    return dataclasses.replace(config, lora_rank=None, lora_alpha=None, fp8=None)


def export_merged(
    input_path: str | os.PathLike, output_dir: str | os.PathLike, *, model_config: TransformerConfig
) -> epath.Path:
    """Writes the merged parameters of the LoRA checkpoint at `input_path`; returns the step dir.

    `model_config` is the LoRA run's model config (it must have ``lora_rank``). The checkpoint is
    read, merged and written one layer at a time (stream_read.py, stream_write.py), so the model
    never has to fit in host or device memory; the step number is kept.
    """
    if model_config.lora_rank is None:
        raise SettingError(
            "export_merged needs the LoRA run's model config (USE_LORA=true); this one has no "
            "adapters, so there is nothing to merge"
        )
    directory = check_output_dir(output_dir, setting="output directory", inputs=[input_path])
    step, step_dir = pretrained.find_checkpoint(input_path)
    layer_config = dataclasses.replace(model_config, scan_layers=False)
    # Per-layer copies of leaves chunked across layers (stream_read.py), beside the output.
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.rechunk-",
                               dir=os.path.dirname(directory))
    try:
        reader = CheckpointReader(step_dir, scratch_dir=scratch)
        _check_fits(reader, config=layer_config, step_dir=step_dir)

        def merged_layers():
            for top in reader.tops():  # no local names: a layer is dropped as soon as it is written
                yield top, jax.tree.map(np.asarray,
                                        merge_lora(reader.subtree(top), config=layer_config))

        written = write_subtrees(merged_layers(), directory,
                                 config=base_model_config(model_config), step=step)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return epath.Path(written)


def _check_fits(reader: CheckpointReader, *, config: TransformerConfig, step_dir: epath.Path
                ) -> None:
    """The checkpoint's params are exactly the (unscanned) LoRA model's; one error lists every
    missing, extra or wrongly shaped parameter before anything is written."""
    want = traverse_util.flatten_dict(nn.meta.unbox(abstract_variables(config)["params"]), sep="/")
    have = traverse_util.flatten_dict(
        {top: reader.subtree(top, stand_ins=True) for top in reader.tops()}, sep="/")
    problems = [f"  {name}: missing from the checkpoint" for name in sorted(set(want) - set(have))]
    problems += [
        f"  {name}: not a parameter of the LoRA model" for name in sorted(set(have) - set(want))
    ]
    problems += [f"  {name}: checkpoint shape {have[name].shape}, model shape {want[name].shape}"
                 for name in sorted(set(want) & set(have)) if have[name].shape != want[name].shape]
    if problems:
        raise pretrained.PretrainedCheckpointError(
            f"the checkpoint {step_dir} does not fit the LoRA model ({len(problems)} parameters):\n"
            + "\n".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else ""))


def find_job_config(input_path: str | os.PathLike) -> epath.Path | None:
    """The config.json of the job that `input_path` (the job dir, its checkpoints/ or one
    checkpoint_<STEP>) belongs to, or None."""
    here = epath.Path(os.path.abspath(os.fspath(input_path)))
    for directory in (here, here.parent, here.parent.parent):
        path = directory / "config.json"
        if path.exists():
            return path
    return None


def job_config_record(input_path: str | os.PathLike) -> tuple[str, dict]:
    """(--fdl_config name, {overridden hyperparameter: value}) from the config.json of the job that
    `input_path` belongs to. The name is data from that file: resolve it against the registry only
    (experiments/build.py:load_recorded_experiment), never by importing it."""
    path = find_job_config(input_path)
    if path is not None:
        record = json.loads(path.read_text())
        name = record["experiment"]
        for arg in record.get("command_line", []):
            if arg.startswith("--fdl_config="):
                name = arg[len("--fdl_config="):]
        hparams = record["hparams"]
        return name, {key: hparams[key] for key in record.get("overridden", [])}
    here = epath.Path(os.path.abspath(os.fspath(input_path)))
    raise NotFoundError(
        f"no config.json in {here} or the two directories above it: give the experiment with "
        "--fdl_config=NAME and the run's --fdl.USE_LORA=true --fdl.LORA_RANK=... "
        "--fdl.CHECKPOINT_RESTORE_PATH=... overrides"
    )
