"""What a conversion is, apart from running it: its request (`ConvertRequest`: the formats, the
paths, the options of ``python -m paxlite convert``), the checks of a converted model against an
experiment's (`adopted_config`), where a paxlite checkpoint's model config and tokenizer come from
(``model_config.json``, the experiment, a training job's ``config.json``), and which existing
outputs ``--overwrite`` may replace. `paxlite.cli.convert` runs conversions and is the command line.

Above interop/ because ``--fdl_config`` and a job's ``config.json`` need the registry of
experiments. Only the standard library is imported at the top, so ``python -m paxlite`` stays fast.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from paxlite.data.tokenizer_hf import MODEL_TYPE_FILE
from paxlite.interop import hf_write
from paxlite.interop.errors import ConversionError
from paxlite.paths import require_local_path

if TYPE_CHECKING:
    from paxlite.interop.hf import Pretrained
    from paxlite.models.transformer import TransformerConfig

class Source(str, enum.Enum):
    HF = "hf"
    META = "meta"
    PAXLITE = "paxlite"
    PAX = "pax"  # Pax's own TensorStore layout (interop/pax.py); needs --fdl_config
    TE = "te"  # a paxlite checkpoint of a Transformer Engine model (ENABLE_TE=1; interop/te.py)


class Target(str, enum.Enum):
    PAXLITE = "paxlite"
    HF = "hf"
    PAX = "pax"
    TE = "te"


# Pax converter options (interop/te.py): (flag, dest) of those that only TE conversions read.
TE_OPTION_FLAGS: tuple[tuple[str, str], ...] = (
    ("--num-gqa-groups", "num_gqa_groups"), ("--te-qkv-layout", "te_qkv_layout"),
    ("--weight-only", "weight_only"), ("--skip-bias", "skip_bias"),
    ("--use-gated-activations", "use_gated_activations"), ("--pax-split-qkv", "pax_split_qkv"),
)


# Fields that decide the weights and the function a model computes (not dtypes, remat, dropout,
# init).
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "vocab_size", "num_layers", "model_dims", "num_heads", "kv_heads", "dims_per_head",
    "hidden_dims", "norm", "norm_epsilon", "activation", "gated_mlp", "use_bias", "tie_embeddings",
    "position_kind", "uses_qkv_bias", "qk_norm", "sliding_window",
    # Gemma's (models/open_model_fields.py)
    "post_norms", "scale_embeddings", "query_scale_dims", "attention_logit_cap", "final_logit_cap",
    "layer_types", "local_rope_theta",
    # gpt-oss's
    "attention_sinks", "out_bias",
)
# The same for the experts, compared when both models have them (routing decides the function).
MOE_ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_experts", "experts_per_token", "routing", "moe_layer_interval", "gated_experts",
    "expert_activation", "renormalize_top_k",
    "use_bias", "swiglu_limit", "swiglu_alpha",  # gpt-oss's
)


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)


def architecture_differences(have: TransformerConfig, *, want: TransformerConfig) -> list[str]:
    """'field: converted X, experiment Y' for every architecture field that differs."""
    from paxlite.models.transformer import PositionEmbedding

    fields = list(ARCHITECTURE_FIELDS)
    if want.position_kind is PositionEmbedding.ROTARY:
        fields += ["rope_theta", "rope_scaling"]
    if want.position_kind is PositionEmbedding.LEARNED:
        fields.append("max_seq_len")  # the learned position table's size
    pairs = [(name, getattr(have, name), getattr(want, name)) for name in fields]
    if have.moe is None or want.moe is None:
        pairs.append(("moe", _plain_moe(have), _plain_moe(want)))
    else:
        pairs += [(f"moe.{name}", getattr(have.moe, name), getattr(want.moe, name))
                  for name in MOE_ARCHITECTURE_FIELDS]
        pairs.append(("moe.expert_hidden_dims (effective)",
                      have.moe.expert_hidden_dims or have.hidden_dims,
                      want.moe.expert_hidden_dims or want.hidden_dims))
    out = []
    for name, a, b in pairs:
        same = (math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) and isinstance(b, float)
                else a == b)
        if not same:
            out.append(f"{name}: converted {_plain(a)!r}, experiment {_plain(b)!r}")
    return out


def _plain_moe(config: TransformerConfig) -> str | None:
    moe = config.moe
    return None if moe is None else f"{moe.num_experts} experts, top-{moe.experts_per_token}"


def experiment_model_config(name: str, assignments: Sequence[str] = ()) -> TransformerConfig:
    """The model an experiment builds (as the trainer builds it), after --fdl.X overrides."""
    import fiddle as fdl

    from paxlite.experiments.build import load_experiment

    return fdl.build(load_experiment(name, assignments).model_config())


def adopt_config(pretrained: Pretrained, *, config: TransformerConfig, experiment: str
                 ) -> Pretrained:
    """``pretrained`` with the experiment's model config; an error names every differing field."""
    return dataclasses.replace(pretrained, config=adopted_config(
        pretrained.config, config=config, experiment=experiment))


def adopted_config(converted: TransformerConfig, *, config: TransformerConfig, experiment: str
                   ) -> TransformerConfig:
    """The experiment's model config with the converted dtype; an error names every differing
    field."""
    diffs = architecture_differences(converted, want=config)
    if diffs:
        raise ConversionError(
            f"the converted model is not {experiment}'s model ({len(diffs)} differing fields):\n  "
            + "\n  ".join(diffs)
            + "\n(pick the matching experiment, or override its hyperparameters with "
            "--fdl.NAME=VALUE)")
    return dataclasses.replace(config, param_dtype=converted.param_dtype)


def model_config_from_job(job_dir: Any) -> TransformerConfig:
    """Rebuilds the model of a training job from its ``config.json`` (experiment + overrides)."""
    import fiddle as fdl

    from paxlite.config.errors import ConfigError
    from paxlite.experiments.build import load_recorded_experiment

    path = os.path.join(os.fspath(job_dir), "config.json")
    if not os.path.exists(path):
        raise ConversionError(
            f"no model config for the checkpoint: expected model_config.json beside it (written by "
            f"python -m paxlite convert) or a training job's config.json at {path}; or pass "
            "--fdl_config=NAME (with the job's --fdl.X overrides)")
    with open(path) as f:
        record = json.load(f)
    try:
        hparams = record["hparams"]
        experiment = load_recorded_experiment(
            record["experiment"], {k: hparams[k] for k in record.get("overridden", [])},
            source=path)
    except ConfigError:
        raise  # says itself what to pass instead
    except (KeyError, ValueError) as e:
        raise ConversionError(
            f"cannot rebuild the model from {path} ({type(e).__name__}: {e}); pass "
            "--fdl_config=NAME "
            "and the job's --fdl.X overrides instead") from e
    return _with_base_context(fdl.build(experiment.model_config()),
                              restore_path=hparams.get("CHECKPOINT_RESTORE_PATH"))


def _with_base_context(model: TransformerConfig, *, restore_path: str | None
                       ) -> TransformerConfig:
    """A fine-tuned RoPE model keeps the context of the model it started from: the job's
    MAX_SEQ_LEN is the length it trained at (often shorter), and RoPE has no table that it
    bounds. A model with a learned position table keeps the table's rows."""
    from paxlite.checkpointing.pretrained import load_model_config
    from paxlite.experiments.finetune import model_home
    from paxlite.models.transformer_config import PositionEmbedding

    if not restore_path or model.position_kind is not PositionEmbedding.ROTARY:
        return model
    base = load_model_config(model_home(restore_path))  # None once that directory is gone
    if base is None or base.max_seq_len <= model.max_seq_len:
        return model
    return dataclasses.replace(model, max_seq_len=base.max_seq_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertRequest:
    source: Source
    target: Target
    input: str
    output: str
    fdl_config: str | None = None
    assignments: tuple[str, ...] = ()
    dtype: str = "float32"
    vocab_size: int | None = None  # Meta checkpoints whose params.json says vocab_size -1
    te_options: dict[str, Any] | None = None  # given TE options (dest -> value); None: none given
    max_shard_size: str | None = None  # --to=hf only; None: transformers' default
    vocab_path: str | None = None  # --to=hf only: SentencePiece model to ship; None: the input's
    overwrite: bool = False  # replace an earlier conversion's output, once the new one is complete


def read_paxlite(path: str | os.PathLike, *, config: TransformerConfig | None = None,
                 dtype: str = "float32") -> Pretrained:
    """`hf.from_paxlite`, and also a training job that has no ``model_config.json``: its model is
    rebuilt from the job's ``config.json`` through the registry. ``config``, when given, is used
    only if no ``model_config.json`` lies beside the checkpoint."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.interop import hf

    _, step_dir = find_checkpoint(path)
    if hf.find_model_config(os.path.abspath(os.fspath(path)), step_dir=step_dir) is None:
        if config is None:
            config = model_config_from_job(step_dir.parent.parent)
        return hf.from_paxlite(path, config=config, dtype=dtype)
    return hf.from_paxlite(path, dtype=dtype)


def find_tokenizer(request: ConvertRequest) -> str | None:
    """The tokenizer an HF export ships: --vocab_path, else the input's own (an HF directory's
    tokenizer.json before its tokenizer.model, as transformers reads them; a Meta directory's or
    its parent's tokenizer.model), else, for a paxlite checkpoint, the tokenizer a conversion
    copied beside its model_config.json (json first too), else a paxlite training job's
    VOCAB_PATH; None when there is none."""
    from paxlite.data.tokenizer import tokenizer_in
    from paxlite.errors import NotFoundError

    if request.vocab_path is not None:
        if not os.path.isfile(request.vocab_path):
            raise NotFoundError(f"--vocab_path={request.vocab_path} does not exist (expected a "
                                "SentencePiece .model file or an HF tokenizer.json)")
        return request.vocab_path
    directory = os.path.abspath(request.input)
    candidates = []
    if request.source is Source.HF:
        candidates.append(tokenizer_in(directory) or "")
    if request.source is Source.META:
        candidates += [os.path.join(directory, hf_write.TOKENIZER_FILE),
                       os.path.join(os.path.dirname(directory), hf_write.TOKENIZER_FILE)]
    if request.source is Source.PAXLITE:
        from paxlite.checkpointing.pretrained import MODEL_CONFIG_FILE
        from paxlite.experiments.finetune import model_directory

        home = model_directory(directory)  # a conversion's output, whichever spelling is given
        if os.path.isfile(os.path.join(home, MODEL_CONFIG_FILE)):
            candidates.append(tokenizer_in(home) or "")
        candidates += [tokenizer_in(path) or "" if os.path.isdir(path) else path
                       for path in _job_vocab_paths(directory)]
    return next((c for c in candidates if os.path.isfile(c)), None)


def _ancestors(directory: str) -> list[str]:
    """``directory`` and the three directories above it: where a training job may start (DIR,
    DIR/checkpoints, DIR/checkpoints/checkpoint_N, its state)."""
    found = [directory]
    for _ in range(3):
        found.append(os.path.dirname(found[-1]))
    return found


def _job_vocab_paths(directory: str) -> list[str]:
    """VOCAB_PATH recorded in the config.json of the training job holding ``directory``."""
    for parent in _ancestors(directory):
        path = os.path.join(parent, "config.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    vocab = json.load(f).get("hparams", {}).get("VOCAB_PATH")
            except (OSError, ValueError, AttributeError):
                return []
            return [vocab] if isinstance(vocab, str) else []
    return []


# What a conversion writes at the top of its output: with --overwrite, a directory holding anything
# else is not an earlier conversion's and is never replaced.
CONVERSION_OUTPUT_NAMES = frozenset({
    "checkpoints", "model_config.json", "config.json", "generation_config.json",
    hf_write.INDEX_FILE, hf_write.TOKENIZER_FILE, "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.json", "chat_template.jinja", "additional_chat_templates",
    MODEL_TYPE_FILE,
})


def refuse_input_inside(output: str, *, inputs: Sequence[str]) -> None:
    from paxlite.paths import OutputPathError

    real = os.path.realpath(output)
    for given in inputs:
        source = os.path.realpath(os.path.abspath(given))
        if source == real or source.startswith(real + os.sep):
            raise OutputPathError(f"--output={output!r} is (or holds) the input {given!r}; write "
                                  "to a new directory (--overwrite never replaces the input)")


def replaceable(output: str, *, inputs: Sequence[str]) -> str | None:
    """The absolute output path if --overwrite is to replace it (an earlier conversion's output),
    None if there is nothing to replace; refuses anything else before any work."""
    from paxlite.paths import OutputExistsError

    path = os.path.abspath(require_local_path(output, setting="--output"))
    if not os.path.isdir(path) or not os.listdir(path):
        return None
    refuse_input_inside(path, inputs=inputs)
    foreign = sorted(n for n in os.listdir(path) if n not in CONVERSION_OUTPUT_NAMES
                     and not (n.endswith(".safetensors") and n.startswith("model")))
    if foreign:
        raise OutputExistsError(
            f"--output={path!r} holds "
            f"{foreign[0]!r}{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}, which "
            "no conversion writes: --overwrite replaces an earlier conversion's output only; "
            "choose a new or empty directory")
    return path


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    """What `convert_te` reports (the HF paths return a Pretrained with the same two fields)."""

    family: str
    num_params: int


def copy_tokenizer_beside_model(path: str, output: str) -> None:
    """The tokenizer file ``path`` copied beside a paxlite model in ``output``, where `generate`,
    FineTune and `--to=hf` look for it: an HF tokenizer.json with the files read with it (and the
    tokenizer.model and recorded model type beside it), or a SentencePiece or tiktoken model as
    tokenizer.model, with the tokenizer_config.json beside it (`generate` reads add_bos_token)."""
    import shutil

    source = os.path.dirname(path)
    if hf_write.is_hf_tokenizer(path):
        hf_write.copy_hf_tokenizer(source, output)
        beside = [(hf_write.TOKENIZER_FILE,) * 2, (MODEL_TYPE_FILE,) * 2]
    else:
        beside = [(os.path.basename(path), hf_write.TOKENIZER_FILE), ("tokenizer_config.json",) * 2]
    for name, as_name in beside:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(output, as_name))


def record_model_type(source: str, output: str) -> None:
    """The HF model's model_type (config.json of directory ``source``) beside the tokenizer.json
    copied into ``output``: transformers' choice of tokenizer class reads it, and a paxlite
    directory's own config.json is a training job's, so the HF one is not copied."""
    try:
        with open(os.path.join(source, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(model_type, str):
        hf_write.write_json(os.path.join(output, MODEL_TYPE_FILE), {"model_type": model_type})
