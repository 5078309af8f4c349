"""`python -m paxlite list [--format=markdown]` (the markdown is docs/experiments.md), `show --fdl_config=NAME [--fdl.X=V ...] [--format=json]`,
`plot JOB_DIR`, `plan --fdl_config=NAME [--fdl.X=V ...] --devices=N [--target=cpu|h100|h200]` (will it fit? see
paxlite/planner/plan.py), `convert --from=hf|meta|paxlite|te --to=paxlite|hf|te --input=P --output=P`
(paxlite/cli/convert.py), `export_merged --input=JOB_DIR --output=DIR` (a LoRA run with its
adapters folded in; see paxlite/train/export.py) and `generate --job_log_dir=DIR|--checkpoint=PATH
--prompt=...|--prompt_ids=1,2,3` (samples from a model; paxlite/cli/generate.py) and `lm_eval
--job_log_dir=DIR|--checkpoint=PATH --tasks=T1,T2` (lm-evaluation-harness scores; paxlite/cli/lm_eval.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import fiddle as fdl

from paxlite.errors import UserError


def parameter_counts(model) -> tuple[int, int]:
    """(all parameters, those one token passes through) of a built TransformerConfig.

    Read off the config in closed form (moe_params.closed_form_num_params), which the golden test
    of every registered experiment checks against the abstractly traced model; tracing costs about
    a second per model, which `list` would pay for each of its dozens. A LoRA model's adapters have
    no closed form: those models are traced (transformer.num_params)."""
    from paxlite.models import moe_params

    if model.lora_rank is None:
        total = moe_params.closed_form_num_params(model)
    else:
        from paxlite.models.transformer import num_params

        total = num_params(model)
    return total, moe_params.num_active_params(model, total)


def describe(experiment, *, num_local_devices: int | None = None) -> dict:
    """What a user wants to know before launching: size, cost per token, batch and mesh, every hyperparameter."""
    import math

    import jax

    from paxlite.parallel.mesh import BATCH_AXES, MESH_AXES, global_batch_size

    model = fdl.build(experiment.model_config())
    mesh = fdl.build(experiment.mesh_config())
    local = jax.local_device_count() if num_local_devices is None else num_local_devices
    sizes = mesh.axis_sizes(local)
    num_devices = math.prod(sizes[axis] for axis in MESH_AXES)
    batch = global_batch_size(
        percore_batch_size=experiment.PERCORE_BATCH_SIZE,
        num_devices=num_devices,
        batch_split=math.prod(sizes[axis] for axis in BATCH_AXES),
        fixed_global_batch_size=getattr(experiment, "GLOBAL_BATCH_SIZE", None),
    )
    total, active = parameter_counts(model)
    return {
        "experiment": experiment.name,
        "class": f"{type(experiment).__module__}.{type(experiment).__qualname__}",
        "num_params": total,
        "num_active_params": active,
        "flops_per_token": experiment.flops_per_token(),
        "global_batch_size": batch,
        "tokens_per_step": batch * experiment.MAX_SEQ_LEN,
        "num_devices": num_devices,
        "mesh": {axis: sizes[axis] for axis in MESH_AXES},
        **_pipeline_and_seq(model, batch=batch, experiment=experiment, seq=sizes["seq"]),
        "hparams": experiment.hparams(),
    }


def _pipeline_and_seq(model, *, batch: int, experiment, seq: int) -> dict:
    """The pipeline schedule (stages, microbatches, bubble) and the seq strategy, where the run has them."""
    out: dict = {}
    if model.pipeline is not None:
        schedule = model.pipeline.schedule(batch // max(experiment.GRAD_ACCUM_STEPS, 1))
        del schedule["iterations"]
        out["pipeline"] = {**schedule, "bubble_fraction": round(schedule["bubble_fraction"], 4)}
    if seq > 1:
        out["sequence_parallel"] = {
            "seq": seq,
            "strategy": model.context_parallel_strategy.value,
            "load_balance": bool(experiment.CONTEXT_PARALLEL_LOAD_BALANCE),
            "tokens_per_shard": experiment.MAX_SEQ_LEN // seq,
        }
    return out


def _catalogue() -> list[dict]:
    """One entry per registered experiment, in registry order: what `list` prints in either format.

    Parameter counts are read off each model's config (parameter_counts); experiments that share a model
    (the Fuji -flash/-fp8/-single-host variants) are counted once.
    """
    from paxlite.experiments import EXPERIMENTS

    aliases: dict[str, list[str]] = {}
    for alias, name in getattr(EXPERIMENTS, "aliases", {}).items():
        aliases.setdefault(name, []).append(alias)
    names_of_class: dict[type, list[str]] = {}
    for name, cls in EXPERIMENTS.items():
        names_of_class.setdefault(cls, []).append(name)
    counts: dict = {}
    entries = []
    for name, cls in EXPERIMENTS.items():
        experiment = cls.resolve({})
        model = fdl.build(experiment.model_config())
        try:
            if model not in counts:
                counts[model] = parameter_counts(model)
            params, active = counts[model]
        except TypeError:  # a model config that cannot be hashed is simply counted again
            params, active = parameter_counts(model)
        entries.append({
            "name": name, "class": f"{cls.__module__}.{cls.__qualname__}", "experiment": experiment,
            "also": [n for n in names_of_class[cls] if n != name] + aliases.get(name, []),
            "num_params": params, "num_active_params": active if model.moe is not None else None,
        })
    return entries


def _list(output_format: str = "text") -> int:
    """One row per experiment: all parameters, and for MoE models the active ones per token."""
    entries = _catalogue()
    if output_format == "markdown":
        print(_markdown_catalogue(entries), end="")
        return 0
    rows = []
    for e in entries:
        also = f"  (also {', '.join(e['also'])})" if e["also"] else ""
        active = e["num_active_params"]
        rows.append((e["name"], f"{e['num_params']:,}", "" if active is None else f"{active:,}", e["class"] + also))
    header = ("experiment", "parameters", "active", "class")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    print(f"{header[0]:<{widths[0]}}  {header[1]:>{widths[1]}}  {header[2]:>{widths[2]}}  class")
    for name, params, active, path in rows:
        print(f"{name:<{widths[0]}}  {params:>{widths[1]}}  {active:>{widths[2]}}  {path}")
    return 0


CATALOGUE_COMMAND = "python -m paxlite list --format=markdown > docs/experiments.md"
_FAMILIES = {  # module -> section title, in the order the sections appear
    "gpt": "GPT (Pax's GPT-3 family)", "llama": "LLaMA (Pax's LLaMA-2 experiments)",
    "glam": "GLaM (Pax's mixture-of-experts GPTs)", "mixtral": "Mixtral",
    "fuji": "Fuji (AXLearn's models)", "tiny": "CPU-sized experiments (tests, demos, smoke runs)",
}


def _mesh_and_batch(experiment) -> tuple[str, str]:
    """The default mesh as given (ICI x DCN and the devices it needs) and the global batch it implies."""
    import math

    from paxlite.parallel.mesh import full_shape

    ici, dcn = experiment.ICI_MESH_SHAPE, experiment.DCN_MESH_SHAPE
    fixed = getattr(experiment, "GLOBAL_BATCH_SIZE", None)
    percore = experiment.PERCORE_BATCH_SIZE
    if ici is None:  # data parallel over whatever devices the job has
        mesh = f"`None` (data: all devices) x `{list(dcn)}`"
        batch = f"{fixed:,}" if fixed is not None else f"{percore:g} x devices"
        return mesh, batch
    devices = math.prod(full_shape(ici)) * math.prod(full_shape(dcn))
    mesh = f"`{list(ici)}` x `{list(dcn)}` ({devices:,})"
    batch = fixed if fixed is not None else round(percore * devices)
    return mesh, f"{batch:,}"


def _markdown_catalogue(entries: list[dict]) -> str:
    """docs/experiments.md: generated, so that the catalogue is the registry (tests/test_docs_index.py)."""
    lines = [
        "# Experiment catalogue",
        "",
        f"<!-- Generated from the registry by `{CATALOGUE_COMMAND}`; do not edit by hand. -->",
        "",
        "Every experiment `--fdl_config` accepts, with its defaults. Each one is also reachable by its class path",
        "(the `class` column) and, as in Pax, by a legacy path ending in its name",
        "(`paxml.contrib.gpu.scripts_gpu.configs.Pile126M`). *Parameters* are exact (counted from the model",
        "itself); *active* is what one token passes through in a mixture-of-experts model (router and top-k",
        "experts). *Mesh* is the default `ICI_MESH_SHAPE` x `DCN_MESH_SHAPE` (`[data, fsdp, tensor]`, a 4th",
        "entry for experts) and the devices it needs; *global batch* is `GLOBAL_BATCH_SIZE`, or",
        "`PERCORE_BATCH_SIZE` x those devices. Override any of them with `--fdl.NAME=VALUE`",
        "([configuration.md](configuration.md)); `python -m paxlite show --fdl_config=NAME` prints the resolved",
        "values after overrides.",
        "",
        "A default is Pax's or AXLearn's setting, not a promise that its train step fits a GPU: whether it",
        "does, per device on H100 and H200 as XLA's GPU compiler builds it, and what makes it fit, is in",
        "[performance.md](performance.md) (\"Peak memory of the large experiments on H100 and H200\"), and",
        "`python -m paxlite plan --fdl_config=NAME --target=h100` answers it for any overrides. In short: the",
        "LLaMA defaults are Pax's zero-shot evaluation batch (training at it needs far more than a GPU holds;",
        "Pax's fine-tuning batch of 2 per GPU with cuDNN attention fits), GLaM64B64E fits H200s and, with",
        "half the batch and 8-way expert parallelism, H100s, Mixtral8x7B needs more than 8 GPUs, and the Fuji",
        "rows are sized for AXLearn's mesh rules (`--mesh_selector`), not for the 8 devices shown.",
    ]
    by_family: dict[str, list[dict]] = {}
    for e in entries:
        by_family.setdefault(e["class"].split(".")[-2], []).append(e)
    for family in [*_FAMILIES, *sorted(set(by_family) - set(_FAMILIES))]:
        if family not in by_family:
            continue
        lines += ["", f"## {_FAMILIES.get(family, family)}", "",
                  "| experiment | also | parameters | active | mesh (devices) | sequence | global batch | class |",
                  "|---|---|--:|--:|---|--:|--:|---|"]
        for e in by_family[family]:
            mesh, batch = _mesh_and_batch(e["experiment"])
            also = ", ".join(f"`{a}`" for a in e["also"])
            active = "" if e["num_active_params"] is None else f"{e['num_active_params']:,}"
            lines.append(f"| `{e['name']}` | {also} | {e['num_params']:,} | {active} | {mesh} | "
                         f"{e['experiment'].MAX_SEQ_LEN:,} | {batch} | `{e['class']}` |")
    return "\n".join(lines) + "\n"


def _show(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.experiments.build import load_experiment

    info = describe(load_experiment(args.fdl_config or "", assignments))
    if args.format == "json":
        print(json.dumps(info, indent=2, sort_keys=False))
    else:
        for key, value in info.items():
            if key != "hparams":
                print(f"{key}: {value}")
        print("hparams:")
        for key, value in info["hparams"].items():
            print(f"  {key} = {value!r}")
    return 0


def _plan(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    """Runs before anything imports JAX, so that the fake CPU devices can still be set."""
    from paxlite.planner import plan

    try:
        request = plan.PlanRequest(
            name=args.fdl_config, assignments=tuple(assignments), num_devices=args.devices,
            target=args.target, device_memory_gib=args.device_memory_gib,
            peak_tflops=args.peak_tflops, longest_seq=args.longest_seq, seq_step=args.seq_step,
        )
    except (UserError, ValueError) as e:  # a bad --target names every valid one
        print(f"paxlite: error: {e}", file=sys.stderr)
        return 2
    return plan.run_plan_command(request, output_format=plan.OutputFormat(args.format))


def _export_merged(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.experiments.build import load_experiment, load_recorded_experiment
    from paxlite.paths import check_output_dir, require_local_path
    from paxlite.train import export

    try:
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
        from paxlite.cli.convert import return_freed_buffers

        return_freed_buffers()
        print(export.export_merged(args.input, output, model_config=model))
    except UserError as e:
        print(f"paxlite: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m paxlite")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every registered experiment with its parameter count")
    listing.add_argument("--format", choices=("text", "markdown"), default="text",
                         help=f"markdown: the catalogue docs/experiments.md ({CATALOGUE_COMMAND})")
    show = commands.add_parser("show", help="one experiment, resolved (accepts --fdl.NAME=VALUE)")
    show.add_argument("--fdl_config", required=True, help="registered name, dotted path or Pax name")
    show.add_argument("--format", choices=("text", "json"), default="text")
    plan = commands.add_parser(
        "plan", help="will it fit? compile the train step for N devices (CPU or H100/H200); memory "
                     "per device")
    plan.add_argument("--fdl_config", required=True,
                      help="registered name, dotted path or Pax name")
    plan.add_argument("--devices", type=int, required=True, help="devices to plan for (ICI x DCN)")
    plan.add_argument("--target", default="cpu", metavar="cpu|h100|h200|a100",
                      help="the compiler that measures: cpu (fake CPU devices; default) or a GPU "
                           "model, h100 / h200 / a100 (XLA's GPU compiler, no GPU needed; JAX's "
                           "CUDA plugin)")
    plan.add_argument("--device_memory_gib", type=float, default=None,
                      help="memory of one device (default: the GPU target's own; 80 for cpu)")
    plan.add_argument("--peak_tflops", type=float, default=None,
                      help="dense peak TFLOP/s of one device (step time at 100%% MFU; default: "
                           "the GPU target's BF16 peak; 989 for cpu)")
    plan.add_argument("--format", choices=("text", "json"), default="text")
    plan.add_argument("--longest_seq", choices=("auto", "on", "off"), default="auto",
                      help="search the longest MAX_SEQ_LEN that fits (auto: for runs with a seq axis)")
    plan.add_argument("--seq_step", type=int, default=128,
                      help="granularity in tokens of that search (raised to a multiple of 2 x seq)")
    plot = commands.add_parser("plot", help="PNG of a job's train and validation loss curves")
    plot.add_argument("job_log_dir")
    plot.add_argument("--output", default=None, help="PNG path (default: JOB_LOG_DIR/loss.png)")
    from paxlite.cli.convert import add_arguments as add_convert_arguments

    add_convert_arguments(commands.add_parser(
        "convert", help="checkpoints: HF/Meta/paxlite -> paxlite/HF; paxlite <-> TE (accepts --fdl.NAME=VALUE)"))
    export = commands.add_parser(
        "export_merged", help="a LoRA run's parameters with the adapters folded in (base model)")
    export.add_argument("--input", required=True,
                        help="the LoRA job dir, its checkpoints/ or one checkpoint_<STEP> dir")
    export.add_argument("--output", required=True, help="new directory for the merged checkpoint")
    export.add_argument("--fdl_config", default=None,
                        help="the run's experiment (default: read from the job's config.json)")
    from paxlite.cli.generate import add_arguments as add_generate_arguments

    add_generate_arguments(commands.add_parser(
        "generate", help="text or token ids from a trained or converted model (KV cache; greedy or sampled)"))
    from paxlite.cli.lm_eval import add_arguments as add_lm_eval_arguments

    add_lm_eval_arguments(commands.add_parser(
        "lm_eval", help="lm-evaluation-harness scores of a trained or converted model (the eval extra)"))
    args, extra = parser.parse_known_args(argv)
    assignments = []
    for item in extra:
        if not item.startswith("--fdl."):
            parser.error(f"unrecognized argument {item!r}; overrides look like --fdl.NAME=VALUE")
        assignments.append(item[len("--fdl."):])
    if args.command == "plot":
        if extra:
            parser.error(f"unrecognized arguments {extra}")
        from paxlite.train.plot import plot_losses

        try:
            print(plot_losses(args.job_log_dir, args.output))
        except UserError as e:
            print(f"paxlite: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "plan":
        return _plan(args, assignments)
    if args.command == "convert":
        from paxlite.cli.convert import run_cli

        return run_cli(args, assignments)
    if args.command == "export_merged":
        return _export_merged(args, assignments)
    if args.command == "generate":
        from paxlite.cli.generate import run_cli as run_generate

        return run_generate(args, assignments)
    if args.command == "lm_eval":
        from paxlite.cli.lm_eval import run_cli as run_lm_eval

        return run_lm_eval(args, assignments)
    if args.command == "list":
        if assignments:
            parser.error("list takes no --fdl.NAME=VALUE overrides")
        return _list(args.format)
    try:
        return _show(args, assignments)
    except UserError as e:
        print(f"paxlite: error: {e}", file=sys.stderr)
        return 2


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


if __name__ == "__main__":
    sys.exit(run())
