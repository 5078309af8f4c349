"""`python -m paxlite export_merged --input=JOB_DIR --output=DIR`: a LoRA run's parameters with
the adapters folded in, a checkpoint of the base model (paxlite/train/export.py), with the run's
tokenizer copied beside it as `convert` copies one (so `generate` and `--to=hf` find it)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import fiddle as fdl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True,
                        help="the LoRA job dir, its checkpoints/ or one checkpoint_<STEP> dir")
    parser.add_argument("--output", required=True,
                        help="new directory for the merged checkpoint")
    parser.add_argument("--fdl_config", default=None,
                        help="the run's experiment (default: read from the job's config.json)")


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.cli.convert import return_freed_buffers
    from paxlite.experiments.build import load_experiment, load_recorded_experiment
    from paxlite.paths import check_output_dir, require_local_path
    from paxlite.train import export

    output = check_output_dir(args.output, setting="--output",
                              inputs=[require_local_path(args.input, setting="--input")])
    record = export.find_job_config(args.input)
    if record is None and args.fdl_config:
        experiment = load_experiment(args.fdl_config, assignments)
    else:  # the job's own record of its experiment and overrides (a registered name only)
        name, overrides = export.job_config_record(args.input)
        experiment = load_recorded_experiment(name, overrides, assignments, source=str(record),
                                              fdl_config=args.fdl_config)
    model = fdl.build(experiment.with_lora(experiment.model_config()))
    return_freed_buffers()
    step_dir = export.export_merged(args.input, output, model_config=model)
    _copy_tokenizer(experiment.VOCAB_PATH, output)
    print(step_dir)
    return 0


def _copy_tokenizer(vocab_path: str | None, output: str) -> None:
    """The run's tokenizer (VOCAB_PATH, else the environment's) beside the merged model, as
    `convert` copies one; nothing for a run without a tokenizer (synthetic data)."""
    import os

    from paxlite.cli.conversion import copy_tokenizer_beside_model
    from paxlite.data.tokenizer import VOCAB_PATH_ENV, find_tokenizer_file, resolve_vocab_path

    if not vocab_path and not os.environ.get(VOCAB_PATH_ENV):
        return
    copy_tokenizer_beside_model(find_tokenizer_file(resolve_vocab_path(vocab_path)), output)
