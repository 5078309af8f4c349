"""Every user-facing error type derives from paxlite.errors.UserError (exit 2, one line) or
RunStoppedError (exit 1, one line), and keeps the built-in base its Python callers catch; one
function (paxlite.errors.exit_status) prints that line and picks the status."""

import ast
from pathlib import Path

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


class _ErrorLinePrinters(ast.NodeVisitor):
    """The functions of a module that print a `PROGRAM: error:` line (print() or a .write())."""

    def __init__(self) -> None:
        self.scope = ["<module>"]
        self.found: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        callee = node.func
        name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", None)
        text = "".join(part.value for arg in node.args for part in ast.walk(arg)
                       if isinstance(part, ast.Constant) and isinstance(part.value, str))
        if name in ("print", "write") and ": error:" in text:
            self.found.append(self.scope[-1])
        self.generic_visit(node)


def test_only_exit_status_prints_an_error_line():
    """`paxlite: error: ...` (and prepare's, train_tokenizer's) is printed in one place, so every
    entry point words its failures and picks their exit status alike."""
    package = Path(errors.__file__).parent
    printers = set()
    for path in sorted(package.rglob("*.py")):
        visitor = _ErrorLinePrinters()
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        printers |= {f"{path.relative_to(package.parent)}:{function}" for function in visitor.found}
    assert printers == {"paxlite/errors.py:exit_status"}


def test_a_user_error_is_one_line_and_exit_2(capsys):
    assert errors.report_errors(lambda: _raise(errors.NotFoundError("no such job: /j"))) == 2
    assert capsys.readouterr().err == "paxlite: error: no such job: /j\n"
    assert errors.exit_status(ValueError("--target='tpu'"), user_errors=(ValueError,),
                              program="prepare") == 2
    assert capsys.readouterr().err == "prepare: error: --target='tpu'\n"


def test_a_stopped_run_is_one_line_and_exit_1(capsys):
    stopped = errors.RunStoppedError("the loss diverged at step 7")
    assert errors.report_errors(lambda: _raise(stopped)) == 1
    assert capsys.readouterr().err == "paxlite: error: the loss diverged at step 7\n"


def test_a_bug_keeps_its_traceback(capsys):
    with pytest.raises(ValueError, match="an internal bug"):
        errors.report_errors(lambda: _raise(ValueError("an internal bug")))
    with pytest.raises(KeyError):
        errors.exit_status(KeyError("not a user's mistake"))
    assert capsys.readouterr().err == ""


def test_a_command_line_that_does_not_parse_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        errors.exit_usage(ValueError("Unknown command line flag 'exp'.\nPass --helpshort"))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "paxlite: error: Unknown command line flag 'exp'. Pass --helpshort\n")


def _raise(error: BaseException) -> int:
    raise error
