"""Merged export of a LoRA run: the base model's parameters with the adapters folded in.

`python -m paxlite export_merged --input=JOB_DIR --output=DIR` reads the latest checkpoint of a LoRA
job (or a `checkpoints/` or `checkpoint_<STEP>` directory), computes `kernel + (alpha / r) * A @ B`
for every adapted projection (models/lora_merge.py:merge_lora) and writes an ordinary pretrained
checkpoint (train/pretrained.py: `DIR/checkpoints/checkpoint_<STEP>/state`, and
`DIR/model_config.json` with the base model's config, no LoRA). That is what the Hugging Face
converter and CHECKPOINT_RESTORE_PATH read, and it runs at the base model's speed.
"""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
from etils import epath

from paxlite.errors import NotFoundError, SettingError
from paxlite.models.lora_merge import merge_lora
from paxlite.models.transformer import TransformerConfig, abstract_variables
from paxlite.paths import check_output_dir
from paxlite.train import pretrained


def base_model_config(config: TransformerConfig) -> TransformerConfig:
    """`config` without its LoRA adapters: the model a merged export fits. Without FP8 too: an
    export holds weights only, not the FP8 scaling state of training (docs/fp8.md)."""
    return dataclasses.replace(config, lora_rank=None, lora_alpha=None, fp8=None)


def export_merged(
    input_path: str | os.PathLike, output_dir: str | os.PathLike, *, model_config: TransformerConfig
) -> epath.Path:
    """Writes the merged parameters of the LoRA checkpoint at `input_path`; returns the step dir.

    `model_config` is the LoRA run's model config (it must have ``lora_rank``). The parameters are
    read onto the default device, so the whole model must fit there; the step number is kept.
    """
    if model_config.lora_rank is None:
        raise SettingError(
            "export_merged needs the LoRA run's model config (USE_LORA=true); this one has no "
            "adapters, so there is nothing to merge"
        )
    check_output_dir(output_dir, setting="output directory", inputs=[input_path])  # before reading
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
        nn.meta.unbox(abstract_variables(model_config)["params"]),
    )
    step, params = pretrained.restore_params(input_path, abstract)
    merged = merge_lora(params, config=model_config)
    return pretrained.save_params(
        output_dir, merged, step=step, model_config=base_model_config(model_config)
    )


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
