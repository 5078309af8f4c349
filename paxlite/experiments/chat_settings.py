"""CHAT_*: supervised fine-tuning on conversations (TRAIN_TASK=chat) and its evaluation
(EVAL_TASK=chat), declared, mapped to the chat feeds' configs and checked here.

Apart from data_settings.py because the settings are their own family with their own mistakes,
found when the run tree is built, before any device is touched: no file, no tokenizer, a
template file or name that is not there, settings that nothing reads. What can only be known by
reading the rows (a bad row, a chat row without a template) is said when the feed opens, still
before anything compiles (data/chat_pipeline.py). A mixin of ``LanguageModelExperiment``
(base.py); docs/chat.md is the user's page.
"""

from __future__ import annotations

import os
from typing import Literal

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.data.chat_pipeline import ChatBadRows, ChatEvalConfig, ChatTrainConfig
from paxlite.data.chat_rows import Overlong
from paxlite.errors import UserError

CHAT = "chat"
# The tasks that read chat-style rows, with the setting naming each one's evaluation rows and what
# an evaluation scores: the CHAT_* settings about reading rows apply to all of them.
_EVAL_ROWS = {CHAT: ("CHAT_EVAL_DATA", "example"), "dpo": ("DPO_EVAL_DATA", "pair")}
_ROW_TASKS = tuple(_EVAL_ROWS)
# Read whenever training or evaluation reads chat-style rows (TRAIN_TASK or EVAL_TASK chat or
# dpo); CHAT_OVERLONG only by training (evaluation scores every example, truncating the long ones).
_READ_BY_EITHER = ("CHAT_TEMPLATE", "CHAT_TEMPLATE_NAME", "CHAT_SPLIT", "CHAT_BAD_ROWS")


class ChatSettings:
    """The CHAT_* part of an experiment's run tree."""

    # TRAIN_TASK="chat": rows {"messages": [{"role", "content"}, ...]} or {"prompt",
    # "completion"}: a JSONL file (plain, .gz, .zst), a Parquet file, a datasets save_to_disk
    # folder, or a folder of them (docs/chat.md)
    CHAT_DATA: str | None = None
    CHAT_EVAL_DATA: str | None = None  # the same kinds of rows, EVAL_TASK="chat"
    # The four below and CHAT_OVERLONG apply to DPO rows too (TRAIN_TASK/EVAL_TASK="dpo").
    # A Jinja chat template file; None: the tokenizer's own (chat_template.jinja or
    # tokenizer_config.json beside VOCAB_PATH)
    CHAT_TEMPLATE: str | None = None
    CHAT_TEMPLATE_NAME: str | None = None  # one of a tokenizer's named templates; None: "default"
    CHAT_SPLIT: str | None = None  # the split of a DatasetDict save_to_disk folder
    # An example (a DPO pair) longer than MAX_SEQ_LEN in training: dropped, or cut to its first
    # MAX_SEQ_LEN tokens (a pair: each side to the same length, docs/chat.md)
    CHAT_OVERLONG: Literal["drop", "truncate"] = "drop"
    # A row that cannot become an example: one error line, or skipped and counted
    CHAT_BAD_ROWS: Literal["error", "skip"] = "error"

    def unread_chat_problems(self) -> list[str]:
        """CHAT_* settings given where neither training nor evaluation reads chat-style rows."""
        given = {name for name in self.overridden if getattr(self, name) is not None}
        trains, evaluates = self.TRAIN_TASK == CHAT, self.EVAL_TASK == CHAT
        trains_rows, evaluates_rows = self.TRAIN_TASK in _ROW_TASKS, self.EVAL_TASK in _ROW_TASKS
        problems = []
        if "CHAT_DATA" in given and not trains:
            problems.append(f"CHAT_DATA is read only with TRAIN_TASK='chat', and TRAIN_TASK="
                            f"{self.TRAIN_TASK!r}: add --fdl.TRAIN_TASK=chat, or drop CHAT_DATA")
        if "CHAT_EVAL_DATA" in given and not evaluates:
            problems.append(f"CHAT_EVAL_DATA is read only with EVAL_TASK='chat', and EVAL_TASK="
                            f"{self.EVAL_TASK!r}: add --fdl.EVAL_TASK=chat, or drop "
                            "CHAT_EVAL_DATA")
        if "CHAT_OVERLONG" in given and not trains_rows:
            problems.append("CHAT_OVERLONG is read only with TRAIN_TASK='chat' or 'dpo' "
                            "(EVAL_TASK=chat or dpo scores every example, truncating the long "
                            "ones): drop it")
        if not (trains_rows or evaluates_rows):
            problems += [f"{name} is read only with TRAIN_TASK or EVAL_TASK 'chat' or 'dpo': "
                         f"drop it" for name in _READ_BY_EITHER if name in given]
        if evaluates_rows and "EVAL_LOOP_NUM_BATCHES" in given and (
                self.EVAL_LOOP_NUM_BATCHES != -1):
            setting, unit = _EVAL_ROWS[self.EVAL_TASK]
            problems.append(f"EVAL_TASK={self.EVAL_TASK} scores the whole of {setting}, every "
                            f"{unit} once; EVAL_LOOP_NUM_BATCHES={self.EVAL_LOOP_NUM_BATCHES} "
                            "would score part of it: drop it (or give -1)")
        return problems

    def row_source(self, *, setting: str, task: str, value: str = CHAT,
                   rows: str = "messages or prompt/completion rows") -> dict[str, str | None]:
        """The path, tokenizer and template choice every config of chat-style rows has (`task`
        = `value`, its rows in `setting`), checked."""
        from paxlite.data.chat_template import find_chat_template
        from paxlite.data.row_files import row_inputs

        path = getattr(self, setting)
        if path is None:
            raise ConfigError(f"{task}={value} needs its rows: --fdl.{setting}=PATH (a JSONL, "
                              f"Parquet or save_to_disk folder of {rows})")
        vocab_path = self.vocab_path()
        if vocab_path is None:
            raise ConfigError(f"{task}={value} needs the model's tokenizer: --fdl.VOCAB_PATH (a "
                              "tokenizer.json or its directory), or the VOCAB_PATH environment "
                              "variable")
        if not os.path.exists(os.path.expanduser(vocab_path)):
            raise ConfigError(f"VOCAB_PATH {vocab_path!r} does not exist")
        try:
            row_inputs(os.path.expanduser(path))
        except UserError as e:
            raise ConfigError(f"{setting}: {e}") from None
        if self.CHAT_TEMPLATE is not None or self.CHAT_TEMPLATE_NAME is not None:
            try:  # the tokenizer's own is looked for when the rows are read: they may need none
                find_chat_template(tokenizer_path=os.path.expanduser(vocab_path),
                                   template_file=self.CHAT_TEMPLATE,
                                   template_name=self.CHAT_TEMPLATE_NAME)
            except UserError as e:
                chosen = "CHAT_TEMPLATE" if self.CHAT_TEMPLATE else "CHAT_TEMPLATE_NAME"
                raise ConfigError(f"{chosen}: {e}") from None
        return {"path": os.path.abspath(os.path.expanduser(path)), "split": self.CHAT_SPLIT,
                "template_file": self.CHAT_TEMPLATE, "template_name": self.CHAT_TEMPLATE_NAME}

    def row_train_clashes(self, *, value: str, setting: str) -> None:
        """TRAIN_TASK=`value` trains on `setting` alone: no other training data may be given."""
        clashes = [f"{name}={getattr(self, name)!r}" for name in ("DATA_DIR", "DATA_MIXTURE")
                   if getattr(self, name) is not None]
        if self.SYNTHETIC_DATA and "SYNTHETIC_DATA" in self.overridden:  # not a class's default
            clashes.append("SYNTHETIC_DATA=True")
        if clashes:
            raise ConfigError(f"TRAIN_TASK={value} trains on {setting}, but {', '.join(clashes)} "
                              "is set too: drop one of them")

    def chat_train_config(self) -> fdl.Config[ChatTrainConfig]:
        self.row_train_clashes(value=CHAT, setting="CHAT_DATA")
        source = self.row_source(setting="CHAT_DATA", task="TRAIN_TASK")
        return fdl.Config(ChatTrainConfig, **source, overlong=Overlong(self.CHAT_OVERLONG),
                          bad_rows=ChatBadRows(self.CHAT_BAD_ROWS),
                          **self.row_fields(ChatTrainConfig))

    def chat_eval_config(self) -> fdl.Config[ChatEvalConfig]:
        source = self.row_source(setting="CHAT_EVAL_DATA", task="EVAL_TASK")
        return fdl.Config(ChatEvalConfig, **source, bad_rows=ChatBadRows(self.CHAT_BAD_ROWS),
                          **self.row_fields(ChatEvalConfig))
