"""Every user-facing error type derives from paxlite.errors.UserError (exit 2, one line) or
RunStoppedError (exit 1, one line), and keeps the built-in base its Python callers catch."""

import pytest

from paxlite import errors
from paxlite.checkpointing.checkpoint import (
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointReadError,
    NoRestorableCheckpointError,
)
from paxlite.checkpointing.pretrained import PretrainedCheckpointError
from paxlite.config.errors import ConfigError
from paxlite.data.errors import DatasetError
from paxlite.data.tokenizer import VocabError
from paxlite.interop.errors import ConversionError
from paxlite.main import UsageError
from paxlite.parallel.distributed import ConnectionFailedError, DistributedError
from paxlite.parallel.mesh import MeshError
from paxlite.train.loop import TrainingDivergedError


@pytest.mark.parametrize("cls, builtin", [
    (ConfigError, ValueError), (UsageError, ValueError), (MeshError, ValueError),
    (DistributedError, ValueError), (DatasetError, ValueError), (VocabError, ValueError),
    (ConversionError, ValueError), (errors.SettingError, ValueError),
    (PretrainedCheckpointError, FileNotFoundError), (errors.NotFoundError, FileNotFoundError),
    (CheckpointExistsError, FileExistsError), (errors.ExistsError, FileExistsError),
    (NoRestorableCheckpointError, RuntimeError), (CheckpointMismatchError, ValueError),
])
def test_user_facing_errors_are_user_errors(cls, builtin):
    assert issubclass(cls, errors.UserError) and issubclass(cls, builtin)
    assert not issubclass(cls, errors.RunStoppedError)


@pytest.mark.parametrize("cls, builtin", [
    (TrainingDivergedError, FloatingPointError), (ConnectionFailedError, RuntimeError),
    (CheckpointReadError, RuntimeError),
])
def test_stopped_runs_are_not_user_errors(cls, builtin):
    assert issubclass(cls, errors.RunStoppedError) and issubclass(cls, builtin)
    assert not issubclass(cls, errors.UserError)
