"""Where an experiment's tokens come from: the training data, the evaluation task and the tokenizer.

Apart from base.py (which maps every other hyperparameter) because the rules are their own: synthetic
tokens, a prepared directory, TFDS through Grain or SeqIO, BoolQ fine-tuning, and the Lambada / BoolQ
evaluation tasks, each with the one-line error a missing path deserves. A mixin of
``LanguageModelExperiment``: it reads the hyperparameters that class declares.
"""

from __future__ import annotations

import os

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.data.feed import BoolQEvalConfig, LambadaEvalConfig
from paxlite.data.pipeline import TextDataConfig
from paxlite.data.synthetic import SyntheticDataConfig


class DataSettings:
    """The data, evaluation-task and tokenizer parts of an experiment's run tree."""

    def vocab_path(self) -> str | None:
        return self.VOCAB_PATH or os.environ.get("VOCAB_PATH") or None

    def tfds_data_dir(self) -> str | None:
        return self.TFDS_DATA_DIR or os.environ.get("TFDS_DATA_DIR") or None

    def eval_task_config(self) -> fdl.Config[LambadaEvalConfig] | fdl.Config[BoolQEvalConfig] | None:
        if self.EVAL_TASK == "validation":
            return None
        if self.EVAL_TASK == "boolq":
            return self.boolq_config()
        source = {"path": self.LAMBADA_PATH} if self.LAMBADA_PATH else {"tfds_data_dir": self.tfds_data_dir()}
        if not any(source.values()) or self.vocab_path() is None:
            raise ConfigError(
                f"EVAL_TASK=lambada needs Lambada (--fdl.LAMBADA_PATH=<lambada_test.jsonl>, or --tfds_data_dir "
                f"holding my_lambada:1.0.0 from scripts_gpu/download_lambada.py) and a tokenizer (--fdl.VOCAB_PATH "
                f"or the VOCAB_PATH environment variable); got LAMBADA_PATH={self.LAMBADA_PATH}, "
                f"TFDS_DATA_DIR={self.tfds_data_dir()}, VOCAB_PATH={self.vocab_path()}"
            )
        return fdl.Config(LambadaEvalConfig, **source, vocab_path=self.vocab_path(), seq_len=self.MAX_SEQ_LEN)

    def boolq_config(self) -> fdl.Config[BoolQEvalConfig]:
        source = {"path": self.BOOLQ_PATH} if self.BOOLQ_PATH else {"tfds_data_dir": self.tfds_data_dir()}
        if not any(source.values()) or self.vocab_path() is None:
            raise ConfigError(
                "EVAL_TASK=boolq needs BoolQ (--fdl.BOOLQ_PATH=<SuperGLUE val.jsonl>, or --tfds_data_dir holding "
                "super_glue/boolq:1.0.2 from scripts_gpu/download_boolq.py) and a tokenizer (--fdl.VOCAB_PATH or "
                "the VOCAB_PATH environment variable); or evaluate on the training data with "
                f"--fdl.EVAL_TASK=validation. Got BOOLQ_PATH={self.BOOLQ_PATH}, "
                f"TFDS_DATA_DIR={self.tfds_data_dir()}, VOCAB_PATH={self.vocab_path()}"
            )
        return fdl.Config(BoolQEvalConfig, **source, vocab_path=self.vocab_path(), seq_len=self.MAX_SEQ_LEN)

    def boolq_train_config(self):
        from paxlite.data.feed import BoolQTrainConfig

        if self.EVAL_TASK == "validation":
            raise ConfigError(
                "TRAIN_TASK=boolq has no validation-loss split: evaluate with --fdl.EVAL_TASK=boolq (boolq_acc)"
            )
        if self.DATA_DIR is not None:
            raise ConfigError(
                f"TRAIN_TASK=boolq trains on BoolQ, but DATA_DIR={self.DATA_DIR!r} is set too: drop one of them"
            )
        source = {"path": self.BOOLQ_TRAIN_PATH} if self.BOOLQ_TRAIN_PATH else {"tfds_data_dir": self.tfds_data_dir()}
        if not any(source.values()) or self.vocab_path() is None:
            raise ConfigError(
                "TRAIN_TASK=boolq needs BoolQ's train split (--fdl.BOOLQ_TRAIN_PATH=<SuperGLUE train.jsonl>, or "
                "--tfds_data_dir holding super_glue/boolq:1.0.2 from scripts_gpu/download_boolq.py) and a tokenizer "
                f"(--fdl.VOCAB_PATH or VOCAB_PATH); got BOOLQ_TRAIN_PATH={self.BOOLQ_TRAIN_PATH}, "
                f"TFDS_DATA_DIR={self.tfds_data_dir()}, VOCAB_PATH={self.vocab_path()}"
            )
        return fdl.Config(BoolQTrainConfig, **source, vocab_path=self.vocab_path(), seq_len=self.MAX_SEQ_LEN,
                          seed=self.SEED)

    def data_config(self) -> fdl.Config[SyntheticDataConfig] | fdl.Config[TextDataConfig] | None:
        if self.uses_synthetic_data():
            return fdl.Config(
                SyntheticDataConfig, vocab_size=self.VOCAB_SIZE, seq_len=self.MAX_SEQ_LEN, seed=self.SEED
            )
        if self.TRAIN_TASK == "boolq":
            return self.boolq_train_config()
        tfds_dir = None if self.DATA_DIR else self.tfds_data_dir()
        if self.DATA_DIR is None and tfds_dir is None and self.EVAL_TASK != "validation":
            return None  # evaluation-only; training without data is refused when it starts
        if self.DATA_DIR is None and tfds_dir is None:
            raise ConfigError(
                f"{self.name} trains on text and neither DATA_DIR nor TFDS_DATA_DIR is set: pass "
                "--fdl.DATA_DIR=<a directory made by python -m paxlite.data.prepare>, or --tfds_data_dir=<a TFDS "
                f"directory holding {self.TFDS_DATASET}> (scripts_gpu/download_the_pile.py makes one from The "
                "Pile's *.jsonl.zst shards), or run on synthetic tokens of the same shapes with "
                "--fdl.SYNTHETIC_DATA=true"
            )
        if tfds_dir is not None and self.INPUT_PIPELINE == "seqio":
            return self.seqio_data_config(tfds_dir)
        if self.INPUT_PIPELINE == "seqio":
            raise ConfigError(
                "INPUT_PIPELINE=seqio reads TFDS datasets: give --tfds_data_dir (DATA_DIR is paxlite's own format, "
                "read by INPUT_PIPELINE=grain)"
            )
        return fdl.Config(
            TextDataConfig,
            data_dir=self.DATA_DIR or tfds_dir,
            tfds_name=None if self.DATA_DIR else self.TFDS_DATASET,
            vocab_path=self.vocab_path(),
            vocab_size=self.VOCAB_SIZE,
            seq_len=self.MAX_SEQ_LEN,
            packed=self.PACKED_INPUT,
            seed=self.SEED,
        )

    def seqio_data_config(self, tfds_dir: str):
        """Pax's SeqIO task for TFDS_DATASET (the_pile_lm or c4_lm_v301_gpt), read through TensorFlow."""
        from paxlite.data.seqio_pipeline import SeqIODataConfig, task_for_dataset

        if self.vocab_path() is None:
            raise ConfigError("INPUT_PIPELINE=seqio needs a tokenizer: --fdl.VOCAB_PATH or the VOCAB_PATH environment variable")
        return fdl.Config(
            SeqIODataConfig,
            task=task_for_dataset(self.TFDS_DATASET),
            tfds_data_dir=tfds_dir,
            vocab_path=self.vocab_path(),
            vocab_size=self.VOCAB_SIZE,
            seq_len=self.MAX_SEQ_LEN,
            packed=self.PACKED_INPUT,
            seed=self.SEED,
        )
