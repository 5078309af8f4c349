"""`python -m paxlite list [--format=markdown]`: every registered experiment with its parameter
count; the markdown is docs/experiments.md, generated so that the catalogue is the registry."""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence

import fiddle as fdl

CATALOGUE_COMMAND = "python -m paxlite list --format=markdown > docs/experiments.md"
_FAMILIES = types.MappingProxyType({  # module -> section title, in the order the sections appear
    "gpt": "GPT (Pax's GPT-3 family)", "llama": "LLaMA (Pax's LLaMA-2 experiments)",
    "glam": "GLaM (Pax's mixture-of-experts GPTs)", "mixtral": "Mixtral",
    "fuji": "Fuji (AXLearn's models)",
    "llama3": "LLaMA 3.1 and 3.2 (fine-tuning Meta's models)",
    "mistral": "Mistral (fine-tuning Mistral AI's models)",
    "qwen": "Qwen 2.5 and 3 (fine-tuning Alibaba's models)",
    "gemma": "Gemma 2 (fine-tuning Google's models)",
    "deepseek": "DeepSeek-V3 and V2-Lite (fine-tuning DeepSeek-AI's models)",
    "finetune": "Any converted model (FineTune)",
    "tiny": "CPU-sized experiments (tests, demos, smoke runs)",
    "gpt_oss": "gpt-oss (fine-tuning OpenAI's models)",
})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("text", "markdown"), default="text",
                        help=f"markdown: the catalogue docs/experiments.md ({CATALOGUE_COMMAND})")


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    """One row per experiment: all parameters, and for MoE models the active ones per token."""
    del assignments  # refused by the command line: the catalogue is of the defaults
    entries = _catalogue()
    if args.format == "markdown":
        print(_markdown_catalogue(entries), end="")
        return 0
    rows = []
    for e in entries:
        also = f"  (also {', '.join(e['also'])})" if e["also"] else ""
        active = e["num_active_params"]
        params = _CHECKPOINT_S if e["num_params"] is None else f"{e['num_params']:,}"
        rows.append((e["name"], params, "" if active is None else f"{active:,}",
                     e["class"] + also))
    header = ("experiment", "parameters", "active", "class")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    print(f"{header[0]:<{widths[0]}}  {header[1]:>{widths[1]}}  {header[2]:>{widths[2]}}  class")
    for name, params, active, path in rows:
        print(f"{name:<{widths[0]}}  {params:>{widths[1]}}  {active:>{widths[2]}}  {path}")
    return 0


# What `list` says of an experiment whose model is the checkpoint's (FineTune).
_CHECKPOINT_S = "the checkpoint's"


def parameter_counts(model) -> tuple[int, int]:
    """(all parameters, those one token passes through) of a built TransformerConfig: learned
    weights, as transformers counts them (DeepSeek-V3's never-trained choice biases are not).

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
    total -= moe_params.choice_bias_params(model)
    return total, moe_params.num_active_params(model, total)


def _catalogue() -> list[dict]:
    """One entry per registered experiment, in registry order: what `list` prints in either format.

    Parameter counts are read off each model's config (parameter_counts); experiments that share a
    model (the Fuji -flash/-fp8/-single-host variants) are counted once.
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
        if getattr(cls, "model_from_checkpoint", False):  # FineTune: no model until a path
            entries.append({"name": name, "class": f"{cls.__module__}.{cls.__qualname__}",
                            "experiment": cls, "also": aliases.get(name, []),
                            "num_params": None, "num_active_params": None})
            continue
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


def _mesh_and_batch(experiment) -> tuple[str, str]:
    """The default mesh as given (ICI x DCN and the devices it needs) and the global batch it
    implies."""
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


# The page's opening paragraphs, line for line (a backslash at the end joins two source lines).
_INTRODUCTION = """\
Every experiment `--fdl_config` accepts, with its defaults. \
Each one is also reachable by its class path
(the `class` column) and, as in Pax, by a legacy path ending in its name
(`paxml.contrib.gpu.scripts_gpu.configs.Pile126M`). *Parameters* are exact (counted from the model
itself); *active* is what one token passes through in a mixture-of-experts model (router and top-k
experts). *Mesh* is the default `ICI_MESH_SHAPE` x `DCN_MESH_SHAPE` (`[data, fsdp, tensor]`, a 4th
entry for experts) and the devices it needs; *global batch* is `GLOBAL_BATCH_SIZE`, or
`PERCORE_BATCH_SIZE` x those devices. Override any of them with `--fdl.NAME=VALUE`
([configuration.md](configuration.md)); \
`python -m paxlite show --fdl_config=NAME` prints the resolved
values after overrides.

A default is Pax's or AXLearn's setting, not a promise that its train step fits a GPU: whether it
does, per device on H100 and H200 as XLA's GPU compiler builds it, and what makes it fit, is in
[performance.md](performance.md) ("Peak memory of the large experiments on H100 and H200"), and
`python -m paxlite plan --fdl_config=NAME --target=h100` answers it for any overrides. \
In short: the
LLaMA defaults are Pax's zero-shot evaluation batch \
(training at it needs far more than a GPU holds;
Pax's fine-tuning batch of 2 per GPU with cuDNN attention fits), GLaM64B64E fits H200s and, with
half the batch and 8-way expert parallelism, H100s, Mixtral8x7B needs more than 8 GPUs, \
and the Fuji
rows are sized for AXLearn's mesh rules (`--mesh_selector`), not for the 8 devices shown.
"""


def _markdown_catalogue(entries: list[dict]) -> str:
    """docs/experiments.md: generated, so that the catalogue is the registry
    (tests/test_docs_index.py)."""
    lines = [
        "# Experiment catalogue",
        "",
        f"<!-- Generated from the registry by `{CATALOGUE_COMMAND}`; do not edit by hand. -->",
        "",
        *_INTRODUCTION.splitlines(),
    ]
    by_family: dict[str, list[dict]] = {}
    for e in entries:
        by_family.setdefault(e["class"].split(".")[-2], []).append(e)
    for family in [*_FAMILIES, *sorted(set(by_family) - set(_FAMILIES))]:
        if family not in by_family:
            continue
        lines += ["", f"## {_FAMILIES.get(family, family)}", "",
                  ("| experiment | also | parameters | active | mesh (devices) | sequence"
                   " | global batch | class |"),
                  "|---|---|--:|--:|---|--:|--:|---|"]
        for e in by_family[family]:
            mesh, batch = _mesh_and_batch(e["experiment"])
            also = ", ".join(f"`{a}`" for a in e["also"])
            active = "" if e["num_active_params"] is None else f"{e['num_active_params']:,}"
            if e["num_params"] is None:
                params = sequence = _CHECKPOINT_S
            else:
                params, sequence = f"{e['num_params']:,}", f"{e['experiment'].MAX_SEQ_LEN:,}"
            lines.append(f"| `{e['name']}` | {also} | {params} | {active} | {mesh} | "
                         f"{sequence} | {batch} | `{e['class']}` |")
        note = _family_note(family)
        if note:
            lines += ["", *note.strip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def _family_note(family: str) -> str | None:
    """The family module's CATALOGUE_NOTE (markdown under its table: e.g. what `plan` said of its
    defaults), or None."""
    import importlib

    module = importlib.import_module(f"paxlite.experiments.{family}")
    return getattr(module, "CATALOGUE_NOTE", None)
