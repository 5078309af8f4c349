"""``python -m paxlite convert``: any of HF / Meta / paxlite checkpoints to paxlite or HF
(LLaMA-style, Mixtral and GPT-2 for HF).

    python -m paxlite convert --from=hf --to=paxlite --input=llama-2-7b-hf --output=ckpt \
        --fdl_config=LLaMA7B
    python -m paxlite convert --from=meta --to=paxlite --input=llama-2-7b --output=ckpt
    python -m paxlite convert --from=paxlite --to=hf --input=JOB_OR_CKPT_DIR --output=hf_dir
    python -m paxlite convert --from=paxlite --to=te --input=JOB_OR_CKPT_DIR --output=te_ckpt \
        [--weight-only] [--num-gqa-groups=K --te-qkv-layout=kv_packed --pax-split-qkv ...]
    python -m paxlite convert --from=te --to=paxlite --input=te_ckpt --output=ckpt
    python -m paxlite convert --from=pax --fdl_config=LLaMA7B --input=PAX_DIR --output=ckpt
    python -m paxlite convert --from=paxlite --to=pax --input=JOB_OR_CKPT_DIR --output=PAX_DIR

With ``--fdl_config`` (and optional ``--fdl.X=V`` overrides) the converted model must have the
experiment's architecture; every differing field is reported with both values. The paxlite
checkpoint written then records the experiment's own model config (e.g. its scanned layer stack),
so a training run restoring from it reads it as it is.

Reading a paxlite checkpoint, the model config comes from, in order: ``model_config.json`` beside it
(written by every conversion; exact), ``--fdl_config`` (checked against model_config.json when both
exist), or the training job's ``config.json`` (experiment name + overridden hyperparameters, rebuilt
through the registry, so it follows the experiment's current code).

A command rather than part of interop/, because ``--fdl_config`` and a job's ``config.json`` need
the registry of experiments, which sits above interop/; the formats are `paxlite.interop`'s, the
request and its checks `paxlite.cli.conversion`'s. Only the standard library is imported at the top
(and the two small modules above), so ``python -m paxlite`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from paxlite.cli.conversion import (
    TE_OPTION_FLAGS,
    ConvertRequest,
    ConvertSummary,
    Source,
    Target,
    adopt_config,
    adopted_config,
    architecture_differences,
    copy_tokenizer_beside_model,
    experiment_model_config,
    find_tokenizer,
    model_config_from_job,
    read_paxlite,
    record_model_type,
    refuse_input_inside,
    replaceable,
)
from paxlite.interop import hf_write
from paxlite.interop.errors import ConversionError
from paxlite.paths import check_output_dir, require_local_path

if TYPE_CHECKING:
    from paxlite.interop.hf import Pretrained
    from paxlite.models.transformer import TransformerConfig

__all__ = [
    "ConversionError",
    "ConvertRequest",
    "ConvertSummary",
    "Source",
    "Target",
    "adopt_config",
    "adopted_config",
    "architecture_differences",
    "convert",
    "experiment_model_config",
    "model_config_from_job",
    "read_paxlite",
]


def _read(request: ConvertRequest, experiment_config: TransformerConfig | None) -> Pretrained:
    from paxlite.interop import hf

    if request.source is Source.HF:
        return hf.load(request.input, dtype=request.dtype)
    if request.source is Source.META:
        return hf.from_meta(request.input, vocab_size=request.vocab_size, dtype=request.dtype)
    return read_paxlite(request.input, config=experiment_config, dtype=request.dtype)


def _convert_replacing(request: ConvertRequest, target: str) -> Pretrained | ConvertSummary:
    """--overwrite: the new output is written beside ``target`` and swapped in only once it is
    complete, so a conversion that fails leaves the earlier output as it was."""
    import shutil

    fresh, old = target + ".overwrite-new", target + ".overwrite-old"
    for leftover in (fresh, old):  # left by a killed --overwrite run; refused if anything else
        if os.path.exists(leftover):
            replaceable(leftover, inputs=[request.input])
            shutil.rmtree(leftover)
    result = convert(dataclasses.replace(request, output=fresh, overwrite=False))
    os.replace(target, old)
    os.replace(fresh, target)
    shutil.rmtree(old)
    return result


def convert(request: ConvertRequest) -> Pretrained | ConvertSummary:
    """Reads the input, checks it against --fdl_config if given, writes the output. A paxlite
    output of an HF or Meta input also gets the input's own tokenizer (`find_tokenizer`, copied
    by `copy_tokenizer_beside_model`), so that ``python -m paxlite generate --checkpoint=OUTPUT
    --prompt=...`` finds the tokenizer and whether to add BOS. An existing output is refused
    unless ``overwrite`` (and it is an earlier conversion's output)."""
    if request.overwrite:
        target = replaceable(request.output, inputs=[request.input])
        if target is not None:
            return _convert_replacing(request, target)
    elif os.path.isdir(request.output) and os.listdir(request.output):
        from paxlite.paths import OutputExistsError

        refuse_input_inside(os.path.abspath(request.output), inputs=[request.input])
        raise OutputExistsError(
            f"--output={os.path.abspath(request.output)!r} exists and is not empty; refusing to "
            "overwrite it: choose a new or empty directory, or pass --overwrite to replace an "
            "earlier conversion's output")
    tokenizer = None
    if request.target is Target.PAXLITE and request.source in (Source.HF, Source.META):
        tokenizer = find_tokenizer(dataclasses.replace(request, vocab_path=None))
    result = _convert(request)
    if tokenizer is not None:
        copy_tokenizer_beside_model(tokenizer, request.output)
        if request.source is Source.HF and hf_write.is_hf_tokenizer(tokenizer):
            record_model_type(request.input, request.output)
    return result



def _convert(request: ConvertRequest) -> Pretrained | ConvertSummary:
    from paxlite.interop import hf

    if request.source is Source.TE or request.target is Target.TE:
        return convert_te(request)
    if request.te_options:
        flags = [flag for flag, dest in TE_OPTION_FLAGS if dest in request.te_options]
        raise ConversionError(f"{', '.join(flags)} only "
                              f"{'applies' if len(flags) == 1 else 'apply'} to --to=te or "
                              f"--from=te (here --from={request.source.value} "
                              f"--to={request.target.value})")
    if request.assignments and not request.fdl_config:
        raise ConversionError(f"--fdl.X overrides {list(request.assignments)} need --fdl_config")
    if request.vocab_size is not None and request.source is not Source.META:
        raise ConversionError("--vocab_size is only for --from=meta (params.json vocab_size -1)")
    if request.source is Source.PAX and not request.fdl_config:
        raise ConversionError("--from=pax needs --fdl_config=NAME: a Pax checkpoint does not "
                              "record its model, the experiment that trained it does (e.g. "
                              "--fdl_config=LLaMA7B, or GPT126M with its --fdl.X overrides)")
    if request.source is Source.PAX and request.target is Target.PAX:
        raise ConversionError("--from=pax --to=pax: the input already is in Pax's layout")
    hf_only = [f for f, v in (("--max_shard_size", request.max_shard_size),
                              ("--vocab_path", request.vocab_path)) if v is not None]
    if hf_only and request.target is not Target.HF:
        raise ConversionError(f"{', '.join(hf_only)} only "
                              f"{'applies' if len(hf_only) == 1 else 'apply'} to --to=hf (here "
                              f"--to={request.target.value})")
    if request.max_shard_size is not None:
        hf_write.parse_size(request.max_shard_size)
    # Every output precondition before the first byte of a (possibly 140 GB) input is read.
    require_local_path(request.input, setting="--input")
    vocab_path = find_tokenizer(request) if request.target is Target.HF else None
    check_output_dir(request.output, setting="--output", inputs=[request.input])
    experiment_config = None
    if request.fdl_config:
        experiment_config = experiment_model_config(request.fdl_config, request.assignments)
    if request.source is Source.HF and request.target is Target.PAXLITE and _has_safetensors(
            request.input):
        return _stream_hf_to_paxlite(request, experiment_config)
    if request.source is Source.PAXLITE and request.target is Target.HF:
        return _stream_paxlite_to_hf(request, experiment_config, vocab_path=vocab_path)
    if request.source is Source.META and request.target is Target.PAXLITE:
        return _stream_meta_to_paxlite(request, experiment_config)
    if request.source is Source.META and request.target is Target.HF:
        return _stream_meta_to_hf(request, experiment_config, vocab_path=vocab_path)
    if request.source is Source.PAX:
        return _stream_from_pax(request, experiment_config, vocab_path=vocab_path)
    if request.source is Source.PAXLITE and request.target is Target.PAX:
        return _stream_paxlite_to_pax(request, experiment_config)
    pretrained = _read(request, experiment_config)
    if experiment_config is not None:
        adopted = adopt_config(pretrained, config=experiment_config, experiment=request.fdl_config)
        if request.target is Target.PAXLITE:
            pretrained = adopted
    if request.target is Target.HF:
        hf.save(pretrained, request.output, dtype=request.dtype,
                **_hf_shard_options(request, vocab_path=vocab_path))
    elif request.target is Target.PAX:
        from paxlite.interop import pax

        repeated = _scan_layers(request, experiment_config)
        pax.save(pretrained, request.output, repeated=repeated, dtype=request.dtype)
    else:
        hf.to_paxlite(pretrained, request.output)
    return pretrained


def _adopted(config: TransformerConfig, *, request: ConvertRequest,
             experiment_config: TransformerConfig | None) -> TransformerConfig:
    """`config` checked against --fdl_config's model (when given) and taking its settings."""
    if experiment_config is None:
        return config
    assert request.fdl_config is not None
    return adopted_config(config, config=experiment_config, experiment=request.fdl_config)


def _paxlite_input_config(request: ConvertRequest, experiment_config: TransformerConfig | None
                          ) -> TransformerConfig:
    """The model config of a paxlite input as `read_paxlite` finds it, checked against
    --fdl_config's."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.interop import hf

    _, step_dir = find_checkpoint(request.input)
    config = hf.find_model_config(os.path.abspath(request.input), step_dir=step_dir)
    if config is None:
        config = experiment_config or model_config_from_job(step_dir.parent.parent)
    _adopted(config, request=request, experiment_config=experiment_config)
    return config


def _hf_shard_options(request: ConvertRequest, *, vocab_path: str | None) -> dict[str, Any]:
    """How every conversion to HF writes its shards and tokenizer."""
    return {
        "max_shard_size": request.max_shard_size or hf_write.DEFAULT_MAX_SHARD_SIZE,
        "vocab_path": vocab_path,
        "vocab_setting": "--vocab_path" if request.vocab_path else "the input's tokenizer",
    }


def _has_safetensors(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name))
               for name in ("model.safetensors", "model.safetensors.index.json"))


def _stream_hf_to_paxlite(request: ConvertRequest, experiment_config: TransformerConfig | None
                          ) -> ConvertSummary:
    """HF safetensors -> paxlite one layer at a time (never the whole model in memory)."""
    from paxlite.interop import stream

    source = stream.open_hf(request.input, dtype=request.dtype)
    config = _adopted(source.config, request=request, experiment_config=experiment_config)
    num_params = stream.write_paxlite(source, request.output, config=config)
    return ConvertSummary(family=source.family.value, num_params=num_params)


def _stream_paxlite_to_hf(request: ConvertRequest, experiment_config: TransformerConfig | None,
                          *, vocab_path: str | None) -> ConvertSummary:
    """paxlite -> HF safetensors one layer at a time (`hf.stream_paxlite_to_hf`); the model config
    as `read_paxlite` finds it, checked against --fdl_config's."""
    from paxlite.interop import hf
    from paxlite.interop.hf_config import family_of_config

    config = _paxlite_input_config(request, experiment_config)
    config, num_params = hf.stream_paxlite_to_hf(
        request.input, request.output, config=config, dtype=request.dtype,
        **_hf_shard_options(request, vocab_path=vocab_path))
    return ConvertSummary(family=family_of_config(config).value, num_params=num_params)

def _stream_meta_to_paxlite(request: ConvertRequest, experiment_config: TransformerConfig | None
                            ) -> ConvertSummary:
    """Meta consolidated shards -> paxlite one layer at a time (never the whole model in memory)."""
    from paxlite.interop import meta
    from paxlite.interop.hf_config import Family

    source = meta.open_meta(request.input, vocab_size=request.vocab_size, dtype=request.dtype)
    config = _adopted(source.config, request=request, experiment_config=experiment_config)
    num_params = meta.write_paxlite(source, request.output, config=config)
    return ConvertSummary(family=Family.LLAMA.value, num_params=num_params)


def _stream_meta_to_hf(request: ConvertRequest, experiment_config: TransformerConfig | None,
                       *, vocab_path: str | None) -> ConvertSummary:
    """Meta consolidated shards -> HF safetensors one layer at a time."""
    from paxlite.interop import hf, meta
    from paxlite.interop.hf_config import Family

    source = meta.open_meta(request.input, vocab_size=request.vocab_size, dtype=request.dtype)
    _adopted(source.config, request=request, experiment_config=experiment_config)
    num_params = hf.stream_source_to_hf(
        source, request.output, config=source.config, dtype=request.dtype,
        **_hf_shard_options(request, vocab_path=vocab_path))
    return ConvertSummary(family=Family.LLAMA.value, num_params=num_params)


def _scan_layers(request: ConvertRequest, experiment_config: TransformerConfig | None) -> bool:
    """Whether the model's layers are repeated (Pax's ``repeat.sub``): the experiment's, else the
    paxlite checkpoint's own model config; other sources name no experiment (unrepeated)."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.interop import hf

    if experiment_config is not None:
        return experiment_config.scan_layers
    if request.source is not Source.PAXLITE:
        return False
    _, step_dir = find_checkpoint(request.input)
    config = hf.find_model_config(os.path.abspath(request.input), step_dir=step_dir)
    return (config or model_config_from_job(step_dir.parent.parent)).scan_layers


def _stream_from_pax(request: ConvertRequest, experiment_config: TransformerConfig | None, *,
                     vocab_path: str | None) -> ConvertSummary:
    """Pax -> paxlite or HF one layer at a time; every Pax name and shape is checked against
    --fdl_config's model first (`pax.open_pax`)."""
    from paxlite.interop import pax
    from paxlite.interop.hf_config import family_of_config

    assert experiment_config is not None and request.fdl_config is not None
    source = pax.open_pax(request.input, config=experiment_config, experiment=request.fdl_config,
                          dtype=request.dtype)
    if request.target is Target.HF:
        num_params = pax.write_hf(
            source, request.output,
            **_hf_shard_options(request, vocab_path=vocab_path))
    else:
        config = adopted_config(source.config, config=experiment_config,
                                experiment=request.fdl_config)
        num_params = pax.write_paxlite(source, request.output, config=config)
    return ConvertSummary(family=family_of_config(source.config).value, num_params=num_params)


def _stream_paxlite_to_pax(request: ConvertRequest, experiment_config: TransformerConfig | None
                           ) -> ConvertSummary:
    """paxlite -> Pax one layer at a time (`pax.stream_paxlite_to_pax`): the model config as
    `read_paxlite` finds it, checked against --fdl_config's, whose layer stack (else the
    checkpoint's) decides ``repeat.sub``."""
    from paxlite.interop import pax
    from paxlite.interop.hf_config import family_of_config

    config = _paxlite_input_config(request, experiment_config)
    num_params = pax.stream_paxlite_to_pax(request.input, request.output, config=config,
                                           repeated=_scan_layers(request, experiment_config),
                                           dtype=request.dtype)
    return ConvertSummary(family=family_of_config(config).value, num_params=num_params)


def _te_model_config(step_dir: Any, path: str, *, source: Source) -> TransformerConfig:
    """model_config.json beside the checkpoint (exact), else the job's config.json; a job's
    config.json records hyperparameters, not ENABLE_TE, so with --from=te its model is TE's."""
    import dataclasses as dc

    from paxlite.interop import hf
    from paxlite.models.transformer_config import LayerImplementation

    config = hf.find_model_config(os.path.abspath(path), step_dir=step_dir)
    if config is not None:
        return config
    config = model_config_from_job(step_dir.parent.parent)
    if source is Source.TE:
        config = dc.replace(config, layer_implementation=LayerImplementation.TRANSFORMER_ENGINE)
    return config


def convert_te(request: ConvertRequest) -> ConvertSummary:
    """paxlite <-> Transformer Engine: the whole train state (optimizer moments included unless
    --weight-only), same step, other items of the step directory copied (Pax's converter copies
    every other folder). Works on parameter trees: no TE, no GPU needed."""
    import dataclasses as dc

    import jax

    from paxlite.checkpointing.pretrained import find_checkpoint, read_state, save_state
    from paxlite.interop import te
    from paxlite.interop.hf import cast_params

    pair = (request.source, request.target)
    if pair not in ((Source.PAXLITE, Target.TE), (Source.TE, Target.PAXLITE)):
        raise ConversionError(
            f"--from={request.source.value} --to={request.target.value}: Transformer Engine "
            "checkpoints convert to and from paxlite only (--from=paxlite --to=te, --from=te "
            "--to=paxlite); convert other formats to paxlite first")
    if request.fdl_config or request.assignments:
        raise ConversionError("--fdl_config/--fdl.X are not read by TE conversions: the model "
                              "comes from model_config.json beside the checkpoint or the job's "
                              "config.json")
    given = dict(request.te_options or {})
    layout = given.pop("te_qkv_layout", None)
    options = te.TeOptions(te_qkv_layout=None if layout is None else te.QkvLayout(layout), **given)
    require_local_path(request.input, setting="--input")
    check_output_dir(request.output, setting="--output", inputs=[request.input])
    _, step_dir = find_checkpoint(request.input)
    config = _te_model_config(step_dir, request.input, source=request.source)
    to_te = request.target is Target.TE
    try:
        out_config = te.te_config(config) if to_te else te.paxlite_config(config)
    except ValueError as error:
        if isinstance(error, ConversionError):
            raise
        raise ConversionError(f"cannot convert to Transformer Engine: {error}") from None
    te.resolve_options(config, options)  # before reading the (possibly large) state
    step, step_dir, state = read_state(request.input)
    converted = te.convert_state(state, config=config, to_te=to_te, options=options)
    converted["params"] = cast_params(converted["params"], request.dtype)
    out_config = dc.replace(out_config, dtype=request.dtype, param_dtype=request.dtype)
    save_state(request.output, converted, step=step, model_config=out_config,
               copy_items_from=step_dir)
    num = sum(int(leaf.size) for leaf in jax.tree.leaves(converted["params"]))
    return ConvertSummary(family=out_config.layer_implementation.value, num_params=num)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, choices=[s.value for s in Source])
    parser.add_argument("--to", dest="target", required=True, choices=[t.value for t in Target])
    parser.add_argument("--input", required=True, help="HF model dir, Meta checkpoint dir, "
                        "paxlite job/checkpoint dir, or Pax job/checkpoints/checkpoint_<STEP> dir")
    parser.add_argument("--output", required=True, help="a new (or empty) directory")
    parser.add_argument("--fdl_config", default=None,
                        help="experiment whose model the converted one must be (accepts --fdl.X=V)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier conversion's output (written beside it first and "
                        "swapped in when complete); a directory holding anything else is refused")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the written weights")
    parser.add_argument("--max_shard_size", default=None,
                        help="--to=hf: largest safetensors shard, e.g. 5GB, 500MB, 2GiB or bytes "
                        f"(default {hf_write.DEFAULT_MAX_SHARD_SIZE}, as transformers' "
                        "save_pretrained)")
    parser.add_argument("--vocab_path", default=None,
                        help="--to=hf: SentencePiece model to ship as the tokenizer (default: the "
                        "input's tokenizer.model, or a training job's VOCAB_PATH)")
    parser.add_argument("--vocab_size", type=int, default=None,
                        help="Meta only: vocabulary size when params.json says -1 and there is no "
                        "tokenizer.model beside the checkpoint")
    te_group = parser.add_argument_group(
        "Transformer Engine (--to=te / --from=te; Pax converter options, checked against the model)"
    )
    te_group.add_argument("--num-gqa-groups", dest="num_gqa_groups", type=int, default=None,
                          help="key/value heads (must be the model's)")
    te_group.add_argument("--te-qkv-layout", dest="te_qkv_layout", default=None,
                          choices=("qkv_packed", "kv_packed"),
                          help="qkv_packed without GQA, kv_packed with GQA (default: the model's)")
    for flag, dest, text in (
        ("--weight-only", "weight_only", "drop the optimizer state (keep step and params)"),
        ("--skip-bias", "skip_bias", "the model has no biases (an error if it has)"),
        ("--use-gated-activations", "use_gated_activations", "the MLP is gated (SwiGLU)"),
        ("--pax-split-qkv", "pax_split_qkv", "paxlite's q, k, v are separate kernels (GQA)"),
    ):
        te_group.add_argument(flag, dest=dest, action="store_true", default=None, help=text)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_freed_buffers() -> None:
    """Makes glibc give every freed buffer of 128 KiB or more back to the OS at once, for the rest
    of this process: the conversion processes (`convert`, `export_merged`) call it, not the Python
    API, so a notebook or a trainer keeps glibc's own policy.

    glibc maps a buffer of its own only above a threshold, and raises that threshold to the size of
    each such buffer freed (up to 32 MiB); below it, buffers come from heaps whose freed space stays
    resident while live buffers sit between. Converting a model whose tensors are under 32 MiB, one
    layer after another, so keeps many layers' worth resident (measured for --from=pax on a 480 MiB
    model of 16 layers: 0.54x its size above the process's own, 0.24x with this). A threshold set
    explicitly is never raised. Nothing happens off glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 128 * 2**10)


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    """`python -m paxlite convert`; a conversion mistake (paths, formats, experiments) is a
    UserError, which the command line reports in one line."""
    request = ConvertRequest(
        source=Source(args.source), target=Target(args.target), input=args.input,
        output=args.output, fdl_config=args.fdl_config, assignments=tuple(assignments),
        dtype=args.dtype, vocab_size=args.vocab_size, max_shard_size=args.max_shard_size,
        vocab_path=args.vocab_path, overwrite=args.overwrite,
        te_options={dest: getattr(args, dest) for _, dest in TE_OPTION_FLAGS
                    if getattr(args, dest, None) is not None} or None,
    )
    start = time.perf_counter()
    return_freed_buffers()
    pretrained = convert(request)
    family = getattr(pretrained.family, "value", pretrained.family)
    print(f"converted {family} {request.source.value} -> {request.target.value}: "
          f"{pretrained.num_params:,} parameters, {request.dtype}, "
          f"{time.perf_counter() - start:.1f} s -> {request.output}")
    return 0
