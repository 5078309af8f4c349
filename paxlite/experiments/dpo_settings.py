"""DPO_*: direct preference optimisation on pairs of completions (TRAIN_TASK=dpo) and its
evaluation (EVAL_TASK=dpo), declared, mapped to the DPO feeds' configs and to the run's DpoConfig
(the loss's beta and where the reference comes from: train/dpo.py), and checked here.

The rows are chat-style rows, read as chat rows are (chat_settings.py): the same kinds of paths,
and CHAT_TEMPLATE, CHAT_TEMPLATE_NAME, CHAT_SPLIT, CHAT_BAD_ROWS and CHAT_OVERLONG apply to them.
A mixin of ``LanguageModelExperiment`` (base.py); docs/chat.md is the user's page.
"""

from __future__ import annotations

import fiddle as fdl

from paxlite.data.chat_rows import Overlong
from paxlite.data.dpo_pipeline import DpoEvalConfig, DpoTrainConfig
from paxlite.data.row_feeds import ChatBadRows
from paxlite.errors import SettingError
from paxlite.train.dpo import DpoConfig

DPO = "dpo"
_ROWS = "prompt/chosen/rejected rows"


class DpoSettings:
    """The DPO_* part of an experiment's run tree."""

    # TRAIN_TASK="dpo": rows {"prompt", "chosen", "rejected"}, all strings or all lists of
    # {role, content} messages; the same kinds of paths as CHAT_DATA (docs/chat.md)
    DPO_DATA: str | None = None
    DPO_EVAL_DATA: str | None = None  # the same kinds of rows, EVAL_TASK="dpo"
    # The loss's beta: how far the policy may move from the reference (TRL's default, 0.1)
    DPO_BETA: float = 0.1
    # The frozen reference: a checkpoint (a job directory or checkpoint_<STEP>); None: the
    # parameters the job started from (CHECKPOINT_RESTORE_PATH's), or with LoRA the base model
    DPO_REFERENCE_PATH: str | None = None

    def unread_dpo_problems(self) -> list[str]:
        """DPO_* settings given where nothing reads them."""
        given = {name for name in self.overridden if getattr(self, name) is not None}
        problems = []
        for name, switch in (("DPO_DATA", "TRAIN_TASK"), ("DPO_EVAL_DATA", "EVAL_TASK")):
            if name in given and getattr(self, switch) != DPO:
                problems.append(f"{name} is read only with {switch}='dpo', and {switch}="
                                f"{getattr(self, switch)!r}: add --fdl.{switch}=dpo, or drop "
                                f"{name}")
        if self.TRAIN_TASK == DPO and "PACKED_INPUT" in self.overridden:
            problems.append(f"PACKED_INPUT={self.PACKED_INPUT!r} does not apply to "
                            "TRAIN_TASK='dpo', which trains on one pair a row: drop it")
        if DPO not in (self.TRAIN_TASK, self.EVAL_TASK):
            problems += [f"{name} is read only with TRAIN_TASK='dpo' or EVAL_TASK='dpo': drop it"
                         for name in ("DPO_BETA", "DPO_REFERENCE_PATH") if name in given]
        else:
            try:  # DpoConfig holds the rule
                DpoConfig(beta=self.DPO_BETA, reference_path=self.DPO_REFERENCE_PATH)
            except SettingError as e:
                problems.append(str(e))
        return problems

    def dpo_config(self) -> fdl.Config[DpoConfig] | None:
        """The run's DPO settings where training or evaluation reads pairs, else None."""
        if DPO not in (self.TRAIN_TASK, self.EVAL_TASK):
            return None
        return fdl.Config(DpoConfig, beta=self.DPO_BETA,
                          reference_path=self.DPO_REFERENCE_PATH)

    def dpo_train_config(self) -> fdl.Config[DpoTrainConfig]:
        self.row_train_clashes(value=DPO, setting="DPO_DATA")
        source = self.row_source(setting="DPO_DATA", task="TRAIN_TASK", value=DPO, rows=_ROWS)
        return fdl.Config(DpoTrainConfig, **source, overlong=Overlong(self.CHAT_OVERLONG),
                          bad_rows=ChatBadRows(self.CHAT_BAD_ROWS),
                          **self.row_fields(DpoTrainConfig))

    def dpo_eval_config(self) -> fdl.Config[DpoEvalConfig]:
        source = self.row_source(setting="DPO_EVAL_DATA", task="EVAL_TASK", value=DPO,
                                 rows=_ROWS)
        return fdl.Config(DpoEvalConfig, **source, bad_rows=ChatBadRows(self.CHAT_BAD_ROWS),
                          **self.row_fields(DpoEvalConfig))
