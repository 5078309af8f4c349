"""Pretrained weights on disk: the one format converters write and `CHECKPOINT_RESTORE_PATH` reads.

A converted (or exported) model is a normal paxlite checkpoint,
`DIR/checkpoints/checkpoint_<STEP>/state`, whose "state" item holds at least `params` (a training
job's checkpoint also holds `step` and `opt_state`). So one reader serves both: initialising a
fine-tuning run from a converted LLaMA, and from another job's training checkpoint, without ever
reading optimizer state it does not need. Beside a converted checkpoint, `DIR/model_config.json`
records the TransformerConfig, so exporting back needs no experiment name.

Paths are accepted in the three spellings users have in hand: the job or output directory (`DIR`, as
Pax's `CHECKPOINT_RESTORE_PATH=<DIR>`), its `checkpoints/` directory (what Pax's run_llama_boolq.sh
passes), or one `checkpoint_<STEP>` directory. A step directory that is not finished (no commit
marker: a save or a copy still under way) is skipped with a warning, and a damaged one is reported
as such, never as a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import traverse_util

from paxlite import compat
from paxlite.checkpointing import checkpoint, pax_layout
from paxlite.checkpointing.checkpoint_damage import (
    CheckpointFormatError,
    incomplete,
    is_damage,
    newer_format,
)
from paxlite.errors import SettingError, UserError
from paxlite.models.transformer import TransformerConfig
from paxlite.paths import staged_output

PyTree = Any

_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")
_ITEM = "state"
MODEL_CONFIG_FILE = "model_config.json"


class PretrainedCheckpointError(UserError, FileNotFoundError):
    """A restore path that holds no readable paxlite checkpoint, or one that does not fit the
    model."""


def _step_dirs(checkpoints: epath.Path) -> list[tuple[int, epath.Path]]:
    """Complete step directories (a `state` item and a finished commit), ascending; Orbax temp dirs
    never match, and each unfinished one (e.g. half-copied) is skipped with one warning."""
    found = []
    for child in checkpoints.iterdir():
        match = _STEP_DIR.match(child.name)
        if not (match and child.is_dir()):
            continue
        problem = None if (child / _ITEM).is_dir() else f"no '{_ITEM}' item"
        problem = problem or _unfinished(child)
        if problem is None:
            found.append((int(match.group(1)), child))
        else:
            logging.warning("Skipping %s: not a complete checkpoint (%s); an earlier step is used "
                            "if there is one", child, problem)
    return sorted(found)


def _unfinished(step_dir: epath.Path) -> str | None:
    """`incomplete`, except for Pax's layout: Pax (Orbax on a local disk) finalises a step by
    renaming its temporary directory to checkpoint_<STEP>, so the name itself is the commit."""
    return None if pax_layout.is_pax_step(step_dir) else incomplete(step_dir)


def _readable(step: int, step_dir: epath.Path) -> tuple[int, epath.Path]:
    problem = newer_format(step_dir)
    if problem is not None:
        raise CheckpointFormatError(problem)
    return step, step_dir


def find_checkpoint(path: str | os.PathLike) -> tuple[int, epath.Path]:
    """(step, step directory) of the latest complete checkpoint that `path` designates."""
    root = epath.Path(os.path.abspath(os.fspath(path)))
    if not root.exists():
        raise PretrainedCheckpointError(f"checkpoint path {root} does not exist")
    match = _STEP_DIR.match(root.name)
    if match:
        problem = None if (root / _ITEM).is_dir() else f"it has no '{_ITEM}' item"
        problem = problem or _unfinished(root)
        if problem is not None:
            raise PretrainedCheckpointError(
                f"{root} is not a complete paxlite checkpoint ({problem}); wait for the copy to "
                "finish or point CHECKPOINT_RESTORE_PATH at another checkpoint_<STEP>")
        return _readable(int(match.group(1)), root)
    for checkpoints in (root / "checkpoints", root):
        if checkpoints.is_dir():
            steps = _step_dirs(checkpoints)
            if steps:
                return _readable(*steps[-1])
    raise PretrainedCheckpointError(
        f"no paxlite checkpoint under {root}: expected "
        f"{root}/checkpoints/checkpoint_<STEP>/{_ITEM}, {root}/checkpoint_<STEP>/{_ITEM}, or a "
        "checkpoint_<STEP> directory itself (python -m paxlite convert writes the first layout)"
    )


def save_params(
    directory: str | os.PathLike,
    params: PyTree,
    *,
    step: int = 0,
    model_config: TransformerConfig | None = None,
) -> epath.Path:
    """Writes `directory/checkpoints/checkpoint_<step>/state` = {"step", "params"}; returns the step
    dir.

    `directory` must be new or empty: nothing a user saved is overwritten. Everything is written
    into `<directory>.partial` and renamed into place at the end (paxlite/paths.py), so a save that
    is killed midway leaves a directory that the next save replaces, not a half-written output. One
    process writes (conversions and exports are single-process).
    """
    with staged_output(directory, setting="output directory") as staging:  # checks it first
        _save_params_into(epath.Path(staging), params, step=step, model_config=model_config)
    return (
        epath.Path(os.path.abspath(os.fspath(directory))) / "checkpoints" / f"checkpoint_{step:08d}"
    )


def save_state(
    directory: str | os.PathLike,
    state: PyTree,
    *,
    step: int,
    model_config: TransformerConfig | None = None,
    copy_items_from: epath.Path | None = None,
) -> epath.Path:
    """`save_params` for a whole saved train state ({"step", "params", "opt_state"?}: what a
    converter that keeps optimizer state writes); the other items of the step directory
    `copy_items_from` (e.g. the input pipeline's state) are copied beside it. Returns the step
    dir."""
    import shutil

    with staged_output(directory, setting="output directory") as staging:
        root = epath.Path(staging)
        _save_state_into(root, state, step=step, model_config=model_config)
        step_dir = root / "checkpoints" / f"checkpoint_{step:08d}"
        if copy_items_from is not None:
            for item in copy_items_from.iterdir():
                if item.is_dir() and item.name != _ITEM and not (step_dir / item.name).exists():
                    shutil.copytree(os.fspath(item), os.fspath(step_dir / item.name))
    return (
        epath.Path(os.path.abspath(os.fspath(directory))) / "checkpoints" / f"checkpoint_{step:08d}"
    )


def read_state(path: str | os.PathLike) -> tuple[int, epath.Path, PyTree]:
    """(step, step directory, the whole saved "state" item as NumPy arrays in its saved
    structure)."""
    step, step_dir = find_checkpoint(path)
    try:
        # Read as NumPy, said per leaf: left to Orbax, it reads the saved `_sharding` file and
        # warns that this is unsafe on another topology (noise: nothing goes to a device here).
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            item_metadata(step_dir / _ITEM))
        state = ocp.PyTreeCheckpointer().restore(
            step_dir / _ITEM, args=ocp.args.PyTreeRestore(restore_args=args))
    except Exception as error:  # TensorStore raises bare Exception; re-raised
        raise _read_failure(step_dir, error) from error
    return step, step_dir, jax.tree.map(np.asarray, state)


def _save_params_into(root: epath.Path, params: PyTree, *, step: int,
                      model_config: TransformerConfig | None) -> None:
    _save_state_into(root, {"params": params}, step=step, model_config=model_config)


def _save_state_into(root: epath.Path, state: PyTree, *, step: int,
                     model_config: TransformerConfig | None) -> None:
    checkpoints = root / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        step_prefix="checkpoint", step_format_fixed_length=8, enable_async_checkpointing=False,
        create=True,
    )
    # Orbax writes jax arrays about twice as fast as NumPy ones (measured: 4.4 s vs 8.2 s for 0.67
    # GB); on the CPU, device_put of a large aligned NumPy array can share its memory rather than
    # copy it.
    state = jax.tree.map(
        lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, dict(state)
    )
    state["step"] = jnp.asarray(step, jnp.int32)
    compat.save_replicas_whole_in_one_process()
    with ocp.CheckpointManager(checkpoints, options=options, item_names=(_ITEM,)) as manager:
        save = ocp.args.StandardSave(state, save_args=checkpoint.layer_chunked_save_args(state))
        manager.save(step, args=ocp.args.Composite(**{_ITEM: save}), force=True)
        manager.wait_until_finished()
    if model_config is not None and jax.process_index() == 0:
        (root / MODEL_CONFIG_FILE).write_text(model_config_to_json(model_config))


def _path_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def saved_param_shapes(path: str | os.PathLike, *, like: PyTree | None = None
                       ) -> tuple[int, epath.Path, dict[str, tuple[int, ...]]]:
    """(step, step directory, {'/'-joined parameter name: shape}) of the checkpoint `path`
    designates.

    A Pax checkpoint (pax_layout.py) has Pax's names; with ``like`` (the model's params tree) each
    model parameter Pax holds is listed under paxlite's name (with the model's shape:
    `restore_params` checks the Pax shapes), and the Pax tensors the model does not use under their
    Pax names."""
    step, step_dir = find_checkpoint(path)
    if pax_layout.is_pax_step(step_dir):
        return step, step_dir, _pax_names(step_dir, like)
    state_dir = step_dir / _ITEM
    try:
        tree = item_metadata(state_dir)
    except Exception as error:  # TensorStore raises bare Exception; re-raised
        raise _read_failure(step_dir, error) from error
    if not isinstance(tree, dict) or "params" not in tree:
        raise PretrainedCheckpointError(f"{state_dir} holds no 'params' (keys: {sorted(tree)})")
    saved = dict(jax.tree_util.tree_flatten_with_path(tree["params"])[0])
    return step, step_dir, {_path_str(p): tuple(leaf.shape) for p, leaf in saved.items()}


def item_metadata(state_dir: epath.Path) -> PyTree:
    """The saved tree of one checkpoint item (leaves: shapes and dtypes; no array read).

    Read through the item's handler, not a Checkpointer: `Checkpointer.metadata` also looks for a
    step-level ``_CHECKPOINT_METADATA`` inside the item directory, where Orbax never writes one (it
    is beside the items), and logs "Metadata file does not exist" for every checkpoint it reads:
    noise about a checkpoint that is whole."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(state_dir)
    finally:
        handler.close()
    return getattr(metadata, "tree", metadata)


def _read_failure(step_dir: epath.Path, error: BaseException) -> Exception:
    """A damaged checkpoint becomes one clear error; anything else keeps its own (with
    traceback)."""
    if not is_damage(error):
        return error
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return PretrainedCheckpointError(
        f"the checkpoint {step_dir} is damaged ({type(error).__name__}: {first}); point "
        "CHECKPOINT_RESTORE_PATH at another checkpoint_<STEP> directory or copy it again")


def restore_params(path: str | os.PathLike, abstract_params: PyTree) -> tuple[int, PyTree]:
    """(step, params) read from the checkpoint at `path` into the structure of `abstract_params`.

    `abstract_params` is a tree of `jax.ShapeDtypeStruct` (with shardings, so each process reads
    only its shards) and may be a subset of the saved params: leaves left out (e.g. LoRA weights a
    base checkpoint does not have, or parameters an ignore rule excludes) are simply not read. Any
    leaf it asks for must exist with the same shape; an error names every one that does not.
    """
    step, step_dir = find_checkpoint(path)
    if pax_layout.is_pax_step(step_dir):
        return step, _restore_pax(step_dir, abstract_params)
    step, step_dir, saved = saved_param_shapes(step_dir)
    state_dir = step_dir / _ITEM
    problems = []
    for p, want in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        name = _path_str(p)
        have = saved.get(name)
        if have is None:
            problems.append(f"  {name}: missing from the checkpoint")
        elif have != tuple(want.shape):
            problems.append(f"  {name}: checkpoint shape {have}, model shape {tuple(want.shape)}")
    if problems:
        raise PretrainedCheckpointError(
            f"the checkpoint {step_dir} does not fit the model ({len(problems)} parameters):\n"
            + "\n".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        )
    # A leaf without a sharding goes to this process's first device (as jnp.asarray would put it):
    # left to Orbax, it reads the saved `_sharding` file and warns that this is unsafe.
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    restore_args = jax.tree.map(
        lambda leaf: ocp.ArrayRestoreArgs(sharding=getattr(leaf, "sharding", None) or local,
                                          global_shape=leaf.shape, dtype=leaf.dtype),
        abstract_params,
    )
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item={"params": abstract_params},
                restore_args={"params": restore_args},
                partial_restore=True,
            ),
        )
    except Exception as error:  # TensorStore raises bare Exception; re-raised
        raise _read_failure(step_dir, error) from error
    return step, restored["params"]


def _leaf_shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    return {_path_str(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _pax_names(step_dir: epath.Path, like: PyTree | None) -> dict[str, tuple[int, ...]]:
    arrays = pax_layout.pax_arrays(step_dir)
    if like is None:
        return {name: a.shape for name, a in arrays.items()}
    leaves = _leaf_shapes(like)
    layout = pax_layout.read_layout(leaves, arrays)
    plans, _ = pax_layout.plan_leaves(leaves, layout)
    out = {leaf: leaves[leaf] for leaf, plan in plans.items()
           if all(n in arrays for layer in plan.pieces for n, _ in layer)}
    used = pax_layout.used_names(plans)
    out.update({name: a.shape for name, a in arrays.items() if name not in used})
    return out


def _restore_pax(step_dir: epath.Path, abstract_params: PyTree, *,
                 reader: pax_layout.BlockReader | None = None) -> PyTree:
    """`restore_params` of a Pax checkpoint: every leaf asked for, mapped from Pax's names (checked
    first, one line naming the Pax tensor) and put on its sharding.

    Only this process's devices' index ranges are read from TensorStore, each distinct range once
    (`pax_layout.BlockReader.shards`: the layer axis sliced too, a region the process's devices
    tile read in one go so that each chunk is decoded once): a process holds its shards, never a
    whole leaf (the stacked qkv of GPT-175B is ~174 GB). ``reader``: for tests counting reads."""
    arrays = pax_layout.pax_arrays(step_dir)
    leaves = _leaf_shapes(abstract_params)
    layout = pax_layout.read_layout(leaves, arrays)
    plans, unknown = pax_layout.plan_leaves(leaves, layout)
    problems = [f"paxlite's {name} has no Pax name" for name in unknown]
    problems += pax_layout.check(arrays, plans, layout)
    if problems:
        raise PretrainedCheckpointError(pax_layout.one_line(step_dir, problems, what="the model"))

    reader = reader or pax_layout.BlockReader(arrays)
    reader.expect(plans)

    def read(path: tuple, leaf: Any) -> jax.Array:
        plan = plans[_path_str(path)]
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            return jnp.asarray(reader.block(plan).astype(leaf.dtype, copy=False))
        shape = tuple(leaf.shape)
        bounds = lambda index: tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        ranges = {bounds(i) for i in sharding.addressable_devices_indices_map(shape).values()}
        blocks = {
            r: b.astype(leaf.dtype, copy=False) for r, b in reader.shards(plan, ranges).items()
        }
        return jax.make_array_from_callback(shape, sharding, lambda index: blocks[bounds(index)])

    return jax.tree_util.tree_map_with_path(read, abstract_params)


def _plain(value: Any) -> Any:
    """JSON-ready: enums as their values, nested configs (``moe``) as objects of their fields."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value.value if hasattr(value, "value") else value


def model_config_to_json(config: TransformerConfig) -> str:
    return json.dumps(_plain(config), indent=2, sort_keys=True) + "\n"


def model_config_from_json(text: str) -> TransformerConfig:
    fields = json.loads(text)
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"model config has unknown fields {unknown}; known: {sorted(known)}")
    return TransformerConfig(**fields)


def load_model_config(directory: str | os.PathLike) -> TransformerConfig | None:
    """The TransformerConfig recorded beside a converted checkpoint, or None if there is none."""
    path = epath.Path(os.fspath(directory)) / MODEL_CONFIG_FILE
    return model_config_from_json(path.read_text()) if path.exists() else None


def ignored_by(rules: Sequence[str], path: str) -> bool:
    """Whether a '/'-joined parameter path matches one of CHECKPOINT_IGNORE_RULES.

    As Pax: `re.match` (anchored at the start, not the end), and a rule may be written with Pax's
    '.' separator or paxlite's '/': each rule is tried on both spellings of the path.
    """
    dotted = path.replace("/", ".")
    return any(re.match(rule, path) or re.match(rule, dotted) for rule in rules)


def restore_plan(abstract_params, *, rules: Sequence[str], path: str) -> tuple[dict, list[str]]:
    """({name: abstract leaf} to read from `path`, [names left at their initialisation])."""
    flat = traverse_util.flatten_dict(abstract_params, sep="/")
    ignored = sorted(name for name in flat if ignored_by(rules, name))
    wanted = {name: leaf for name, leaf in flat.items() if name not in ignored}
    if not wanted:
        raise SettingError(
            f"CHECKPOINT_IGNORE_RULES={list(rules)} exclude every parameter, so nothing "
            f"would be read from CHECKPOINT_RESTORE_PATH={path}"
        )
    return wanted, ignored


def unread_checkpoint_params(abstract_params, *, rules: Sequence[str], path: str) -> list[str]:
    """Checkpoint parameters this model lacks, each one matched by an ignore rule (else an error).

    A 24-layer checkpoint must not quietly initialise a 12-layer model: parameters left unread
    are named, and allowed only where CHECKPOINT_IGNORE_RULES match them (Pax's opt-in).
    """
    model = traverse_util.flatten_dict(abstract_params, sep="/")
    _, step_dir, saved = saved_param_shapes(path, like=abstract_params)
    extra = sorted(set(saved) - set(model))
    unmatched = [name for name in extra if not ignored_by(rules, name)]
    if unmatched:
        shown = "\n".join(f"  {name} {saved[name]}" for name in unmatched[:20])
        raise PretrainedCheckpointError(
            f"the checkpoint {step_dir} holds {len(unmatched)} parameters this model does not "
            f"have (another number of layers or another model?):\n{shown}"
            + ("\n  ..." if len(unmatched) > 20 else "")
            + "\nUse the model the checkpoint was made for, or leave them unread on purpose "
            "with a CHECKPOINT_IGNORE_RULES regex matching them "
            f"(e.g. --fdl.CHECKPOINT_IGNORE_RULES=\"['{re.escape(unmatched[0])}']\")")
    return extra
