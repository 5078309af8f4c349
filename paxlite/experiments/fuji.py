"""AXLearn's Fuji family (apple/axlearn `experiments/text/gpt/fuji.py`) as paxlite experiments.

Fuji models are LLaMA-shaped: pre-RMSNorm (eps 1e-5), SwiGLU, RoPE, no biases, grouped-query
attention where AXLearn has it. The mapping onto `TransformerConfig` is `BaseLLaMA`'s; Fuji adds the
RoPE base and the tied head. A (size, version) pair exists only where AXLearn's TOTAL_TOKENS table
has it (versions v1, v2, v3 and v3-tiktoken, Llama 3's vocabulary; sizes test, 1B, 3B, 7B, 8B, 70B,
405B); each has a `-flash` variant, and 1B/3B/7B/8B have `-single-host` ones. `--fdl_config` takes
the class names (`Fuji7BV2Flash`, `Fuji8BV3Tiktoken`) and AXLearn's names (`fuji-7B-v2-flash`,
`fuji-8B-v3-tiktoken`); docs/training.md ("Fuji") has the table. `named_trainer_configs()` is
AXLearn's registry lookup ({AXLearn name: config function}) for Python callers.

What is AXLearn's and how it maps:
- Batch: AXLearn fixes the *global* batch (tokens per batch / sequence length: v1 2048 x 2048,
  v2 1024 x 4096, v3 and v3-tiktoken 2048 x 8192), so GLOBAL_BATCH_SIZE is set and
  PERCORE_BATCH_SIZE is unused.
- Steps: MAX_STEPS = TOTAL_TOKENS // TOKENS_PER_BATCH (v1 7B 262,144; v1 70B 367,001; v2 524,288;
  v3 983,040). The single-host variants keep it, as AXLearn's clone does.
- Learner (AXLearn `adamw_decoupled_learner_config`): global-norm clipping to 1.0, then Adam
  (b1 0.9, b2 0.95, eps 1e-8) with decoupled weight decay; the schedule multiplier eta_t rises
  linearly from 0 over 2000 steps, then follows a cosine to 0.1 at MAX_STEPS. This is Pax's
  linear_rampup_cosine_decay with LR_COS_DECAY_START = LR_COS_WARMUP and LR_COS_DECAY_END =
  MAX_STEPS, so no new schedule kind is needed.
- Weight decay, read from AXLearn's `adamw_decoupled_optimizer` (Loshchilov & Hutter, Algorithm 2):
  the update is -eta_t * (peak_lr * adam_update + wd * param); the decay is scaled by the schedule
  multiplier but NOT by the peak learning rate. paxlite's optimizer scales the decay by the whole
  rate (peak_lr * eta_t, as optax/PyTorch AdamW), so Fuji sets WEIGHT_DECAY = DECOUPLED_WEIGHT_DECAY
  / LEARNING_RATE (0.1 / 3e-4 = 333.3), which gives AXLearn's update exactly: each step shrinks the
  parameters by a factor (1 - 0.1 * eta_t). For the PyTorch-style reading (decay 0.1 * lr) pass
  --fdl.WEIGHT_DECAY=0.1, which replaces the derived value.
- Init: AXLearn draws every weight from normal(0, 1/fan_in); INIT_STD = MODEL_DIMS**-0.5 gives that
  for every matrix whose fan-in is d_model (all but the MLP down projection, whose fan-in is the ffn
  size) and for the embedding (1/fan_out = 1/d_model).
- Not reproduced: AXLearn's rotate-half RoPE layout (paxlite rotates interleaved pairs; the same
  function up to a fixed permutation of q/k, which training from scratch does not see). Its
  per-hardware mesh rules are in fuji_mesh.py, chosen by the AXLearn-style launcher's
  --mesh_selector; `paxlite.main` uses ICI/DCN_MESH_SHAPE as given. Text is packed with segment
  masks (PACKED_INPUT), which is stricter than AXLearn's window packing.
- `-fp8` (every size but test; `-flash-fp8`, `-fp8-single-host`, `-flash-fp8-single-host` too):
  AXLearn appends `FP8ConfigModifier(fp8_amax_history_length=128)` to its FP8-capable GPU mesh
  rules; intended for all of them, but a bug leaves the p5.48xlarge/p4de rule without FP8. Here
  FP8 does not depend on the mesh rule, so `-fp8` is what AXLearn intends on every GPU:
  USE_FP8=True with FP8_AMAX_HISTORY_LENGTH=128 (docs/fp8.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from paxlite.config.experiment import Derived
from paxlite.experiments.architecture_settings import TiedEmbeddingSettings
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings
from paxlite.experiments.optimizer_settings import GPT3Optimizer

_TERA = 1024**4  # AXLearn's "T" of TOTAL_TOKENS


@dataclasses.dataclass(frozen=True, kw_only=True)
class FujiVersion:
    """What changes between Fuji v1, v2, v3 and v3-tiktoken (docs/training.md's versions table)."""

    vocab_size: int
    max_seq_len: int
    rope_theta: float
    tokens_per_batch: int
    # AXLearn's -single-host *intended* divisor of the batch (its code divides by 128 for all).
    single_host_divisor: int
    # The tokenizer's special ids where AXLearn states them (v3-tiktoken: Llama 3's tokenizer).
    # paxlite reads eos/pad from the SentencePiece model or the dataset's manifest, so these are
    # documentation and a check for prepared data, not settings.
    pad_id: int | None = None
    eos_id: int | None = None


# Keyed by AXLearn's version name without the "v": "1", "2", "3", "3-tiktoken".
VERSIONS: Mapping[str, FujiVersion] = MappingProxyType({
    "1": FujiVersion(vocab_size=32 * 1024, max_seq_len=2048, rope_theta=1e4,
                     tokens_per_batch=4 * 1024**2, single_host_divisor=32),
    "2": FujiVersion(vocab_size=32 * 1024, max_seq_len=4096, rope_theta=1e4,
                     tokens_per_batch=4 * 1024**2, single_host_divisor=32),
    "3": FujiVersion(vocab_size=128 * 1024, max_seq_len=8192, rope_theta=5e5,
                     tokens_per_batch=16 * 1024**2, single_host_divisor=128),
    # v3 with Llama 3's tiktoken vocabulary (128,256 entries; pad 128004, eos 128001).
    "3-tiktoken": FujiVersion(vocab_size=128_256, max_seq_len=8192, rope_theta=5e5,
                              tokens_per_batch=16 * 1024**2, single_host_divisor=128,
                              pad_id=128_004, eos_id=128_001),
})

# (version, size) -> training tokens; a pair exists only if AXLearn's TOTAL_TOKENS lists it.
TOTAL_TOKENS: Mapping[tuple[str, str], int] = MappingProxyType({
    ("1", "test"): 1 * _TERA, ("1", "7B"): 1 * _TERA, ("1", "70B"): int(1.4 * _TERA),
    ("2", "test"): 2 * _TERA, ("2", "7B"): 2 * _TERA, ("2", "70B"): 2 * _TERA,
    **{("3", size): 15 * _TERA for size in ("test", "1B", "3B", "7B", "70B", "405B")},
    **{("3-tiktoken", size): 15 * _TERA for size in ("test", "1B", "3B", "8B", "70B", "405B")},
})
SINGLE_HOST_SIZES: tuple[str, ...] = ("1B", "3B", "7B", "8B")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FujiSize:
    """One row of AXLearn's `get_trainer_kwargs` (docs/training.md's Fuji sizes table)."""

    num_layers: int
    model_dims: int
    num_heads: int
    dims_per_head: int
    hidden_dims: int
    tie_embeddings: bool
    learning_rate: float
    weight_decay: float
    # key/value heads by version; None: as many as query heads (plain multi-head attention)
    kv_heads: Mapping[int, int | None]


SIZES: Mapping[str, FujiSize] = MappingProxyType({
    # test: ffn = ceil(8 * 8/3 / 16) * 16 = 32, the shape in AXLearn's fuji-test-v1_init.txt.
    "test": FujiSize(num_layers=4, model_dims=8, num_heads=4, dims_per_head=2, hidden_dims=32,
                     tie_embeddings=True, learning_rate=6e-4, weight_decay=0.01,
                     kv_heads=MappingProxyType({"1": 2, "2": 2, "3": 2, "3-tiktoken": 2})),
    "1B": FujiSize(num_layers=16, model_dims=2048, num_heads=32, dims_per_head=64, hidden_dims=8192,
                   tie_embeddings=True, learning_rate=3e-4, weight_decay=0.1,
                   kv_heads=MappingProxyType({"3": 8, "3-tiktoken": 8})),
    "3B": FujiSize(num_layers=28, model_dims=3072, num_heads=24, dims_per_head=128,
                   hidden_dims=8192, tie_embeddings=True, learning_rate=3e-4, weight_decay=0.1,
                   kv_heads=MappingProxyType({"3": 8, "3-tiktoken": 8})),
    "7B": FujiSize(num_layers=32, model_dims=4096, num_heads=32, dims_per_head=128,
                   hidden_dims=11008, tie_embeddings=True, learning_rate=3e-4, weight_decay=0.1,
                   kv_heads=MappingProxyType({"1": None, "2": None, "3": 8})),
    # 8B (v3-tiktoken only): 7B's shape with a 3.5x ffn (14336) and a separate head.
    "8B": FujiSize(num_layers=32, model_dims=4096, num_heads=32, dims_per_head=128,
                   hidden_dims=14336, tie_embeddings=False, learning_rate=3e-4, weight_decay=0.1,
                   kv_heads=MappingProxyType({"3-tiktoken": 8})),
    "70B": FujiSize(num_layers=80, model_dims=8192, num_heads=64, dims_per_head=128,
                    hidden_dims=28672, tie_embeddings=False, learning_rate=1.5e-4,
                    weight_decay=0.1,
                    kv_heads=MappingProxyType({"1": None, "2": 8, "3": 8, "3-tiktoken": 8})),
    "405B": FujiSize(num_layers=126, model_dims=16384, num_heads=128, dims_per_head=128,
                     hidden_dims=53248, tie_embeddings=False, learning_rate=1.5e-4,
                     weight_decay=0.1, kv_heads=MappingProxyType({"3": 8, "3-tiktoken": 8})),
})


class BaseFuji(TiedEmbeddingSettings, RotarySettings, GPT3Optimizer, BaseLLaMA):
    """Settings every Fuji config shares; not registered (it has no size of its own).

    Hyperparameters added to LLaMA's: ROPE_THETA (RotarySettings, as Mixtral), TIE_EMBEDDINGS
    (TiedEmbeddingSettings, as LLaMA-3.2 and Qwen), TOTAL_TOKENS, TOKENS_PER_BATCH (from which
    MAX_STEPS and GLOBAL_BATCH_SIZE are derived) and DECOUPLED_WEIGHT_DECAY (AXLearn's weight
    decay; WEIGHT_DECAY is derived from it, see the module docstring).
    """

    axlearn_name: ClassVar[str] = ""
    fuji_size: ClassVar[str] = ""  # "7B", "test", ...: which of fuji_mesh.RULES apply
    fuji_version: ClassVar[str] = ""  # "1", "2", "3", "3-tiktoken"

    TIE_EMBEDDINGS = True
    TOTAL_TOKENS: int = 1 * _TERA
    TOKENS_PER_BATCH: int = 4 * 1024**2
    # AXLearn's lambda: each step multiplies the parameters by (1 - lambda * schedule multiplier).
    DECOUPLED_WEIGHT_DECAY: float = 0.1

    GLOBAL_BATCH_SIZE = Derived(lambda hp: hp.TOKENS_PER_BATCH // hp.MAX_SEQ_LEN,
                                doc="TOKENS_PER_BATCH // MAX_SEQ_LEN")
    MAX_STEPS = Derived(lambda hp: hp.TOTAL_TOKENS // hp.TOKENS_PER_BATCH,
                        doc="TOTAL_TOKENS // TOKENS_PER_BATCH")
    LR_COS_WARMUP = 2000
    LR_COS_DECAY_START = Derived(lambda hp: hp.LR_COS_WARMUP, doc="LR_COS_WARMUP")
    # At least the warm-up, so a smoke test with a few MAX_STEPS stays a valid schedule.
    LR_COS_DECAY_END = Derived(lambda hp: max(hp.MAX_STEPS, hp.LR_COS_WARMUP),
                               doc="max(MAX_STEPS, LR_COS_WARMUP)")
    WEIGHT_DECAY = Derived(lambda hp: hp.DECOUPLED_WEIGHT_DECAY / hp.LEARNING_RATE,
                           doc="DECOUPLED_WEIGHT_DECAY / LEARNING_RATE")
    INIT_STD = Derived(lambda hp: hp.MODEL_DIMS**-0.5, doc="MODEL_DIMS ** -0.5 (1/sqrt(fan_in))")
    FPROP_DTYPE = "bfloat16"
    USE_REPEATED_LAYER = True  # AXLearn's RepeatedTransformerLayer
    # AXLearn saves names matching .*([qkvo]_proj|context): q/k/v, the context and the output proj.
    CHECKPOINT_POLICY = "SAVE_DOT_FOR_MLPERF_200B"
    PACKED_INPUT = True
    TFDS_DATASET = "c4/en:3.0.1"
    # BaseLLaMA's mesh, ICI [1, 8, 1] and DCN [1, 1, 1], is AXLearn's default too: fsdp 8 within
    # a node, data across nodes.
    CHECKPOINT_EVERY_N_STEPS = 5000
    CHECKPOINT_MAX_TO_KEEP = 3
    SUMMARY_INTERVAL_STEPS = 100
    EVAL_INTERVAL_STEPS = 5000
    # AXLearn evaluates Fuji on its training corpus's validation split, not on BoolQ (LLaMA's
    # default here).
    EVAL_TASK = "validation"
    EVAL_LOOP_NUM_BATCHES = 10


FP8_AMAX_HISTORY_LENGTH = 128  # AXLearn's FP8ConfigModifier(fp8_amax_history_length=128)


def axlearn_name(size: str, version: str, *, flash: bool = False,
                 single_host: bool = False, fp8: bool = False) -> str:
    """AXLearn's config name, e.g. 'fuji-3B-v3-flash-fp8-single-host'."""
    return (f"fuji-{size}-v{version}" + ("-flash" if flash else "") + ("-fp8" if fp8 else "")
            + ("-single-host" if single_host else ""))


def class_name(size: str, version: str, *, flash: bool = False, single_host: bool = False,
               fp8: bool = False) -> str:
    """The paxlite class name, e.g. 'Fuji3BV3FlashFp8SingleHost', 'FujiTestV1',
    'Fuji8BV3Tiktoken'."""
    # "3-tiktoken" -> "3Tiktoken"
    spelled = "".join(part.capitalize() for part in version.split("-"))
    return (f"Fuji{'Test' if size == 'test' else size}V{spelled}" + ("Flash" if flash else "")
            + ("Fp8" if fp8 else "") + ("SingleHost" if single_host else ""))


def _fuji(size: str, version: str, *, flash: bool = False,
          single_host: bool = False, fp8: bool = False) -> type[BaseFuji]:
    """The experiment class of one AXLearn Fuji config (only pairs AXLearn has)."""
    if (version, size) not in TOTAL_TOKENS:
        raise ValueError(f"AXLearn has no fuji-{size}-v{version}; pairs: {sorted(TOTAL_TOKENS)}")
    if single_host and size not in SINGLE_HOST_SIZES:
        raise ValueError(f"-single-host exists for {SINGLE_HOST_SIZES} only, not {size}")
    if fp8 and size == "test":
        raise ValueError("AXLearn has no -fp8 variant of the test model")
    v, s = VERSIONS[version], SIZES[size]
    kv = s.kv_heads[version]
    hparams: dict[str, Any] = dict(
        NUM_LAYERS=s.num_layers, MODEL_DIMS=s.model_dims, NUM_HEADS=s.num_heads,
        DIMS_PER_HEAD=s.dims_per_head, HIDDEN_DIMS=s.hidden_dims, TIE_EMBEDDINGS=s.tie_embeddings,
        LEARNING_RATE=s.learning_rate, DECOUPLED_WEIGHT_DECAY=s.weight_decay,
        VOCAB_SIZE=v.vocab_size, MAX_SEQ_LEN=v.max_seq_len, ROPE_THETA=v.rope_theta,
        TOTAL_TOKENS=TOTAL_TOKENS[version, size], TOKENS_PER_BATCH=v.tokens_per_batch,
    )
    if kv is not None:
        hparams["NUM_KV_HEADS"] = kv
    if size == "test":  # AXLearn's test model: vocab 32, 64 x 64 batch, 3000 steps, data=-1 mesh
        hparams.update(VOCAB_SIZE=32, MAX_SEQ_LEN=64, TOKENS_PER_BATCH=64 * 64, MAX_STEPS=3000,
                       EVAL_INTERVAL_STEPS=1500, CHECKPOINT_EVERY_N_STEPS=500,
                       ICI_MESH_SHAPE=None)
    if flash:
        hparams["ATTENTION_KIND"] = "flash"
    if fp8:
        hparams.update(USE_FP8=True, FP8_AMAX_HISTORY_LENGTH=FP8_AMAX_HISTORY_LENGTH)
    if single_host:
        divisor = v.single_host_divisor
        hparams["GLOBAL_BATCH_SIZE"] = Derived(
            # divisor bound now, not looked up later: the late-binding closure is AXLearn's bug.
            lambda hp, divisor=divisor: hp.TOKENS_PER_BATCH // hp.MAX_SEQ_LEN // divisor,
            doc=f"TOKENS_PER_BATCH // MAX_SEQ_LEN // {divisor}",
        )
    name = class_name(size, version, flash=flash, single_host=single_host, fp8=fp8)
    axlearn = axlearn_name(size, version, flash=flash, single_host=single_host, fp8=fp8)
    batch = hparams["TOKENS_PER_BATCH"] // hparams["MAX_SEQ_LEN"] // (
        v.single_host_divisor if single_host else 1)
    heads = f"{s.num_heads} heads x {s.dims_per_head}, " + (
        f"{kv} kv heads" if kv is not None and kv != s.num_heads else "MHA")
    doc = (
        f"AXLearn {axlearn}: "
        f"{s.num_layers} layers, d_model {s.model_dims}, {heads}, ffn {s.hidden_dims}, "
        f"{'tied' if s.tie_embeddings else 'separate'} head, vocab {hparams['VOCAB_SIZE']:,}, "
        f"RoPE theta {v.rope_theta:g}; global batch {batch} x {hparams['MAX_SEQ_LEN']}; "
        f"peak LR {s.learning_rate:g}, weight decay {s.weight_decay:g}."
        + (" Attention through jax.nn.dot_product_attention (cuDNN flash on GPU)." if flash else "")
        + (f" Native FP8 matmuls (USE_FP8, amax history {FP8_AMAX_HISTORY_LENGTH}) as AXLearn "
           "intends for every GPU mesh rule." if fp8 else "")
        + (f" Llama 3's tiktoken vocabulary (pad {v.pad_id}, eos {v.eos_id})."
           if v.eos_id is not None else "")
    )
    if single_host:
        doc += (
            f"\n\n    Single host: the batch is divided by {v.single_host_divisor}, as AXLearn "
            "intends (128 for v3 and v3-tiktoken, 32 for v1/v2). AXLearn's code divides by 128 for "
            "every version (a late-binding loop closure over `version`), so its "
            "fuji-7B-v1-single-host trains 16 x 2048 and its v2 ones 8 x 4096; here they are 64 x "
            "2048 and 32 x 4096 (128K tokens, what its docstring timings refer to). MAX_STEPS is "
            "unchanged, as in AXLearn."
        )
    namespace = dict(hparams, __doc__=doc, __module__=__name__, __qualname__=name,
                     axlearn_name=axlearn, fuji_size=size, fuji_version=version)
    return type(name, (BaseFuji,), namespace)


def _variants() -> tuple[type[BaseFuji], ...]:
    """Every AXLearn Fuji config: each (size, version), plain and -flash; -fp8 of both for every
    size but test; -single-host of all of those for SINGLE_HOST_SIZES."""
    classes = []
    for version, size in TOTAL_TOKENS:
        for fp8 in (False, True) if size != "test" else (False,):
            for flash in (False, True):
                classes.append(_fuji(size, version, flash=flash, fp8=fp8))
        if size in SINGLE_HOST_SIZES:
            for fp8 in (False, True):
                for flash in (False, True):
                    classes.append(_fuji(size, version, flash=flash, fp8=fp8, single_host=True))
    return tuple(classes)


FUJI_EXPERIMENTS: tuple[type[BaseFuji], ...] = _variants()
globals().update({cls.__name__: cls for cls in FUJI_EXPERIMENTS})  # Fuji7BV2, Fuji7BV2Fp8, ...
# AXLearn name -> paxlite class name, for the registry's aliases.
AXLEARN_NAMES: Mapping[str, str] = MappingProxyType(
    {cls.axlearn_name: cls.__name__ for cls in FUJI_EXPERIMENTS}
)


def _trainer_config_fn(cls: type[BaseFuji]) -> Callable[..., BaseFuji]:
    """AXLearn's TrainerConfigFn for `cls`: called with nothing, the experiment as registered;
    with modifiers and NAME=value overrides, `configure`'s result (checked as on the command
    line)."""

    def config_fn(*modifiers: Any, **overrides: Any) -> BaseFuji:
        # Imported here: build.py imports the registry, which imports this module.
        from paxlite.experiments.build import configure

        return configure(cls, *modifiers, **overrides)

    functools.update_wrapper(config_fn, cls, assigned=("__doc__",), updated=())
    config_fn.__name__ = config_fn.__qualname__ = cls.axlearn_name
    return config_fn


def named_trainer_configs() -> dict[str, Callable[..., BaseFuji]]:
    """{AXLearn config name: config function}, as AXLearn's `c4_trainer.named_trainer_configs()`.

    `named_trainer_configs()["fuji-7B-v2"]()` is the resolved experiment; pass modifiers
    (paxlite.config.modifiers) and hyperparameters to change it:
    `named_trainer_configs()["fuji-test-v1"](GradientAccumulationModifier(2), MAX_STEPS=10)`.
    A new dict each call, so a caller may add its own entries."""
    return {cls.axlearn_name: _trainer_config_fn(cls) for cls in FUJI_EXPERIMENTS}
