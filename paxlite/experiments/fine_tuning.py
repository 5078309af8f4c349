"""What a full fine-tune of a pretrained open model on one node of 8 GPUs sets by default
(llama3.py, mistral.py, qwen.py, finetune.py): values only, every one overridable.

- The optimizer: GPT-3's Adam (b1 0.9, b2 0.95, eps 1e-8, gradients clipped to norm 1) with
  weight decay 0.1, and a peak rate of 2e-5, an order of magnitude below these models'
  pretraining rates (3e-4 to 1.5e-4), reached after 100 warm-up steps (a tenth of a shorter run)
  and followed by a cosine to a tenth of it at MAX_STEPS=1000. A family lowers or raises the peak
  per size.
- The loop: short runs report every 10 steps, evaluate every 100 (10 batches of the dataset's
  validation split) and save every 500.
- Memory: the weights, gradients and Adam state take 16 bytes per parameter (128 GB for an 8B
  model, 16 GB per GPU under FSDP over 8), and a step's activations at 2 x 8,192 tokens per GPU
  must fit beside them: fused attention (ATTENTION_KIND='flash': cuDNN on GPUs, XLA elsewhere)
  never holds the [T, T] logits, and the scanned layer stack recomputes each layer in the
  backward pass, keeping only the layer inputs (CHECKPOINT_POLICY='SAVE_NOTHING'). A scanned
  stack stores its weights stacked: convert with `--fdl_config=NAME` so the checkpoint has the
  experiment's layout.
"""

from __future__ import annotations

from typing import ClassVar

from paxlite.config.experiment import Derived
from paxlite.experiments.optimizer_settings import GPT3Optimizer


class FineTuningRecipe(GPT3Optimizer):
    """Mixin: the module docstring's defaults; listed first among a family's bases."""

    # The Hugging Face repository ids that name this experiment too (`--fdl_config=ID`): the base
    # and the post-trained models of a size share its shapes, so both ids name one experiment.
    hf_ids: ClassVar[tuple[str, ...]] = ()

    LEARNING_RATE = 2e-5
    WEIGHT_DECAY = 0.1
    # Text starts as the model was pretrained and is prompted: with its tokenizer's BOS, where the
    # tokenizer defines one (Qwen's does not: 0, data_settings.py)
    DOCUMENT_START = "bos"
    LR_COS_WARMUP = Derived(lambda hp: min(100, hp.MAX_STEPS // 10),
                            doc="min(100, MAX_STEPS // 10)")
    LR_COS_DECAY_END = Derived(lambda hp: hp.MAX_STEPS, doc="MAX_STEPS")
    MAX_STEPS = 1000
    EVAL_INTERVAL_STEPS = 100
    SUMMARY_INTERVAL_STEPS = 10
    CHECKPOINT_EVERY_N_STEPS = 500
    ATTENTION_KIND = "flash"
    USE_REPEATED_LAYER = True
    CHECKPOINT_POLICY = "SAVE_NOTHING"
    PERCORE_BATCH_SIZE = 2
    EVAL_TASK = "validation"
    EVAL_LOOP_NUM_BATCHES = 10
