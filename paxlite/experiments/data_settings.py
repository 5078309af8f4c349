"""Where an experiment's tokens come from: the training data, the evaluation task and the tokenizer.

The rules are their own: synthetic tokens, a prepared directory, TFDS through Grain or SeqIO, BoolQ
fine-tuning, and the Lambada / BoolQ evaluation tasks, each with the one-line error a missing path
deserves. The hyperparameters are declared here, in two mixins of ``LanguageModelExperiment``
(base.py says why two); every data config gets the row fields from `row_fields`, once.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, ClassVar, Literal

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.data.errors import DatasetError
from paxlite.data.feed import BoolQEvalConfig, LambadaEvalConfig
from paxlite.data.mixture import MixtureDataConfig, MixtureSource, weight_problems
from paxlite.data.packing import DocumentStart
from paxlite.data.pipeline import TextDataConfig
from paxlite.data.synthetic import SyntheticDataConfig

_MIXTURE_FORM = ('a list of [source, weight] pairs, e.g. --fdl.DATA_MIXTURE=\'[["/data/pile", '
                 '0.7], ["/data/code", 0.3]]\' (each source a prepared directory or a TFDS '
                 'name[/config]:version)')


class DataSource(str, enum.Enum):
    """Where an experiment's training tokens come from (SYNTHETIC_DATA=true replaces any of
    them)."""

    SYNTHETIC = "synthetic"
    TEXT = "text"  # DATA_DIR (python -m paxlite.data.prepare) or TFDS_DATASET under TFDS_DATA_DIR


class DataSettings:
    """The data, evaluation-task and tokenizer parts of an experiment's run tree."""

    data_source: ClassVar[DataSource] = DataSource.SYNTHETIC

    SYNTHETIC_DATA: bool = False  # train on synthetic tokens of the same shapes
    PACKED_INPUT: bool = True
    DATA_DIR: str | None = None  # a directory made by `python -m paxlite.data.prepare`
    # Weighted sources instead of DATA_DIR: [[source, weight], ...], each source a prepared
    # directory or a TFDS name[/config]:version under TFDS_DATA_DIR; weights are normalised
    # (docs/data.md). With INPUT_PIPELINE=seqio: the name of a registered SeqIO mixture or task.
    DATA_MIXTURE: str | list[list[str | float]] | None = None
    # A resumed mixture whose weights differ from the checkpoint's is an error; true: re-weight
    # from the resume on.
    DATA_MIXTURE_REWEIGHT: bool = False
    VOCAB_PATH: str | None = None  # SentencePiece model; None: the VOCAB_PATH environment variable
    # What EVAL_INTERVAL_STEPS / --mode=eval score: the training data's validation split, or a
    # zero-shot task.
    # "chat": the loss of the learned tokens of CHAT_EVAL_DATA (chat_settings.py); "dpo": the
    # preference pairs of DPO_EVAL_DATA (dpo_settings.py).
    EVAL_TASK: Literal["validation", "lambada", "boolq", "chat", "dpo"] = "validation"
    LAMBADA_PATH: str | None = None  # lambada_test.jsonl ({"text": ...} lines), EVAL_TASK="lambada"
    BOOLQ_PATH: str | None = None  # SuperGLUE BoolQ val.jsonl (passage, question, label), "boolq"
    # What training reads: "text" (DATA_DIR / TFDS_DATASET, language modelling) or "boolq"
    # (supervised fine-tuning on BoolQ's train split, one example per row, loss on the answer
    # token; BOOLQ_TRAIN_PATH or super_glue/boolq:1.0.2), or "chat" (conversations or
    # prompt/completion rows from CHAT_DATA, loss on what the assistant says; chat_settings.py),
    # or "dpo" (preference pairs from DPO_DATA; dpo_settings.py).
    TRAIN_TASK: Literal["text", "boolq", "chat", "dpo"] = "text"
    # Each text document's first input, from which its first token is predicted: "zero" (id 0, as
    # SeqIO and Pax feed it) or "bos" (the tokenizer's BOS where it defines one, else 0: as a
    # Hugging Face model is trained, and as evaluation and `generate` prompt it). Read by the
    # text pipeline (DATA_DIR, TFDS_DATASET on grain, DATA_MIXTURE).
    DOCUMENT_START: Literal["zero", "bos"] = "zero"

    def uses_synthetic_data(self) -> bool:
        return self.SYNTHETIC_DATA or self.data_source is DataSource.SYNTHETIC

    def eval_data_problems(self) -> list[str]:
        whole_eval_set = self.EVAL_LOOP_NUM_BATCHES == -1
        if self.uses_synthetic_data() and self.EVAL_TASK == "validation" and whole_eval_set:
            return [("EVAL_LOOP_NUM_BATCHES=-1 means 'the whole eval set', and synthetic data has "
                    "no end; give a number of batches (e.g. --fdl.EVAL_LOOP_NUM_BATCHES=10)")]
        return []

    def unread_data_problems(self) -> list[str]:
        """A path given for a task the run does not do, or TFDS_DATASET beside DATA_DIR."""
        given = set(self.overridden)
        problems = []
        needs = (("LAMBADA_PATH", "EVAL_TASK", "lambada"), ("BOOLQ_PATH", "EVAL_TASK", "boolq"),
                 ("BOOLQ_TRAIN_PATH", "TRAIN_TASK", "boolq"))
        for name, switch, value in needs:
            if name in given and getattr(self, name) is not None and getattr(self, switch) != value:
                problems.append(
                    f"{name} is read only with {switch}={value!r}, and "
                    f"{switch}={getattr(self, switch)!r}: add --fdl.{switch}={value!r}, or drop "
                    f"{name}")
        text_pipeline = (self.TRAIN_TASK == "text" and not self.uses_synthetic_data()
                         and self.INPUT_PIPELINE == "grain")
        if "DOCUMENT_START" in given and not text_pipeline:
            problems.append(
                f"DOCUMENT_START={self.DOCUMENT_START!r} is read by the text pipeline only "
                f"(TRAIN_TASK='text' on INPUT_PIPELINE='grain', not synthetic), and this run "
                f"trains with TRAIN_TASK={self.TRAIN_TASK!r}, INPUT_PIPELINE="
                f"{self.INPUT_PIPELINE!r}, SYNTHETIC_DATA={self.uses_synthetic_data()}: drop it")
        return problems + self.unread_chat_problems() + self.unread_dpo_problems()

    def row_fields(self, config_class: type) -> dict[str, Any]:
        """How every data config cuts rows (tokenizer, vocabulary, sequence length, packing, seed),
        mapped once: the fields of these that `config_class` has."""
        fields = {"vocab_path": self.vocab_path(), "vocab_size": self.VOCAB_SIZE,
                  "seq_len": self.MAX_SEQ_LEN, "packed": self.PACKED_INPUT, "seed": self.SEED,
                  "document_start": DocumentStart(self.DOCUMENT_START)}
        names = {f.name for f in dataclasses.fields(config_class)}
        return {name: value for name, value in fields.items() if name in names}

    def vocab_path(self) -> str | None:
        return self.VOCAB_PATH or os.environ.get("VOCAB_PATH") or None

    def tfds_data_dir(self) -> str | None:
        return self.TFDS_DATA_DIR or os.environ.get("TFDS_DATA_DIR") or None

    def eval_task_config(
        self,
    ) -> fdl.Config[LambadaEvalConfig] | fdl.Config[BoolQEvalConfig] | None:
        if self.EVAL_TASK == "validation":
            return None
        if self.EVAL_TASK == "chat":
            return self.chat_eval_config()
        if self.EVAL_TASK == "dpo":
            return self.dpo_eval_config()
        if self.EVAL_TASK == "boolq":
            return self.boolq_config()
        source = self.task_source(path_name="LAMBADA_PATH", needs=(
            "EVAL_TASK=lambada needs Lambada (--fdl.LAMBADA_PATH=<lambada_test.jsonl>, or "
            "--tfds_data_dir holding my_lambada:1.0.0 from scripts_gpu/download_lambada.py) "
            "and a tokenizer (--fdl.VOCAB_PATH or the VOCAB_PATH environment variable); got "))
        return fdl.Config(LambadaEvalConfig, **source, **self.row_fields(LambadaEvalConfig))

    def boolq_config(self) -> fdl.Config[BoolQEvalConfig]:
        source = self.task_source(path_name="BOOLQ_PATH", needs=(
            "EVAL_TASK=boolq needs BoolQ (--fdl.BOOLQ_PATH=<SuperGLUE val.jsonl>, or "
            "--tfds_data_dir holding super_glue/boolq:1.0.2 from "
            "scripts_gpu/download_boolq.py) and a tokenizer (--fdl.VOCAB_PATH or the "
            "VOCAB_PATH environment variable); or evaluate on the training data with "
            "--fdl.EVAL_TASK=validation. Got "))
        return fdl.Config(BoolQEvalConfig, **source, **self.row_fields(BoolQEvalConfig))

    def task_source(self, *, path_name: str, needs: str) -> dict[str, str | None]:
        """A task's rows come from the file the hyperparameter `path_name` names, else from the
        TFDS directory; with neither, or without a tokenizer, the ConfigError is `needs` followed
        by the values it read."""
        path = getattr(self, path_name)
        source = {"path": path} if path else {"tfds_data_dir": self.tfds_data_dir()}
        if not any(source.values()) or self.vocab_path() is None:
            raise ConfigError(f"{needs}{path_name}={path}, TFDS_DATA_DIR={self.tfds_data_dir()}, "
                              f"VOCAB_PATH={self.vocab_path()}")
        return source

    def boolq_train_config(self):
        from paxlite.data.feed import BoolQTrainConfig

        if self.EVAL_TASK == "validation":
            raise ConfigError(
                "TRAIN_TASK=boolq has no validation-loss split: evaluate with "
                "--fdl.EVAL_TASK=boolq (boolq_acc)"
            )
        if self.DATA_DIR is not None:
            raise ConfigError(
                f"TRAIN_TASK=boolq trains on BoolQ, but DATA_DIR={self.DATA_DIR!r} is set too: "
                "drop one of them"
            )
        source = self.task_source(path_name="BOOLQ_TRAIN_PATH", needs=(
            "TRAIN_TASK=boolq needs BoolQ's train split (--fdl.BOOLQ_TRAIN_PATH=<SuperGLUE "
            "train.jsonl>, or --tfds_data_dir holding super_glue/boolq:1.0.2 from "
            "scripts_gpu/download_boolq.py) and a tokenizer (--fdl.VOCAB_PATH or VOCAB_PATH); "
            "got "))
        return fdl.Config(BoolQTrainConfig, **source, **self.row_fields(BoolQTrainConfig))

    def data_config(self) -> fdl.Config[SyntheticDataConfig] | fdl.Config[TextDataConfig] | None:
        if self.TRAIN_TASK == "chat":  # over a synthetic experiment's default, not an explicit one
            return self.chat_train_config()
        if self.TRAIN_TASK == "dpo":  # the same
            return self.dpo_train_config()
        if self.uses_synthetic_data():
            return fdl.Config(SyntheticDataConfig, **self.row_fields(SyntheticDataConfig))
        if self.TRAIN_TASK == "boolq":
            return self.boolq_train_config()
        if self.DATA_MIXTURE is not None:
            return self.mixture_config()
        tfds_dir = None if self.DATA_DIR else self.tfds_data_dir()
        if self.DATA_DIR is None and tfds_dir is None and self.EVAL_TASK != "validation":
            return None  # evaluation-only; training without data is refused when it starts
        if self.DATA_DIR is None and tfds_dir is None:
            raise ConfigError(
                f"{self.name} trains on text and neither DATA_DIR nor TFDS_DATA_DIR is set: pass "
                "--fdl.DATA_DIR=<a directory made by python -m paxlite.data.prepare>, or "
                f"--tfds_data_dir=<a TFDS directory holding {self.TFDS_DATASET}> "
                "(scripts_gpu/download_the_pile.py makes one from The Pile's *.jsonl.zst shards), "
                "or run on synthetic tokens of the same shapes with --fdl.SYNTHETIC_DATA=true"
            )
        if tfds_dir is not None and self.INPUT_PIPELINE == "seqio":
            return self.seqio_data_config(tfds_dir)
        if self.INPUT_PIPELINE == "seqio":
            raise ConfigError(
                "INPUT_PIPELINE=seqio reads TFDS datasets: give --tfds_data_dir (DATA_DIR is "
                "paxlite's own format, read by INPUT_PIPELINE=grain)"
            )
        return fdl.Config(
            TextDataConfig,
            data_dir=self.DATA_DIR or tfds_dir,
            tfds_name=None if self.DATA_DIR else self.TFDS_DATASET,
            **self.row_fields(TextDataConfig),
        )

    def seqio_data_config(self, tfds_dir: str):
        """Pax's SeqIO task for TFDS_DATASET (the_pile_lm or c4_lm_v301_gpt), read through
        TensorFlow."""
        from paxlite.data.seqio_pipeline import SeqIODataConfig
        from paxlite.data.seqio_tasks import task_for_dataset

        if self.vocab_path() is None:
            raise ConfigError("INPUT_PIPELINE=seqio needs a tokenizer: --fdl.VOCAB_PATH or the "
                              "VOCAB_PATH environment variable")
        return fdl.Config(
            SeqIODataConfig,
            task=task_for_dataset(self.TFDS_DATASET),
            tfds_data_dir=tfds_dir,
            **self.row_fields(SeqIODataConfig),
        )

    def mixture_config(self):
        """DATA_MIXTURE: the grain path's weighted sources (data/mixture.py), or a SeqIO mixture or
        task.

        Everything checkable from the file system is checked here, each in one line: the form of the
        list, the weights, every source's directory and manifest, and that they share one tokenizer.
        """
        if self.DATA_DIR is not None:
            raise ConfigError(f"DATA_MIXTURE and DATA_DIR={self.DATA_DIR!r} are both set: DATA_DIR "
                              "is the one-source form of DATA_MIXTURE; drop one of them")
        if isinstance(self.DATA_MIXTURE, str) and self.DATA_MIXTURE.lstrip().startswith(("[", "(")):
            # a list the parser could not read as [[source, weight], ...] arrives as its text
            raise ConfigError(f"DATA_MIXTURE={self.DATA_MIXTURE} is not a list of [source, weight] "
                              f"pairs: it must be {_MIXTURE_FORM}")
        if self.INPUT_PIPELINE == "seqio":
            return self.seqio_mixture_config()
        if isinstance(self.DATA_MIXTURE, str):
            raise ConfigError(f"DATA_MIXTURE={self.DATA_MIXTURE!r} names a SeqIO mixture, which "
                              "needs --fdl.INPUT_PIPELINE=seqio; on the default input pipeline it "
                              f"is {_MIXTURE_FORM}")
        pairs = _mixture_pairs(self.DATA_MIXTURE)
        sources = [self._mixture_source(source) for source, _ in pairs]
        _check_one_tokenizer(sources, vocab_path=self.vocab_path())
        names = _unique_names([name for name, _, _ in sources])
        return fdl.Config(
            MixtureDataConfig,
            reweight=self.DATA_MIXTURE_REWEIGHT,
            sources=[
                fdl.Config(
                    MixtureSource,
                    name=name,
                    weight=float(weight),
                    data=fdl.Config(
                        TextDataConfig,
                        data_dir=data_dir,
                        tfds_name=tfds_name,
                        **self.row_fields(TextDataConfig),
                    ),
                )
                for name, (_, weight), (_, data_dir, tfds_name) in zip(
                    names, pairs, sources, strict=True
                )
            ],
        )

    def _mixture_source(self, source: str) -> tuple[str, str, str | None]:
        """(base name, data directory, TFDS name or None) of one DATA_MIXTURE source: an existing
        path is a prepared directory (its manifest read now); else `name[/config]:version` under
        TFDS_DATA_DIR."""
        from paxlite.data import records, tfds_datasets

        path = os.path.abspath(os.path.expanduser(source))
        if os.path.exists(path) or ":" not in source:
            try:
                records.read_info(path)
            except DatasetError as e:
                raise ConfigError(f"DATA_MIXTURE source {source!r}: {e}") from None
            return os.path.basename(path.rstrip(os.sep)), path, None
        tfds_dir = self.tfds_data_dir()
        try:
            spec = tfds_datasets.TfdsName.parse(source)
            if tfds_dir is None:
                raise DatasetError("it is read from TFDS_DATA_DIR, which is not set "
                                   "(--tfds_data_dir=DIR)")
            tfds_datasets.check_prepared(spec, os.path.abspath(os.path.expanduser(tfds_dir)))
        except DatasetError as e:
            raise ConfigError(f"DATA_MIXTURE source {source!r} is neither an existing directory "
                              f"nor a prepared TFDS dataset: {e}") from None
        if self.vocab_path() is None:
            raise ConfigError(f"DATA_MIXTURE source {source!r} holds raw text: set "
                              "--fdl.VOCAB_PATH (or the VOCAB_PATH environment variable) to the "
                              "SentencePiece model that tokenises it")
        return (
            spec.name.replace("/", "_") + (f"_{spec.config}" if spec.config else ""),
            tfds_dir,
            str(spec),
        )

    def seqio_mixture_config(self):
        """A SeqIO mixture or task by its registered name, or [[registered name, weight], ...] mixed
        by SeqIO under a derived name; the names are checked when the data is opened, after Pax's
        tasks are registered (data/seqio_tasks.py)."""
        from paxlite.data.seqio_pipeline import SeqIODataConfig

        if self.vocab_path() is None:
            raise ConfigError("INPUT_PIPELINE=seqio needs a tokenizer: --fdl.VOCAB_PATH or the "
                              "VOCAB_PATH environment variable")
        tfds_dir = self.tfds_data_dir()
        if tfds_dir is None:
            raise ConfigError("INPUT_PIPELINE=seqio reads TFDS datasets: give --tfds_data_dir")
        if isinstance(self.DATA_MIXTURE, str):
            mixture = self.DATA_MIXTURE
        else:
            pairs = _mixture_pairs(self.DATA_MIXTURE, form="a list of [registered SeqIO task or "
                                   "mixture, weight] pairs, or the name of a registered SeqIO "
                                   "mixture")
            mixture = tuple((name, float(weight)) for name, weight in pairs)
        return fdl.Config(SeqIODataConfig, task=None, mixture=mixture, tfds_data_dir=tfds_dir,
                          **self.row_fields(SeqIODataConfig))


def _mixture_pairs(value, *, form: str = _MIXTURE_FORM) -> list[tuple[str, float]]:
    """DATA_MIXTURE's [source, weight] pairs, each weight a finite number > 0, no source twice."""
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(
            f"DATA_MIXTURE={value!r} must be {form}" + (" (it is empty)" if value == [] else "")
        )
    pairs = []
    for item in value:
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ConfigError(f"DATA_MIXTURE entry {item!r} is not a [source, weight] pair: "
                              f"DATA_MIXTURE must be {form}")
        source, weight = item
        for problem in weight_problems(source, weight):  # data/mixture.py's rule
            raise ConfigError(f"DATA_MIXTURE {problem}")
        pairs.append((source, weight))
    seen: dict[str, str] = {}
    for source, _ in pairs:
        key = (
            os.path.abspath(os.path.expanduser(source))
            if os.path.exists(os.path.expanduser(source))
            else source
        )
        if key in seen:
            raise ConfigError(f"DATA_MIXTURE lists the same source twice ({seen[key]!r} and "
                              f"{source!r}): give each source once, with the sum of its weights")
        seen[key] = source
    return pairs


def _unique_names(names: list[str]) -> list[str]:
    """Metric names of the sources: each base name, a repeat suffixed _2, _3, ... in list order."""
    out: list[str] = []
    for name in names:
        unique, n = name, 1
        while unique in out or unique == "eval":  # "eval/loss" is the pooled metric's own key
            n += 1
            unique = f"{name}_{n}"
        out.append(unique)
    return out


def _check_one_tokenizer(
    sources: list[tuple[str, str, str | None]], *, vocab_path: str | None
) -> None:
    """Pre-tokenised sources' manifests agree on the tokenizer's sha256, and with VOCAB_PATH when it
    is given; raw-text sources need VOCAB_PATH."""
    from paxlite.data import records

    want = None  # (who, sha256)
    if vocab_path is not None:
        from paxlite.data.tokenizer import tokenizer_sha256

        path = os.path.abspath(os.path.expanduser(vocab_path))
        if not os.path.exists(path):
            raise ConfigError(f"VOCAB_PATH {vocab_path!r} does not exist")
        want = (f"VOCAB_PATH {vocab_path!r}", tokenizer_sha256(path))
    for _, data_dir, tfds_name in sources:
        if tfds_name is not None:
            continue
        info = records.read_info(data_dir)
        if info.kind != records.Kind.TOKENS.value:
            if vocab_path is None:
                raise ConfigError(f"DATA_MIXTURE source {data_dir!r} holds raw text: set "
                                  "--fdl.VOCAB_PATH (or the VOCAB_PATH environment variable) to "
                                  "the SentencePiece model that tokenises it")
            continue
        sha = (info.tokenizer or {}).get("sha256")
        if want is None:
            want = (f"source {data_dir!r}", sha)
        elif sha != want[1]:
            raise ConfigError(f"DATA_MIXTURE sources must share one tokenizer: {want[0]} has "
                              f"sha256 {want[1]} but source {data_dir!r} was tokenised with sha256 "
                              f"{sha}")


class TfdsSettings:
    """BoolQ's training split and the TFDS datasets Grain or SeqIO read (DataSettings maps them)."""

    BOOLQ_TRAIN_PATH: str | None = None  # SuperGLUE BoolQ train.jsonl for TRAIN_TASK="boolq"
    # Pax's --tfds_data_dir (the flag sets this; else the TFDS_DATA_DIR environment variable). Used
    # when DATA_DIR is unset: training reads TFDS_DATASET there, EVAL_TASK="lambada" reads
    # my_lambada:1.0.0 and EVAL_TASK="boolq" reads super_glue/boolq:1.0.2 (validation split).
    TFDS_DATA_DIR: str | None = None
    TFDS_DATASET: str = "the_pile:1.0.0"  # or "c4/en:3.0.1"
    # grain: TFDS ArrayRecord files, random access, exact resume, no TensorFlow. seqio: Pax's own
    # tasks (the_pile_lm, c4_lm_v301_gpt) through TensorFlow; needs pip install 'paxlite[seqio]'.
    INPUT_PIPELINE: Literal["grain", "seqio"] = "grain"

    def tfds_dataset_problems(self) -> list[str]:
        from paxlite.data.tfds_datasets import LM_TEXT_FEATURES, TfdsName

        try:
            dataset = TfdsName.parse(self.TFDS_DATASET)
        except DatasetError as e:
            return [f"TFDS_DATASET: {e}"]
        if dataset.name not in LM_TEXT_FEATURES:
            return [(f"TFDS_DATASET={self.TFDS_DATASET!r}: paxlite trains language models on "
                    f"{sorted(LM_TEXT_FEATURES)} (e.g. 'the_pile:1.0.0', 'c4/en:3.0.1')")]
        return []

    def unread_tfds_problems(self) -> list[str]:
        if "TFDS_DATASET" in self.overridden and self.DATA_DIR is not None:
            return [(f"TFDS_DATASET={self.TFDS_DATASET!r} is read only without DATA_DIR, and "
                    f"DATA_DIR={self.DATA_DIR!r} is set: drop one of them")]
        return []
