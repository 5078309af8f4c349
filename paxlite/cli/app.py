"""`python -m paxlite COMMAND` (and the `paxlite` console script): one module of paxlite/cli/ per
command, each with `add_arguments(parser)` and `run(args, assignments)`; this module builds the
parser from them and reports what a command raises (paxlite.errors.report_errors).

- `list [--format=markdown]` (the markdown is docs/experiments.md) and
  `show --fdl_config=NAME [--fdl.X=V ...] [--format=json]`: catalogue.py, show.py.
- `plan --fdl_config=NAME [--fdl.X=V ...] --devices=N [--target=cpu|h100|h200]`: will it fit?
  (plan.py; the planning is paxlite/planner/).
- `plot JOB_DIR`: plot.py.
- `convert --from=hf|meta|paxlite|te --to=paxlite|hf|te --input=P --output=P`: convert.py.
- `export_merged --input=JOB_DIR --output=DIR`: a LoRA run with its adapters folded in
  (export_merged.py).
- `generate --job_log_dir=DIR|--checkpoint=PATH --prompt=...|--prompt_ids=1,2,3`: samples from a
  model (generate.py).
- `lm_eval --job_log_dir=DIR|--checkpoint=PATH --tasks=T1,T2`: lm-evaluation-harness scores
  (lm_eval.py).

Every command module is imported to build the parser, so none may import JAX at import time:
`plan` sets its fake CPU devices before JAX starts (tests/test_architecture.py checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from collections.abc import Sequence

from paxlite.cli import (
    catalogue,
    convert,
    export_merged,
    generate,
    lm_eval,
    plan,
    plot,
    show,
)
from paxlite.errors import report_errors

_OVERRIDE_PREFIX = "--fdl."


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its name, its module (`add_arguments`, `run`) and its line in `--help`."""

    name: str
    module: types.ModuleType
    help: str
    # For a command that has no experiment to override: the usage error that --fdl.X=V gets (a
    # format string; {extra} is the arguments given). None: the overrides go to `run`.
    refused_overrides: str | None = None


COMMANDS = (
    Command("list", catalogue, "every registered experiment with its parameter count",
            refused_overrides="list takes no --fdl.NAME=VALUE overrides"),
    Command("show", show, "one experiment, resolved (accepts --fdl.NAME=VALUE)"),
    Command("plan", plan, "will it fit? compile the train step for N devices (CPU or H100/H200); "
                          "memory per device"),
    Command("plot", plot, "PNG of a job's train and validation loss curves",
            refused_overrides="unrecognized arguments {extra}"),
    Command("convert", convert, "checkpoints: HF/Meta/paxlite -> paxlite/HF; paxlite <-> TE "
                                "(accepts --fdl.NAME=VALUE)"),
    Command("export_merged", export_merged,
            "a LoRA run's parameters with the adapters folded in (base model)"),
    Command("generate", generate, "text or token ids from a trained or converted model (KV "
                                  "cache; greedy or sampled)"),
    Command("lm_eval", lm_eval, "lm-evaluation-harness scores of a trained or converted model "
                                "(the eval extra)"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paxlite")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.module.add_arguments(subparsers.add_parser(command.name, help=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status: 0, 2 with one line for a user's mistake, 1 with one line for a
    run that stopped; argparse's own usage errors exit 2 (SystemExit)."""
    parser = _parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    assignments = []
    for item in extra:
        if not item.startswith(_OVERRIDE_PREFIX):
            parser.error(f"unrecognized argument {item!r}; overrides look like --fdl.NAME=VALUE")
        assignments.append(item[len(_OVERRIDE_PREFIX):])
    command = next(command for command in COMMANDS if command.name == args.command)
    if extra and command.refused_overrides is not None:
        parser.error(command.refused_overrides.format(extra=extra))
    return report_errors(lambda: command.module.run(args, assignments))


def run() -> int:
    """main(), with output piped into a reader that stops early (`| head`) ending quietly."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader has what it wanted; Python's own flush at exit would fail again and print a
        # traceback, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
