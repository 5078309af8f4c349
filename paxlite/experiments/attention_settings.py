"""The attention hyperparameters, declared and checked together (LanguageModelExperiment.validate).

USE_CUDNN_FLASH_ATTENTION, ATTENTION_IMPLEMENTATION and ATTENTION_KIND must agree, the family's
model must use them, and a kernel asked for by name must fit the model's dtype, head dims,
sequence length and logit bias. What depends on the devices (the backend, the GPU generation) is
checked when the step is traced (models/attention_kernels.py). docs/attention.md.

With ENABLE_TE=1 the layers are Transformer Engine's, which read neither attention switch nor a
name-based CHECKPOINT_POLICY: those are refused here first (transformer_engine_settings.py),
because this is where the model config, whose TE fields import TE, is first made.
"""

from __future__ import annotations

from typing import Literal

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Derived
from paxlite.experiments.transformer_engine_settings import check_settings_te_ignores
from paxlite.models.attention import AttentionKind
from paxlite.models.attention_kernels import (
    AttentionImplementation,
    cudnn_problems,
    pallas_problems,
)
from paxlite.models.splash_attention import splash_problems
from paxlite.models.transformer_config import PositionEmbedding


class AttentionSettings:
    """Which attention runs (docs/attention.md); model_settings.py maps them to the model."""

    # Pax's switch: true runs cuDNN flash attention, and refuses to start (naming why) where it
    # cannot run: CPU, float32, dims per head not a multiple of 8 or above 256 (128 before
    # Hopper). Packed rows reach it as a dense mask.
    USE_CUDNN_FLASH_ATTENTION: bool = False
    # The kernel of fused attention: "auto" (cuDNN where it fits, else XLA), "xla", "cudnn", or
    # "pallas_triton" (JAX's Pallas-Triton flash attention, which reads packed rows' segment ids in
    # the kernel instead of a dense mask; GPU only, no relative position bias), or "splash" (JAX's
    # Pallas splash attention for TPUs: segment ids, grouped kv heads, sliding windows and logit
    # soft-capping in the kernel; TPU only, no relative position bias).
    ATTENTION_IMPLEMENTATION: Literal["auto", "xla", "cudnn", "pallas_triton", "splash"] = Derived(
        lambda hp: "cudnn" if hp.USE_CUDNN_FLASH_ATTENTION else "auto",
        doc="'cudnn' if USE_CUDNN_FLASH_ATTENTION else 'auto'")
    # How attention computes softmax(q k^T) v: "dot_product" (einsums, Pax) or "flash" (a fused
    # kernel, ATTENTION_IMPLEMENTATION's). Same parameters, same result.
    ATTENTION_KIND: Literal["dot_product", "flash"] = Derived(
        lambda hp: ("flash" if hp.ATTENTION_IMPLEMENTATION in ("cudnn", "pallas_triton", "splash")
                    else "dot_product"),
        doc="'flash' if ATTENTION_IMPLEMENTATION is 'cudnn', 'pallas_triton' or 'splash' else "
            "'dot_product'")


def check_attention_settings(experiment) -> None:
    """A LanguageModelExperiment's attention settings agree with each other, the model uses them,
    and a kernel asked for by name fits the model's dtype and head dims (the backend is checked when
    the step is traced, where it is known): one error naming every reason, before anything is
    built."""
    check_settings_te_ignores(experiment)
    implementation = AttentionImplementation(experiment.ATTENTION_IMPLEMENTATION)
    problems = []
    if experiment.USE_CUDNN_FLASH_ATTENTION and implementation is not AttentionImplementation.CUDNN:
        problems.append(
            f"USE_CUDNN_FLASH_ATTENTION=true asks for cuDNN and ATTENTION_IMPLEMENTATION="
            f"{implementation.value!r} for another kernel: drop one of them")
    einsums = experiment.ATTENTION_KIND == AttentionKind.DOT_PRODUCT.value
    if implementation.is_fused_kernel and einsums:
        problems.append(
            f"ATTENTION_IMPLEMENTATION={implementation.value!r} is a fused kernel and "
            "ATTENTION_KIND='dot_product' runs einsums: set ATTENTION_KIND='flash' (or leave it "
            "unset)")
    if problems:
        raise ConfigError(f"invalid {experiment.name} attention settings: " + "; ".join(problems))
    model = experiment.model_config()  # not built: a family's own checks (NUM_KV_HEADS) come later
    built = (AttentionKind(model.attention_kind).value,
             AttentionImplementation(model.attention_implementation).value)
    if built != (experiment.ATTENTION_KIND, implementation.value):
        # A family whose model_config drops the switch would silently run something else.
        raise ConfigError(
            f"ATTENTION_KIND={experiment.ATTENTION_KIND!r}, ATTENTION_IMPLEMENTATION="
            f"{implementation.value!r}: {experiment.name}'s model does not use them (it builds "
            f"{built})")
    relative_bias = model.position_embedding == PositionEmbedding.RELATIVE_BIAS
    # Llama 4's chunks and gpt-oss's sinks: cuDNN and Pallas-Triton have neither
    chunk, sinks = model.attention_chunk_size, bool(model.attention_sinks)
    if implementation is AttentionImplementation.CUDNN:
        problems = cudnn_problems(dtype=experiment.FPROP_DTYPE, head_dim=experiment.DIMS_PER_HEAD,
                                  seq_len=experiment.MAX_SEQ_LEN,
                                  dense_bias=experiment.PACKED_INPUT or relative_bias,
                                  vmapped_stages=model.pipeline is not None, chunk=chunk,
                                  sinks=sinks)
        setting = ("USE_CUDNN_FLASH_ATTENTION=true" if experiment.USE_CUDNN_FLASH_ATTENTION
                   else "ATTENTION_IMPLEMENTATION='cudnn'")
        if problems:
            raise ConfigError(
                f"{setting} cannot run {experiment.name}: " + "; ".join(problems) + " (FPROP_DTYPE="
                f"{experiment.FPROP_DTYPE!r}, DIMS_PER_HEAD={experiment.DIMS_PER_HEAD}, "
                f"MAX_SEQ_LEN={experiment.MAX_SEQ_LEN}); or use ATTENTION_IMPLEMENTATION='auto' "
                "(cuDNN where it fits, else XLA)")
    if implementation is AttentionImplementation.SPLASH and relative_bias:
        raise ConfigError(f"ATTENTION_IMPLEMENTATION='splash' cannot run {experiment.name}: "
                          + splash_problems(has_bias=True)[0])
    if implementation is AttentionImplementation.PALLAS_TRITON:
        problems = pallas_problems(has_bias=relative_bias, chunk=chunk, sinks=sinks)
        if problems:
            raise ConfigError("ATTENTION_IMPLEMENTATION='pallas_triton' cannot run "
                              f"{experiment.name}: "
                              + "; ".join(problems))
