"""`python -m paxlite lm_eval`: lm-evaluation-harness scores of a trained job or any paxlite
checkpoint.

    python -m paxlite lm_eval --job_log_dir=DIR | --checkpoint=PATH
        | --fdl_config=NAME --fdl.CHECKPOINT_RESTORE_PATH=PATH
        [--fdl_config=NAME --fdl.X=V]
        --tasks=T1,T2 [--num_fewshot=N --limit=N --batch_size=N --include_path=DIR]
        [--output_path=FILE.json --log_samples --seed=R,N,T,F --gen_kwargs=K=V,...]
        [--add_bos=auto|true|false]
        [--apply_chat_template[=NAME] --system_instruction=TEXT --fewshot_as_multiturn[=BOOL]]
        [--multiprocess_gpu --server_addr=HOST:PORT --num_hosts=N --host_idx=I]

The model, its parameters, its tokenizer and BOS are found exactly as `generate` finds them
(paxlite/cli/model_source.py). lm_eval's flags mean what they mean to lm_eval; lm_eval runs on
process 0 (eval/harness_lm.py) and every process computes (eval/harness.py). Process 0 prints
lm_eval's results table and writes --output_path. Every user mistake (a missing model, an unknown
task, an output file that exists) is one line and exit 2, found before any parameter is read.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from paxlite.cli import model_source
from paxlite.cli.model_source import BosChoice
from paxlite.errors import ExistsError, NotFoundError, SettingError

DEFAULT_BATCH_SIZE = 8
DEFAULT_SEEDS = "0,1234,1234,1234"  # lm_eval's: python random, numpy, torch, few-shot sampling


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model_source.add_model_arguments(parser)
    tasks = parser.add_argument_group("lm_eval (its own flags, with its meanings)")
    tasks.add_argument("--tasks", required=True,
                       help="comma-separated task names (lm_eval's, or YAMLs in --include_path)")
    tasks.add_argument("--num_fewshot", type=int, default=None,
                       help="examples in each prompt (default: each task's own)")
    tasks.add_argument("--limit", type=float, default=None,
                       help="at most this many documents per task (< 1: this fraction); for tests")
    tasks.add_argument("--batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                       help="rows per forward pass, raised to a multiple of the mesh's batch "
                            "split (scores do not depend on it)")
    tasks.add_argument("--include_path", default=None, help="a directory of local task YAMLs")
    tasks.add_argument("--output_path", default=None,
                       help="write lm_eval's results dict here as JSON (a new file: an existing "
                            "one is never overwritten)")
    tasks.add_argument("--log_samples", action="store_true",
                       help="put every document's prompt, responses and scores in the JSON "
                            "(under 'samples')")
    tasks.add_argument("--bootstrap_iters", type=int, default=100000,
                       help="bootstrap resamples for standard errors (lm_eval's default); 0: none")
    tasks.add_argument("--seed", default=DEFAULT_SEEDS,
                       help="lm_eval's seeds for python's random, numpy, torch and few-shot "
                            "sampling, as 'R,N,T,F' (3 values: F keeps its default), or one for "
                            "all; 'None' leaves one unset. T changes nothing here: paxlite's model "
                            "decodes greedily and lm_eval draws nothing from torch for it")
    tasks.add_argument("--gen_kwargs", default=None,
                       help="generation settings over every generate_until task's own, as "
                            "lm_eval takes them: 'max_gen_toks=64,until=.' (sampling is refused)")
    chat = parser.add_argument_group("instruct formatting (lm_eval's flags)")
    chat.add_argument("--apply_chat_template", nargs="?", const=True, default=False,
                      metavar="NAME", help="render prompts with the tokenizer's chat template "
                      "(optionally one of its named templates), as lm_eval's hf model does")
    chat.add_argument("--system_instruction", default=None, metavar="TEXT",
                      help="a system message before each prompt")
    chat.add_argument("--fewshot_as_multiturn", nargs="?", const=True, default=None,
                      type=lambda text: text.lower() in ("true", "1", "yes"), metavar="BOOL",
                      help="few-shot examples as turns of the chat (default: with "
                           "--apply_chat_template)")
    parser.add_argument("--add_bos", choices=[c.value for c in BosChoice], default=None,
                        help="start text with the tokenizer's BOS id; auto (the default): as the "
                             "model family was trained (as `generate`)")
    model_source.add_launch_arguments(parser)


def _task_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise SettingError(f"--tasks={text!r} names no task; e.g. --tasks=lambada_openai,hellaswag")
    return names


def _seeds(text: str) -> dict[str, int | None]:
    """lm_eval's --seed: 1, 3 or 4 comma-separated integers or 'None' (its own reading)."""
    def one(item: str) -> int | None:
        item = item.strip()
        if item.lower() == "none":
            return None
        try:
            return int(item)
        except ValueError:
            raise SettingError(f"--seed={text!r}: {item!r} is not an integer or None") from None

    values = [one(item) for item in text.split(",")]
    defaults = [one(item) for item in DEFAULT_SEEDS.split(",")]
    if len(values) == 1:
        values = values * 4
    elif len(values) in (3, 4):
        values = values + defaults[len(values):]
    else:
        raise SettingError(f"--seed={text!r} has {len(values)} values: give 1, 3 or 4 "
                           "(python random, numpy, torch, few-shot sampling)")
    return {"random_seed": values[0], "numpy_random_seed": values[1],
            "fewshot_random_seed": values[3]}


def _check_arguments(args: argparse.Namespace) -> list[str]:
    """The task names; checks what can be checked without lm_eval or the model."""
    model_source.check_one_source(args)
    tasks = _task_names(args.tasks)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise SettingError(f"--num_fewshot={args.num_fewshot} must be 0 or more")
    if args.limit is not None and not args.limit > 0:
        raise SettingError(f"--limit={args.limit:g} must be positive (a count, or a fraction < 1)")
    if args.batch_size < 1:
        raise SettingError(f"--batch_size={args.batch_size} must be at least 1")
    if args.bootstrap_iters < 0:
        raise SettingError(f"--bootstrap_iters={args.bootstrap_iters} must be 0 or more")
    _seeds(args.seed)
    if args.gen_kwargs is not None:
        bad = [item for item in args.gen_kwargs.split(",") if "=" not in item]
        if bad or not args.gen_kwargs.strip():
            raise SettingError(f"--gen_kwargs={args.gen_kwargs!r} is not key=value pairs separated "
                               "by commas (e.g. --gen_kwargs=max_gen_toks=64)")
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise SettingError("--fewshot_as_multiturn needs --apply_chat_template (the turns are "
                           "the chat's)")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise NotFoundError(f"--include_path={args.include_path} is not a directory")
    if args.output_path is not None:
        if os.path.exists(args.output_path):
            raise ExistsError(f"--output_path={args.output_path} exists; nothing is overwritten: "
                              "give a new file name")
        parent = os.path.dirname(os.path.abspath(args.output_path))
        if not os.path.isdir(parent):
            raise NotFoundError(f"--output_path={args.output_path}: no directory {parent}")
    return tasks


def _limit(value: float | None) -> int | float | None:
    """lm_eval's reading: a whole number is a count of documents, below 1 a fraction."""
    if value is None or value < 1:
        return value
    return int(value) if value == int(value) else value


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.eval.harness_lm import evaluate, import_lm_eval, task_manager

    tasks = _check_arguments(args)
    model = model_source.resolve_model(args, assignments)
    tokenizer = model_source.load_tokenizer(model)
    if tokenizer is None:
        raise SettingError(
            f"lm_eval's tasks are text and {model.source} names no tokenizer: pass "
            "--fdl.VOCAB_PATH=/path/to/spm.model or set VOCAB_PATH")
    bos = model_source.bos_id(BosChoice(args.add_bos or BosChoice.AUTO), model,
                              tokenizer)
    chat = None
    if args.apply_chat_template:  # a missing template is one line, before any parameter is read
        from paxlite.data.chat_template import chat_template_for

        name = args.apply_chat_template if isinstance(args.apply_chat_template, str) else None
        chat = chat_template_for(tokenizer, template_name=name)
    import_lm_eval()
    manager = task_manager(args.include_path, tasks)  # every process: an unknown task, exit 2

    process = model_source.join_processes(args, model, doing="scoring")
    from paxlite.eval.harness import ModelRunner

    mesh, _ = model_source.build_mesh(model)  # a mesh that does not fit is an error before reading
    params = model_source.restore_params(model, mesh)
    runner = ModelRunner(model_config=model.config, params=params, mesh=mesh,
                         batch_size=args.batch_size,
                         eos_id=tokenizer.eos_id if tokenizer.eos_id >= 0 else None,
                         decode=tokenizer.decode)
    results = evaluate(runner=runner, tokenizer=tokenizer, bos_id=bos, tasks=tasks,
                       num_fewshot=args.num_fewshot, limit=_limit(args.limit),
                       include_path=args.include_path, log_samples=args.log_samples,
                       bootstrap_iters=args.bootstrap_iters, manager=manager,
                       gen_kwargs=args.gen_kwargs, chat=chat,
                       apply_chat_template=args.apply_chat_template,
                       system_instruction=args.system_instruction,
                       fewshot_as_multiturn=args.fewshot_as_multiturn, **_seeds(args.seed))
    if process != 0 or results is None:
        return 0
    _report(results, args)
    return 0


def _report(results: dict, args: argparse.Namespace) -> None:
    from paxlite.eval.harness_lm import results_json, results_tables

    results.setdefault("config", {})["model"] = "paxlite"
    results["config"]["model_args"] = {
        "job_log_dir": args.job_log_dir, "checkpoint": args.checkpoint,
        "fdl_config": args.fdl_config, "add_bos": args.add_bos or BosChoice.AUTO.value,
        "apply_chat_template": args.apply_chat_template}
    if args.output_path is not None:
        text = results_json(results)
        try:
            with open(args.output_path, "x", encoding="utf-8") as f:  # never over another file
                f.write(text + "\n")
        except FileExistsError:
            raise ExistsError(f"--output_path={args.output_path} appeared while scoring; nothing "
                              "is overwritten: give a new file name") from None
    print(results_tables(results), flush=True)
    if args.output_path is not None:
        print(f"results: {args.output_path}", flush=True)
