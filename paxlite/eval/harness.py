"""The model side of lm-evaluation-harness: log-likelihoods and greedy continuations of token rows,
computed by paxlite's own Transformer on the experiment's mesh, by every process at once.

lm_eval itself (tasks, prompts, metrics) runs on process 0 only (harness_lm.py, the one module
that imports it). Each batch of work it asks for is sent from process 0 to all the others with
`decided_by_process_0` (two small broadcasts of JSON), and every process then runs the same jitted
program on the same global arrays, so a model sharded over several hosts scores as one. Followers
loop on those messages (`ModelRunner.follow`) until process 0 sends DONE.

Scoring batches are right-padded: a row's real tokens form segment 1 and its padding segment 0, so
attention never mixes them (causal and same-segment) and MoE routing leaves padding out of the
experts' capacity; positions count from 0 in every row. A row's scores are therefore those of the
row run alone. Rows are made a multiple of the mesh's batch split, and lengths are rounded up to a
bucket (powers of two, capped at MAX_SEQ_LEN), so one program compiles per (rows, bucket).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from paxlite.errors import SettingError
from paxlite.models.decode import decoding_config, generate, named_sharding
from paxlite.models.transformer import Transformer, TransformerConfig
from paxlite.parallel.mesh import BATCH_AXES
from paxlite.parallel.multihost import decided_by_process_0
from paxlite.parallel.rules import DEFAULT_RULES

PyTree = Any
SMALLEST_BUCKET = 16


class Request(str, enum.Enum):
    """What process 0 asks every process to compute next."""

    SCORE = "score"
    GENERATE = "generate"
    DONE = "done"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scored:
    """One row's score: the summed log-probability of its last `n` tokens, and whether each of
    them is the model's argmax (lm_eval's ``is_greedy``)."""

    logprob: float
    is_greedy: bool


def length_bucket(length: int, *, max_len: int) -> int:
    """The padded length of a batch whose longest row has `length` tokens."""
    return min(max_len, max(SMALLEST_BUCKET, 1 << max(length - 1, 0).bit_length()))


def scoring_config(config: TransformerConfig) -> TransformerConfig:
    """The model the harness runs: the trained parameters, no FP8 state, no remat, no pipeline
    schedule (the pipelined stack reads the same parameters as the plain one)."""
    config = decoding_config(config)
    changes = {}
    if getattr(config, "pipeline", None) is not None:
        changes["pipeline"] = None
    return dataclasses.replace(config, **changes) if changes else config


class ModelRunner:
    """Runs one model for the harness; the same object exists on every process.

    Process 0 calls `loglikelihoods`, `generate` and finally `finish`; every other process calls
    `follow`, which computes what process 0 asks for until it says DONE.
    """

    def __init__(self, *, model_config: TransformerConfig, params: PyTree, mesh=None,
                 rules: Sequence | None = None, batch_size: int = 8,
                 vocab_limit: int | None = None, eos_id: int | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        if batch_size < 1:
            raise SettingError(f"--batch_size={batch_size} must be at least 1")
        self.config = scoring_config(model_config)
        self.params = params
        self.mesh = mesh
        self.rules = tuple(DEFAULT_RULES if rules is None else rules)
        self.max_len = int(self.config.max_seq_len)
        split = 1 if mesh is None else math.prod(
            mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)
        self.batch_multiple = split
        self.batch_size = -(-batch_size // split) * split  # rounded up to a multiple of the split
        self.vocab_limit = vocab_limit
        self.eos_id = eos_id
        self.decode = decode  # ids -> text, for `until` strings; the same on every process
        self._score_fn = self._make_score_fn()
        self.compiled_shapes: set[tuple[int, int]] = set()  # (rows, bucket) scored so far

    # -- process 0 -------------------------------------------------------------------------

    def loglikelihoods(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[Scored]:
        """rows: (tokens, n) with 2 <= len(tokens) <= MAX_SEQ_LEN + 1 and 1 <= n < len(tokens):
        the model reads tokens[:-1] and the last n of tokens[1:] are scored. Longest rows first,
        in batches of `batch_size`; the results in the order given."""
        for tokens, n in rows:
            if not 1 <= n < len(tokens) <= self.max_len + 1:
                raise ValueError(f"a row of {len(tokens)} tokens scoring {n} does not fit "
                                 f"MAX_SEQ_LEN={self.max_len}")
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[Scored | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            batch = [[int(t) for t in rows[i][0]] for i in chunk]
            scores = self._exchange({"request": Request.SCORE.value, "rows": batch,
                                     "n": [int(rows[i][1]) for i in chunk]})
            for i, scored in zip(chunk, scores, strict=True):
                out[i] = scored
        return out  # type: ignore[return-value]

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 until: Sequence[str] = ()) -> list[list[int]]:
        """Greedy continuations (KV-cache decoding), each ending at the EOS id if it comes, or
        once its text holds one of `until` (with `decode`); in batches of `batch_size`, longest
        prompts first; the results in the order given. Prompts are left-padded to a length bucket
        (powers of two), so a task compiles one program per bucket, not one per prompt length."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int] | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            ids = self._exchange({"request": Request.GENERATE.value,
                                  "prompts": [[int(t) for t in prompts[i]] for i in chunk],
                                  "max_new_tokens": int(max_new_tokens),
                                  "until": [str(u) for u in until]})
            for i, row in zip(chunk, ids, strict=True):
                out[i] = row
        return out  # type: ignore[return-value]

    def finish(self) -> None:
        """Tells the other processes that there is nothing more to compute."""
        if jax.process_count() > 1:
            decided_by_process_0(
                lambda: {"request": Request.DONE.value}, what="end the lm_eval run"
            )

    # -- every other process ---------------------------------------------------------------

    def follow(self) -> None:
        """Computes what process 0 asks for, until it says DONE."""
        while True:
            message = decided_by_process_0(lambda: None, what="send the next lm_eval batch")
            if message["request"] == Request.DONE.value:
                return
            self._compute(message)

    # -- all processes ---------------------------------------------------------------------

    def _exchange(self, message: dict) -> Any:
        if jax.process_count() > 1:
            message = decided_by_process_0(lambda: message, what="send the next lm_eval batch")
        return self._compute(message)

    def _compute(self, message: dict) -> Any:
        with self._context():
            if message["request"] == Request.SCORE.value:
                return self._score(message["rows"], message["n"])
            if message["request"] == Request.GENERATE.value:
                new = message["max_new_tokens"]
                longest = max(len(p) for p in message["prompts"])
                return generate(self.config, self.params, message["prompts"],
                                max_new_tokens=new, eos_id=self.eos_id,
                                vocab_limit=self.vocab_limit, batch_multiple=self.batch_multiple,
                                prompt_length=length_bucket(longest, max_len=self.max_len - new),
                                stop=self._stop(message.get("until", ())))
        raise ValueError(f"unknown harness request {message['request']!r}")

    def _stop(self, until: Sequence[str]) -> Callable[[list[int]], bool] | None:
        """Ends a row once its text holds an `until` string: lm_eval cuts the text there anyway
        (the text before it is a prefix of any longer decode), so the rest need not be generated."""
        if not until or self.decode is None:
            return None
        decode = self.decode
        return lambda ids: any(u in decode(ids) for u in until)

    def _context(self):
        stack = contextlib.ExitStack()
        if self.mesh is not None:
            stack.enter_context(jax.set_mesh(self.mesh))
            stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def _score(self, rows: list[list[int]], n: list[int]) -> list[Scored]:
        count = len(rows)
        padded_rows = -(-count // self.batch_multiple) * self.batch_multiple
        bucket = length_bucket(max(len(r) - 1 for r in rows), max_len=self.max_len)
        inputs = np.zeros((padded_rows, bucket), np.int32)
        targets = np.zeros((padded_rows, bucket), np.int32)
        segments = np.zeros((padded_rows, bucket), np.int32)  # 1: the row's tokens, 0: padding
        for i, row in enumerate(rows):
            inputs[i, :len(row) - 1] = row[:-1]
            targets[i, :len(row) - 1] = row[1:]
            segments[i, :len(row) - 1] = 1
        self.compiled_shapes.add((padded_rows, bucket))
        logprob, greedy = self._score_fn(self.params, *(self._put(a) for a in
                                                        (inputs, targets, segments)))
        logprob, greedy = np.asarray(logprob, np.float64), np.asarray(greedy)
        out = []
        for i, row in enumerate(rows):
            end = len(row) - 1
            picked = slice(end - n[i], end)
            out.append(Scored(logprob=float(logprob[i, picked].sum()),
                              is_greedy=bool(greedy[i, picked].all())))
        return out

    def _put(self, value: np.ndarray) -> jax.Array:
        """A host array every process holds alike, as one global array sharded like training's
        token batches (each process places only its own devices' parts)."""
        if self.mesh is None:
            return jnp.asarray(value)
        sharding = named_sharding(self.mesh, PartitionSpec("activation_batch", "activation_length"),
                                  self.rules)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def _make_score_fn(self):
        model = Transformer(self.config)

        def score(params, inputs, targets, segments):
            """inputs, targets, segments int32 [B, T] -> the log-probability of each target and
            whether it is the argmax, f32 [B, T] and bool [B, T]."""
            logits = model.apply({"params": params}, inputs, segment_ids=segments)  # [B, T, V]
            logits = logits.astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return target_logp, jnp.argmax(logits, axis=-1) == targets

        if self.mesh is None:
            return jax.jit(score)
        replicated = NamedSharding(self.mesh, PartitionSpec())  # every process reads all rows
        return jax.jit(score, out_shardings=(replicated, replicated))


def flatten_results(results: dict) -> dict[str, float]:
    """lm_eval's per-task results as flat ``{"<task>/<metric>": value}``.

    lm_eval keys a metric ``"<metric>,<filter>"``: the filter ``none`` (log-likelihood tasks, and
    generation tasks without a filter) is dropped (``acc,none`` -> ``acc``); any other is appended
    (``exact_match,strict-match`` -> ``exact_match_strict-match``). Standard errors and
    non-numeric entries (aliases, "N/A") are left out.
    """
    flat: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or isinstance(value, bool):
                continue
            if not isinstance(value, int | float):
                continue
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            flat[f"{task}/{name}"] = float(value)
    return flat


def score_tasks(*, model_config: TransformerConfig, params: PyTree, mesh, tokenizer,
                bos_id: int | None, tasks: Sequence[str], num_fewshot: int | None = None,
                limit: float | None = None, include_path: str | None = None,
                batch_size: int = 8, rules: Sequence | None = None) -> dict[str, float]:
    """Scores lm_eval tasks with a live model: ``{"<task>/<metric>": value}`` on process 0
    (see `flatten_results`), {} on the others. Call it from every process at the same point (a
    collective); the train loop calls it at eval boundaries (LM_EVAL_TASKS).

    tokenizer: paxlite's SentencePiece Tokenizer (encode/decode/bos_id/eos_id/vocab_size).
    bos_id: the id text starts with (model_source.bos_id's answer), or None.
    No standard errors are computed (bootstrap_iters=0): they cost time and a training curve
    does not need them.
    """
    from paxlite.eval.harness_lm import evaluate

    runner = ModelRunner(model_config=model_config, params=params, mesh=mesh, rules=rules,
                         batch_size=batch_size,
                         eos_id=tokenizer.eos_id if tokenizer.eos_id >= 0 else None,
                         decode=tokenizer.decode)
    results = evaluate(runner=runner, tokenizer=tokenizer, bos_id=bos_id, tasks=list(tasks),
                       num_fewshot=num_fewshot, limit=limit, include_path=include_path,
                       bootstrap_iters=0)
    return {} if results is None else flatten_results(results)
