"""The architecture switches of today's open families (LLaMA-3.x, Mistral, Qwen 2.5/3), declared,
defaulted, mapped to the model config and checked here.

Each is what a Hugging Face ``config.json`` says and a field of TransformerConfig takes: RoPE
frequency scaling (``rope_scaling``, LLaMA-3.1 and later), biases on the q, k and v projections
alone (``qkv_bias``, Qwen2/2.5), an RMSNorm over each head's q and k (``qk_norm``, Qwen3), a
sliding attention window (``sliding_window``, Mistral v0.1) and the tied input/output embedding
(``tie_word_embeddings``, the small LLaMA-3.2 and Qwen sizes). Only the families that have them
list these mixins (llama3.py, mistral.py, qwen.py, finetune.py), so the older experiments' `show`
and golden files keep their hyperparameters. Listed before the family's base class, so their
`model_config` sets the fields on the family's model.
"""

from __future__ import annotations

from typing import Literal

import fiddle as fdl

from paxlite.experiments.field_names import in_hparam_names
from paxlite.experiments.parallelism_settings import mesh_axis_sizes
from paxlite.models.rotary import RopeScaling
from paxlite.models.transformer import TransformerConfig

# RopeScaling's fields -> the hyperparameters that set them (the mapping and the names its
# problems are reported in).
ROPE_SCALING_FIELD_NAMES = {
    "factor": "ROPE_SCALING_FACTOR",
    "low_freq_factor": "ROPE_SCALING_LOW_FREQ_FACTOR",
    "high_freq_factor": "ROPE_SCALING_HIGH_FREQ_FACTOR",
    "original_max_position_embeddings": "ROPE_SCALING_ORIGINAL_MAX_POSITION",
}


class RopeScalingSettings:
    """RoPE frequency scaling for contexts longer than the pretraining one (models/rotary.py)."""

    # Hugging Face's rope_type: "llama3" (LLaMA-3.1/3.2/3.3) divides the low frequencies by
    # ROPE_SCALING_FACTOR, keeps the high ones and blends in between; "linear" (Gemma 3's global
    # layers) divides every frequency by it; "none": plain RoPE. The other four are llama3's
    # parameters, as config.json's rope_scaling names them (3.1/3.3: factor 8, 3.2: 32; low 1,
    # high 4, original context 8192 for all). "yarn" (gpt-oss) reads the factor and the original
    # context; its other fields are RopeScaling's defaults here (a converted model's own under
    # FineTune).
    ROPE_SCALING: Literal["none", "llama3", "linear", "yarn"] = "none"
    ROPE_SCALING_FACTOR: float = 8.0
    ROPE_SCALING_LOW_FREQ_FACTOR: float = 1.0
    ROPE_SCALING_HIGH_FREQ_FACTOR: float = 4.0
    ROPE_SCALING_ORIGINAL_MAX_POSITION: int = 8192

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        given = sorted(set(self.overridden) & set(ROPE_SCALING_FIELD_NAMES.values()))
        if self.ROPE_SCALING == "none":
            if given:
                problems.append(f"{', '.join(given)} set but ROPE_SCALING='none', so RoPE is not "
                                "rescaled: add --fdl.ROPE_SCALING=llama3, or drop them")
            return problems
        unread = [name for name in given if name != "ROPE_SCALING_FACTOR"]
        if self.ROPE_SCALING == "linear" and unread:
            problems.append(f"{', '.join(unread)} set but ROPE_SCALING='linear' reads only "
                            "ROPE_SCALING_FACTOR: drop them")
        unread = [name for name in given if "FREQ" in name]
        if self.ROPE_SCALING == "yarn" and unread:
            problems.append(f"{', '.join(unread)} set but ROPE_SCALING='yarn' reads only "
                            "ROPE_SCALING_FACTOR and ROPE_SCALING_ORIGINAL_MAX_POSITION: drop them")
        try:
            self.rope_scaling()
        except ValueError as e:
            problems += in_hparam_names([str(e).replace("RopeScaling.", "")],
                                        names=ROPE_SCALING_FIELD_NAMES)
        return problems

    def rope_scaling(self) -> RopeScaling | None:
        """The model's ``rope_scaling``, None without scaling."""
        if self.ROPE_SCALING == "none":
            return None
        fields = {field: getattr(self, name) for field, name in ROPE_SCALING_FIELD_NAMES.items()}
        return RopeScaling(kind=self.ROPE_SCALING, **fields)

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        config.rope_scaling = self.rope_scaling()
        return config


class AttentionVariantSettings:
    """Where the open families' attention differs from LLaMA-2's."""

    # Biases on the q, k and v projections and none on the output (Qwen2/2.5, whose other
    # matmuls have none either); False: as every other bias of the model.
    QKV_BIAS: bool = False
    # RMSNorm over each head's q and k after the projection and before RoPE (Qwen3), with the
    # model's LAYERNORM_EPSILON.
    QK_NORM: bool = False
    # Query i attends to keys i - SLIDING_WINDOW < j <= i (Mistral v0.1: 4096); None: all of the
    # context (Mistral v0.2/v0.3, LLaMA, Qwen).
    SLIDING_WINDOW: int | None = None

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        window = self.SLIDING_WINDOW
        if window is not None and window < 1:
            problems.append(f"SLIDING_WINDOW={window} must be None (the whole context) or a "
                            "positive number of keys seen per query, its own included")
        seq = mesh_axis_sizes(self)["seq"]
        if window is not None and seq > 1:
            problems.append(f"SLIDING_WINDOW={window} with a seq axis of {seq}: the "
                            "sequence-parallel attention attends to the whole context; drop the "
                            "seq axis")
        return problems

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        # None: as use_bias (the family's, False for all of these), so a model without q/k/v
        # biases has the config a converted one records
        config.qkv_bias = True if self.QKV_BIAS else None
        config.qk_norm = self.QK_NORM
        config.sliding_window = self.SLIDING_WINDOW
        return config


class TiedEmbeddingSettings:
    """Whether the output head is the input embedding table (HF ``tie_word_embeddings``)."""

    # True for the small sizes that tie them (LLaMA-3.2 1B/3B, Qwen2.5 0.5B-3B): one
    # [VOCAB_SIZE, MODEL_DIMS] table, used twice.
    TIE_EMBEDDINGS: bool = False

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        config.tie_embeddings = self.TIE_EMBEDDINGS
        return config
