"""`python -m paxlite generate`: text (or token ids) from a trained job or any paxlite checkpoint.

    python -m paxlite generate --job_log_dir=DIR | --checkpoint=PATH [--fdl_config=NAME --fdl.X=V]
        --prompt=TEXT ... | --prompt_file=F | --prompt_ids=1,2,3 ...
        [--max_new_tokens=N --temperature=T --top_k=K --top_p=P --seed=S --format=text|json]
        [--add_bos=auto|true|false]
        [--multiprocess_gpu --server_addr=HOST:PORT --num_hosts=N --host_idx=I]

The model comes from the job's config.json (its experiment and overrides), or from the
model_config.json that `convert` writes beside a checkpoint, or from --fdl_config; the parameters
from the latest complete checkpoint, read as CHECKPOINT_RESTORE_PATH reads them. The tokenizer is
the experiment's VOCAB_PATH (or the VOCAB_PATH environment variable, as Pax; for a converted
model, the tokenizer.model `convert` copied beside it), and its EOS ends a sample. Every user mistake is one line and exit 2, found before any parameter is read.

Text prompts start with the tokenizer's BOS where the model family was trained so (BosChoice);
token-id prompts are used as given. Several processes (Pax's flags, SLURM, Kubernetes, as training)
run one SPMD decode loop over the experiment's mesh: each parses the same prompts, and process 0
prints the outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from paxlite.errors import NotFoundError, SettingError, UserError
from paxlite.interop.hf_write import TOKENIZER_FILE


class OutputFormat:
    TEXT = "text"
    JSON = "json"


class BosChoice(str, enum.Enum):
    """Whether text prompts start with the tokenizer's BOS id.

    AUTO follows how the model family was trained: LLaMA, Mistral/Mixtral and Fuji experiments
    (BaseLLaMA's subclasses) start every sequence with BOS; GPT, GLaM and the tiny Pax-style models
    have none. A converted checkpoint alone follows its tokenizer: ``add_bos_token`` of a
    tokenizer_config.json beside the tokenizer file when there is one (what transformers reads),
    else BOS whenever the SentencePiece model defines one (LLaMA's and Mistral's do; Pax's c4 and
    T5 vocabularies do not). A tokenizer without BOS never gets one under AUTO.
    """

    AUTO = "auto"
    TRUE = "true"
    FALSE = "false"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("model (one of)")
    source.add_argument("--job_log_dir", default=None, help="a training job's directory")
    source.add_argument("--checkpoint", default=None,
                        help="anything CHECKPOINT_RESTORE_PATH reads: a converted model's directory, "
                             "a job's checkpoints/ or one checkpoint_<STEP> directory")
    parser.add_argument("--fdl_config", default=None,
                        help="the experiment, when no config.json or model_config.json says it")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompt_file", default=None, help="one text prompt per non-empty line")
    parser.add_argument("--prompt_ids", action="append", default=[],
                        help="a prompt as comma-separated token ids (repeatable; no tokenizer needed)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: no top-k restriction")
    parser.add_argument("--top_p", type=float, default=1.0, help="in (0, 1]; 1: no nucleus restriction")
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
    launch = parser.add_argument_group("several processes (as training; SLURM and Kubernetes are "
                                       "detected from the environment)")
    launch.add_argument("--multiprocess_gpu", action="store_true",
                        help="join a multi-process job with --server_addr, --num_hosts and "
                             "--host_idx (Pax's flags)")
    launch.add_argument("--server_addr", default=None, help="HOST:PORT of process 0")
    launch.add_argument("--num_hosts", type=int, default=None, help="number of processes")
    launch.add_argument("--host_idx", type=int, default=None, help="this process's index")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Model:
    config: Any  # TransformerConfig
    checkpoint: str
    vocab_path: str | None
    source: str  # where the config came from, for messages
    mesh_config: Any = None  # the experiment's MeshConfig; None (a converted model alone): one device
    # BosChoice.AUTO's answer where the experiment decides it (True: LLaMA family); None: the
    # tokenizer decides (a converted model alone)
    family_adds_bos: bool | None = None


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

    if (args.job_log_dir is None) == (args.checkpoint is None):
        raise SettingError("give exactly one of --job_log_dir=DIR and --checkpoint=PATH"
                           + ("" if args.job_log_dir is None else ", not both"))
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


def _resolve_model(args: argparse.Namespace, assignments: Sequence[str]) -> _Model:
    """The model config, checkpoint and tokenizer path; reads only small JSON files."""
    import fiddle as fdl

    from paxlite.experiments.build import load_experiment, load_recorded_experiment
    from paxlite.train import export
    from paxlite.train.pretrained import find_checkpoint, load_model_config

    path = args.job_log_dir or args.checkpoint
    _, step_dir = find_checkpoint(path)
    record = export.find_job_config(path)
    experiment = None
    if record is not None:
        name, overrides = export.job_config_record(path)
        experiment = load_recorded_experiment(name, overrides, assignments, source=str(record),
                                              fdl_config=args.fdl_config)
        source = str(record)
    elif args.fdl_config:
        experiment = load_experiment(args.fdl_config, assignments)
        source = f"--fdl_config={args.fdl_config}"
    if experiment is not None:
        from paxlite.experiments.llama import BaseLLaMA

        config = fdl.build(experiment.with_lora(experiment.model_config()))
        return _Model(config=config, checkpoint=path, vocab_path=experiment.vocab_path(),
                      source=source, mesh_config=fdl.build(experiment.mesh_config()),
                      family_adds_bos=isinstance(experiment, BaseLLaMA))
    if assignments:
        raise SettingError(f"--fdl.{assignments[0]} needs an experiment (--fdl_config=NAME); "
                           f"{path} records its model in model_config.json")
    for directory in (path, step_dir.parent, step_dir.parent.parent):
        config = load_model_config(directory)
        if config is not None:
            # The tokenizer `convert` copied beside the model (from the HF / Meta input), unless
            # VOCAB_PATH names another.
            beside = os.path.join(os.fspath(directory), TOKENIZER_FILE)
            vocab = os.environ.get("VOCAB_PATH") or (beside if os.path.isfile(beside) else None)
            return _Model(config=config, checkpoint=path, vocab_path=vocab,
                          source=os.path.join(os.fspath(directory), "model_config.json"))
    raise NotFoundError(
        f"no config.json or model_config.json beside {path}: give its experiment with "
        "--fdl_config=NAME (and the --fdl.X overrides it was trained with)")


def _restore(model: _Model, mesh):
    """Parameters sharded over the experiment's mesh by the training rules, each process reading
    only its shards; without a mesh, whole onto one device."""
    import jax
    from flax import linen as nn

    from paxlite.models.decode import decoding_config
    from paxlite.models.transformer import abstract_variables, logical_param_axes
    from paxlite.parallel.rules import DEFAULT_RULES
    from paxlite.train.pretrained import restore_params

    config = decoding_config(model.config)
    abstract = nn.meta.unbox(abstract_variables(config))["params"]
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        shardings = nn.logical_to_mesh_sharding(logical_param_axes(config), mesh, DEFAULT_RULES)
    abstract = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract, shardings)
    _, params = restore_params(model.checkpoint, abstract)
    return params


def _mesh(model: _Model):
    """The experiment's mesh (as training builds it), the batch size its batch axes divide."""
    import math

    from paxlite.parallel.mesh import BATCH_AXES, build_mesh

    if model.mesh_config is None:
        return None, 1
    mesh = build_mesh(model.mesh_config)
    return mesh, math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)


def _tokenizer_adds_bos(vocab_path: str) -> bool | None:
    """``add_bos_token`` of the tokenizer_config.json beside a tokenizer file (transformers'
    setting, which `convert --to=hf` writes and HF LLaMA / Mistral directories carry); None when
    there is none or it does not say."""
    path = os.path.join(os.path.dirname(vocab_path), "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("add_bos_token")
    except (OSError, ValueError, AttributeError):
        raise SettingError(
            f"{path} is not a JSON object; fix it or pass --add_bos=true|false") from None
    return value if isinstance(value, bool) else None


def _bos_id(choice: BosChoice, model: _Model, tokenizer) -> int | None:
    """The id text prompts start with, or None."""
    if choice is BosChoice.FALSE:
        return None
    if tokenizer.bos_id is None:
        if choice is BosChoice.TRUE:
            raise SettingError(f"--add_bos=true but the tokenizer {tokenizer.path} defines no BOS "
                               "piece; use --add_bos=auto or false")
        return None
    if choice is BosChoice.TRUE:
        return tokenizer.bos_id
    adds = model.family_adds_bos
    if adds is None:
        from_config = _tokenizer_adds_bos(tokenizer.path)
        adds = True if from_config is None else from_config
    return tokenizer.bos_id if adds else None


def _join_processes(args: argparse.Namespace, model: _Model) -> int:
    """Joins the other processes (before any device is touched); returns this process's index."""
    import jax

    from paxlite.parallel import distributed

    launch = distributed.detect_launch(
        multiprocess_gpu=args.multiprocess_gpu, server_addr=args.server_addr,
        num_hosts=args.num_hosts, host_idx=args.host_idx, env=os.environ)
    if launch.is_distributed and model.mesh_config is None:  # found before connecting
        raise SettingError(
            f"generating over {launch.num_processes} processes needs the experiment's mesh, and "
            f"{model.source} names no experiment: add --fdl_config=NAME")
    distributed.initialize(launch, timeouts=distributed.timeouts_from_env(os.environ))
    return jax.process_index()


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.models.decode import generate

    sampling, texts, prompt_ids = _check_arguments(args)
    model = _resolve_model(args, assignments)
    tokenizer = None
    if model.vocab_path is not None:
        from paxlite.data.tokenizer import Tokenizer, check_vocab_fits

        tokenizer = Tokenizer(model.vocab_path)
        check_vocab_fits(tokenizer, vocab_size=model.config.vocab_size)
    elif texts:
        raise SettingError(
            f"text prompts need a tokenizer and {model.source} names none: pass --fdl.VOCAB_PATH="
            "/path/to/spm.model, set VOCAB_PATH, or give --prompt_ids=1,2,3")
    if texts:
        bos = _bos_id(BosChoice(args.add_bos or BosChoice.AUTO), model, tokenizer)
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

    process = _join_processes(args, model)
    mesh, batch_multiple = _mesh(model)  # a mesh that does not fit is an error before reading
    params = _restore(model, mesh)
    with contextlib.ExitStack() as stack:
        if mesh is not None:  # the cache and activations shard by the training rules
            import jax
            from flax import linen as nn

            from paxlite.parallel.rules import DEFAULT_RULES

            stack.enter_context(jax.set_mesh(mesh))
            stack.enter_context(nn.logical_axis_rules(DEFAULT_RULES))
        outputs = generate(model.config, params, prompt_ids, max_new_tokens=args.max_new_tokens,
                           sampling=sampling, seed=args.seed, eos_id=eos,
                           vocab_limit=None if tokenizer is None else tokenizer.vocab_size,
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


def run_cli(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    try:
        return run(args, assignments)
    except UserError as e:
        print(f"paxlite: error: {e}", file=sys.stderr)
        return 2
