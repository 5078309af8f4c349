"""LLaMA-2 experiments with the dimensions and settings of Pax's GPU configs (`BaseLLaMA`,
`LLaMA7B/13B/70B`).

Architecture (Pax `BaseLLaMA`, Meta `llama/model.py`): pre-RMSNorm (eps 1e-5, float32 reductions, no
bias), interleaved-pair rotary position embeddings (no absolute positions), no biases anywhere,
gated SiLU MLP (SwiGLU), an untied output head without bias, query scaling 1/sqrt(head_dim), and
grouped-query attention for 70B (Pax `USE_MQA` with `NUM_KV_HEADS=8`; here NUM_KV_HEADS alone says
it). The optimizer keeps Pax's c4 Adam defaults (the base Experiment's values), which fine-tuning
runs override on the command line as Pax's scripts do.

The weights are meant to come from a converted Meta or Hugging Face checkpoint (HF needs the q/k row
permutation of paxlite/models/rotary.py at conversion); the training text is given by the user
(DATA_DIR / --tfds_data_dir), and `--fdl.SYNTHETIC_DATA=true` runs any of them on synthetic tokens
of the same shapes.
"""

from __future__ import annotations

import fiddle as fdl

from paxlite.config.experiment import Derived
from paxlite.experiments.base import DataSource, LanguageModelExperiment
from paxlite.experiments.model_settings import KeyValueHeadSettings
from paxlite.models.transformer import LLAMA_ARCHITECTURE, TransformerConfig


class BaseLLaMA(KeyValueHeadSettings, LanguageModelExperiment):
    """Pax BaseLLaMA's settings shared by every size; not registered (it has no size of its own).

    MAX_STEPS is 0 as in Pax, whose LLaMA configs say "only eval supported currently": training
    needs an explicit
    --fdl.MAX_STEPS (Pax's run_llama_boolq.sh passes 600 for LoRA, 1000 for SFT). Pax's
    packed_input=False is PACKED_INPUT=False.

    Evaluation is zero-shot BoolQ (Pax eval_task='boolq', the whole validation split), which needs
    BoolQ data and a tokenizer. `--fdl.SYNTHETIC_DATA=true` asks for a run without data files or
    tokenizer (benchmarks, smoke tests), so there EVAL_TASK derives to "validation" (synthetic
    batches, EVAL_LOOP_NUM_BATCHES=10); an explicit `--fdl.EVAL_TASK=boolq` still scores BoolQ after
    synthetic training. `paxlite show` prints the resolved values.
    """

    family_adds_bos = True  # LLaMA, Mistral/Mixtral and Fuji start every sequence with BOS

    data_source = DataSource.TEXT

    DIMS_PER_HEAD = 128
    VOCAB_SIZE = 32000
    MAX_SEQ_LEN = 4096
    FPROP_DTYPE = "bfloat16"
    LAYERNORM_EPSILON = 1e-5
    USE_REPEATED_LAYER = False
    PACKED_INPUT = False
    ICI_MESH_SHAPE = [1, 8, 1]  # FSDP over the 8 GPUs of one node
    DCN_MESH_SHAPE = [1, 1, 1]
    MAX_STEPS = 0
    EVAL_TASK = Derived(lambda hp: "validation" if hp.SYNTHETIC_DATA else "boolq",
                        doc="'boolq', or 'validation' with SYNTHETIC_DATA")
    EVAL_LOOP_NUM_BATCHES = Derived(lambda hp: 10 if hp.EVAL_TASK == "validation" else -1,
                                    doc="-1 (the whole set) for a zero-shot task, else 10")

    def model_config(self) -> fdl.Config[TransformerConfig]:
        return fdl.Config(
            TransformerConfig,
            **self.transformer_fields(),
            **LLAMA_ARCHITECTURE,
            num_kv_heads=self.NUM_KV_HEADS,
            tie_embeddings=False,
        )


class LLaMA7B(BaseLLaMA):
    """LLaMA-2 7B: 32 layers, 32 heads x 128, d_model 4096, ffn 11008; 6,738,415,616 parameters."""

    NUM_LAYERS = 32
    NUM_HEADS = 32
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 11008
    PERCORE_BATCH_SIZE = 16


class LLaMA13B(LLaMA7B):
    """LLaMA-2 13B: 40 layers, 40 heads x 128, d_model 5120, ffn 13824; 13,015,864,320
    parameters."""

    NUM_LAYERS = 40
    NUM_HEADS = 40
    MODEL_DIMS = 5120
    HIDDEN_DIMS = 13824
    PERCORE_BATCH_SIZE = 8


class LLaMA70B(LLaMA7B):
    """LLaMA-2 70B: 80 layers, 64 query heads and 8 key/value heads x 128, d_model 8192, ffn 28672;
    68,976,648,192 parameters. Pax runs it on 16 GPUs (DCN [1,2,1])."""

    NUM_LAYERS = 80
    NUM_HEADS = 64
    NUM_KV_HEADS = 8
    MODEL_DIMS = 8192
    HIDDEN_DIMS = 28672
    PERCORE_BATCH_SIZE = 4
    DCN_MESH_SHAPE = [1, 2, 1]
