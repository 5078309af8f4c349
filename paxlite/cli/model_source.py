"""Where a command that runs a finished model (`generate`, `lm_eval`) gets it from.

One answer for every such command, so that a model scored by `python -m paxlite lm_eval` is the very
model `python -m paxlite generate` samples: the model config from a job's config.json (its
experiment and overrides), from the model_config.json that `convert` writes beside a checkpoint, or
from
--fdl_config; the parameters from the latest complete checkpoint, read as CHECKPOINT_RESTORE_PATH
reads them, sharded over the experiment's mesh; the tokenizer the experiment names (VOCAB_PATH) or
the one `convert` copied beside the checkpoint; and BOS as the model family was trained.

Everything here up to `join_processes` reads only small files: a user mistake is one error before
any device is touched or any parameter read.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from paxlite.data.tokenizer import tokenizer_in
from paxlite.errors import NotFoundError, SettingError


class BosChoice(str, enum.Enum):
    """Whether text starts with the tokenizer's BOS id.

    AUTO follows how the model family was trained: LLaMA, Mistral/Mixtral and Fuji experiments
    (BaseLLaMA's subclasses, whose family_adds_bos says so) start every sequence with BOS; GPT, GLaM
    and the tiny Pax-style models have none. A converted checkpoint alone follows its tokenizer: a
    tokenizer.json's post-processor (transformers' answer), LLaMA-3's rule for a tiktoken file
    (BOS), or for a SentencePiece model ``add_bos_token`` of a tokenizer_config.json beside it when
    there is one (what transformers reads), else BOS whenever the model defines one (LLaMA's and
    Mistral's do; Pax's c4 and T5 vocabularies do not). A tokenizer without BOS never gets one under
    AUTO.
    """

    AUTO = "auto"
    TRUE = "true"
    FALSE = "false"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A model found on disk: what to build, where its parameters are, which tokenizer it reads."""

    config: Any  # TransformerConfig
    checkpoint: str
    vocab_path: str | None
    source: str  # where the config came from, for messages
    # the experiment's MeshConfig; None (a converted model alone): one device
    mesh_config: Any = None
    # BosChoice.AUTO's answer where the experiment decides it (True: LLaMA family); None: the
    # tokenizer decides (a converted model alone)
    family_adds_bos: bool | None = None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--job_log_dir | --checkpoint, and --fdl_config: the flags every model-running command
    takes."""
    source = parser.add_argument_group("model (one of)")
    source.add_argument("--job_log_dir", default=None, help="a training job's directory")
    source.add_argument("--checkpoint", default=None,
                        help="anything CHECKPOINT_RESTORE_PATH reads: a converted model's "
                             "directory, a job's checkpoints/ or one checkpoint_<STEP> directory")
    parser.add_argument("--fdl_config", default=None,
                        help="the experiment, when no config.json or model_config.json says it")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Pax's multi-process flags, as training takes them."""
    launch = parser.add_argument_group("several processes (as training; SLURM and Kubernetes are "
                                       "detected from the environment)")
    launch.add_argument("--multiprocess_gpu", action="store_true",
                        help="join a multi-process job with --server_addr, --num_hosts and "
                             "--host_idx (Pax's flags)")
    launch.add_argument("--server_addr", default=None, help="HOST:PORT of process 0")
    launch.add_argument("--num_hosts", type=int, default=None, help="number of processes")
    launch.add_argument("--host_idx", type=int, default=None, help="this process's index")


def check_one_source(args: argparse.Namespace) -> None:
    """One of --job_log_dir and --checkpoint, or neither with --fdl_config (whose
    CHECKPOINT_RESTORE_PATH, checked by resolve_model, names the parameters)."""
    if args.job_log_dir is not None and args.checkpoint is not None:
        raise SettingError("give exactly one of --job_log_dir=DIR and --checkpoint=PATH, not both")
    if args.job_log_dir is None and args.checkpoint is None and not args.fdl_config:
        raise SettingError("give exactly one of --job_log_dir=DIR and --checkpoint=PATH (or "
                           "--fdl_config=NAME with --fdl.CHECKPOINT_RESTORE_PATH=PATH)")


def _restore_path_experiment(args: argparse.Namespace, assignments: Sequence[str]):
    """(the experiment, its CHECKPOINT_RESTORE_PATH) when neither --job_log_dir nor --checkpoint
    is given: the model is --fdl_config's and its parameters come from that path."""
    from paxlite.experiments.build import load_experiment

    experiment = load_experiment(args.fdl_config, assignments)
    if experiment.CHECKPOINT_RESTORE_PATH is None:
        raise SettingError(
            f"--fdl_config={args.fdl_config} alone names no parameters: add "
            "--fdl.CHECKPOINT_RESTORE_PATH=PATH, or give --job_log_dir=DIR or --checkpoint=PATH")
    return experiment, experiment.CHECKPOINT_RESTORE_PATH


def resolve_model(args: argparse.Namespace, assignments: Sequence[str]) -> ModelSource:
    """The model config, checkpoint and tokenizer path; reads only small JSON files."""
    import fiddle as fdl

    from paxlite.checkpointing.pretrained import find_checkpoint, load_model_config
    from paxlite.experiments.build import load_experiment, load_recorded_experiment
    from paxlite.train import export

    path = args.job_log_dir or args.checkpoint
    if path is not None and any(a.startswith("CHECKPOINT_RESTORE_PATH=") for a in assignments):
        raise SettingError("--fdl.CHECKPOINT_RESTORE_PATH and --job_log_dir / --checkpoint both "
                           "name the parameters: give one of them")
    experiment = None
    if path is None:
        experiment, path = _restore_path_experiment(args, assignments)
        source = f"--fdl_config={args.fdl_config} (CHECKPOINT_RESTORE_PATH={path})"
    _, step_dir = find_checkpoint(path)
    record = None if experiment is not None else export.find_job_config(path)
    if record is not None:
        name, overrides = export.job_config_record(path)
        experiment = load_recorded_experiment(name, overrides, assignments, source=str(record),
                                              fdl_config=args.fdl_config)
        source = str(record)
    elif experiment is None and args.fdl_config:
        experiment = load_experiment(args.fdl_config, assignments)
        source = f"--fdl_config={args.fdl_config}"
    if experiment is not None:
        config = fdl.build(experiment.with_lora(experiment.model_config()))
        return ModelSource(config=config, checkpoint=path, vocab_path=experiment.vocab_path(),
                           source=source, mesh_config=fdl.build(experiment.mesh_config()),
                           family_adds_bos=experiment.family_adds_bos)
    if assignments:
        raise SettingError(f"--fdl.{assignments[0]} needs an experiment (--fdl_config=NAME); "
                           f"{path} records its model in model_config.json")
    for directory in (path, step_dir.parent, step_dir.parent.parent):
        config = load_model_config(directory)
        if config is not None:
            # The tokenizer `convert` copied beside the model (from the HF / Meta input; its
            # tokenizer.json before a tokenizer.model, as transformers picks), unless VOCAB_PATH
            # names another.
            vocab = os.environ.get("VOCAB_PATH") or tokenizer_in(directory)
            return ModelSource(config=config, checkpoint=path, vocab_path=vocab,
                               source=os.path.join(os.fspath(directory), "model_config.json"))
    raise NotFoundError(
        f"no config.json or model_config.json beside {path}: give its experiment with "
        "--fdl_config=NAME (and the --fdl.X overrides it was trained with)")


def load_tokenizer(model: ModelSource):
    """The model's tokenizer (checked to fit its vocabulary), or None when it names none."""
    if model.vocab_path is None:
        return None
    from paxlite.data.tokenizer import Tokenizer, bind_model_vocab

    tokenizer = Tokenizer(model.vocab_path)
    bind_model_vocab(tokenizer, vocab_size=model.config.vocab_size)
    return tokenizer


def restore_params(model: ModelSource, mesh):
    """Parameters sharded over the experiment's mesh by the training rules, each process reading
    only its shards; without a mesh, whole onto one device."""
    import jax
    from flax import linen as nn

    from paxlite.checkpointing.pretrained import restore_params as restore
    from paxlite.models.decode import decoding_config
    from paxlite.models.transformer import abstract_variables, logical_param_axes
    from paxlite.parallel.rules import DEFAULT_RULES, logical_to_shardings

    config = decoding_config(model.config)
    abstract = nn.meta.unbox(abstract_variables(config))["params"]
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        # as training shards them (kv heads that do not divide the tensor axis stay whole)
        shardings = logical_to_shardings(logical_param_axes(config), mesh, DEFAULT_RULES,
                                         shapes=abstract)
    abstract = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract, shardings)
    _, params = restore(model.checkpoint, abstract)
    return params


def batch_multiple(mesh) -> int:
    """The number of ways a mesh splits the batch (rows must be a multiple of it); 1 without one."""
    from paxlite.parallel.mesh import BATCH_AXES

    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)


def build_mesh(model: ModelSource):
    """The experiment's mesh (as training builds it), the batch size its batch axes divide."""
    from paxlite.parallel.mesh import build_mesh as build

    if model.mesh_config is None:
        return None, 1
    mesh = build(model.mesh_config)
    return mesh, batch_multiple(mesh)


def tokenizer_adds_bos(vocab_path: str) -> bool | None:
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


def bos_id(choice: BosChoice, model: ModelSource, tokenizer) -> int | None:
    """The id text starts with, or None."""
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
    if adds is None and tokenizer.adds_bos is not None:  # a tokenizer.json or tiktoken file
        adds = tokenizer.adds_bos
    if adds is None:
        from_config = tokenizer_adds_bos(tokenizer.path)
        adds = True if from_config is None else from_config
    return tokenizer.bos_id if adds else None


def join_processes(args: argparse.Namespace, model: ModelSource, *, doing: str) -> int:
    """Joins the other processes (before any device is touched); returns this process's index.

    doing: what needs the mesh, for the message (e.g. "generating")."""
    import jax

    from paxlite.parallel import distributed

    launch = distributed.detect_launch(
        multiprocess_gpu=args.multiprocess_gpu, server_addr=args.server_addr,
        num_hosts=args.num_hosts, host_idx=args.host_idx, env=os.environ)
    if launch.is_distributed and model.mesh_config is None:  # found before connecting
        raise SettingError(
            f"{doing} over {launch.num_processes} processes needs the experiment's mesh, and "
            f"{model.source} names no experiment: add --fdl_config=NAME")
    distributed.initialize(launch, timeouts=distributed.timeouts_from_env(os.environ))
    return jax.process_index()
