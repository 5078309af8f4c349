"""`python -m paxlite generate`: text (or token ids) from a trained job or any paxlite checkpoint.

    python -m paxlite generate --job_log_dir=DIR | --checkpoint=PATH
        | --fdl_config=NAME --fdl.CHECKPOINT_RESTORE_PATH=PATH
        [--fdl_config=NAME --fdl.X=V]
        --prompt=TEXT ... | --prompt_file=F | --prompt_ids=1,2,3 ...
        [--max_new_tokens=N --temperature=T --top_k=K --top_p=P --seed=S --format=text|json]
        [--add_bos=auto|true|false]
        [--multiprocess_gpu --server_addr=HOST:PORT --num_hosts=N --host_idx=I]

The model comes from the job's config.json (its experiment and overrides), or from the
model_config.json that `convert` writes beside a checkpoint, or from --fdl_config; the parameters
from the latest complete checkpoint, read as CHECKPOINT_RESTORE_PATH reads them. The tokenizer is
the experiment's VOCAB_PATH (or the VOCAB_PATH environment variable, as Pax; for a converted
model, the tokenizer.model `convert` copied beside it), and its EOS ends a sample. Every user
mistake is one line and exit 2, found before any parameter is read.

Text prompts start with the tokenizer's BOS where the model family was trained so (BosChoice);
token-id prompts are used as given. Several processes (Pax's flags, SLURM, Kubernetes, as training)
run one SPMD decode loop over the experiment's mesh: each parses the same prompts, and process 0
prints the outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Sequence

from paxlite.cli import model_source
from paxlite.cli.model_source import BosChoice
from paxlite.errors import NotFoundError, SettingError


class OutputFormat:
    TEXT = "text"
    JSON = "json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model_source.add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompt_file", default=None, help="one text prompt per non-empty line")
    parser.add_argument("--prompt_ids", action="append", default=[],
                        help="a prompt as comma-separated token ids (repeatable; no tokenizer "
                             "needed)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: no top-k restriction")
    parser.add_argument("--top_p", type=float, default=1.0, help="in (0, 1]; 1: no nucleus "
                                                                 "restriction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=(OutputFormat.TEXT, OutputFormat.JSON),
                        default=OutputFormat.TEXT,
                        help="json: one object per prompt (prompt_ids, ids, text)")
    parser.add_argument("--add_bos", choices=[c.value for c in BosChoice], default=None,
                        help="start text prompts with the tokenizer's BOS id; auto (the default): "
                             "as the model family was trained (LLaMA, Mistral, Mixtral, Fuji: "
                             "yes; GPT, GLaM: no; a converted model: its tokenizer's "
                             "add_bos_token, else whether it defines a BOS). --prompt_ids are "
                             "used as given")
    model_source.add_launch_arguments(parser)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SettingError(f"--prompt_ids={text!r} is not a comma-separated list of integers "
                           "(e.g. --prompt_ids=1,2,3)") from None
    if not ids:
        raise SettingError(f"--prompt_ids={text!r} holds no token ids")
    return ids


def _check_arguments(args: argparse.Namespace):
    """The sampling settings and the raw prompts; nothing is read from disk but the prompt file."""
    from paxlite.models.decode import SamplingConfig

    model_source.check_one_source(args)
    if args.max_new_tokens < 1:
        raise SettingError(f"--max_new_tokens={args.max_new_tokens} must be at least 1")
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise SettingError(f"--{e}") from None
    texts = list(args.prompt)
    if args.prompt_file is not None:
        if not os.path.isfile(args.prompt_file):
            raise NotFoundError(f"--prompt_file={args.prompt_file} does not exist")
        with open(args.prompt_file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    ids = [_parse_ids(x) for x in args.prompt_ids]
    if texts and ids:
        raise SettingError("give text prompts (--prompt, --prompt_file) or --prompt_ids, not both")
    if not texts and not ids:
        raise SettingError("no prompt: give --prompt=TEXT, --prompt_file=F or --prompt_ids=1,2,3")
    if any(not t for t in texts):
        raise SettingError("--prompt='' is empty; a prompt needs at least one token")
    if ids and args.add_bos in (BosChoice.TRUE.value, BosChoice.FALSE.value):
        raise SettingError(f"--add_bos={args.add_bos} applies to text prompts; --prompt_ids are "
                           "used as given (write the BOS id into them)")
    return sampling, texts, ids


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.models.decode import generate

    sampling, texts, prompt_ids = _check_arguments(args)
    model = model_source.resolve_model(args, assignments)
    tokenizer = model_source.load_tokenizer(model)
    if tokenizer is None and texts:
        raise SettingError(
            f"text prompts need a tokenizer and {model.source} names none: pass --fdl.VOCAB_PATH="
            "/path/to/spm.model, set VOCAB_PATH, or give --prompt_ids=1,2,3")
    if texts:
        bos = model_source.bos_id(BosChoice(args.add_bos or BosChoice.AUTO), model,
                                  tokenizer)
        prompt_ids = [tokenizer.encode(t, add_bos=bos is not None) for t in texts]
        if any(not ids for ids in prompt_ids):
            raise SettingError("a prompt encodes to no tokens; give a non-empty prompt")
    longest = max(len(p) for p in prompt_ids)
    limit = model.config.max_seq_len
    if longest + args.max_new_tokens > limit:
        raise SettingError(
            f"--max_new_tokens={args.max_new_tokens} plus the longest prompt ({longest} tokens) "
            f"exceeds the model's max_seq_len={limit}")
    vocab = model.config.vocab_size
    bad = sorted({t for p in prompt_ids for t in p if not 0 <= t < vocab})
    if bad:
        raise SettingError(f"--prompt_ids holds {bad[0]}, outside the vocabulary [0, {vocab})")
    eos = tokenizer.eos_id if tokenizer is not None and tokenizer.eos_id >= 0 else None

    process = model_source.join_processes(args, model, doing="generating")
    # a mesh that does not fit is an error before reading
    mesh, batch_multiple = model_source.build_mesh(model)
    params = model_source.restore_params(model, mesh)
    with contextlib.ExitStack() as stack:
        if mesh is not None:  # the cache and activations shard by the training rules
            import jax
            from flax import linen as nn

            from paxlite.parallel.rules import DEFAULT_RULES

            stack.enter_context(jax.set_mesh(mesh))
            stack.enter_context(nn.logical_axis_rules(DEFAULT_RULES))
        outputs = generate(model.config, params, prompt_ids, max_new_tokens=args.max_new_tokens,
                           sampling=sampling, seed=args.seed, eos_id=eos,
                           batch_multiple=batch_multiple)
    if process != 0:  # every process has all the ids; one prints them
        return 0
    for prompt, ids in zip(prompt_ids, outputs, strict=True):
        text = None if tokenizer is None else _continuation(tokenizer, prompt, ids)
        if args.format == OutputFormat.JSON:
            record = {"prompt_ids": prompt, "ids": ids}
            if tokenizer is not None:
                record["prompt"] = tokenizer.decode(prompt)
                record["text"] = text
            print(json.dumps(record), flush=True)
        elif tokenizer is None:
            print(" ".join(map(str, ids)), flush=True)
        else:
            print(tokenizer.decode(prompt + ids), flush=True)
    return 0


def _continuation(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text the generated ids add to the prompt's: decoding them alone would drop the space
    SentencePiece writes at the start of a word piece (``▁king`` -> ``king``)."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + ids)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)
