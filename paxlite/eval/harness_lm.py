"""paxlite's model for lm-evaluation-harness (``lm_eval``), and lm_eval's own evaluation around it.

The one module that imports lm_eval (the `eval` extra; pyproject.toml's import contract keeps it
so), and only inside functions: importing paxlite never loads it, and without the extra the first
use is one error naming ``pip install -e '.[eval]'``.

The LM reads text as lm_eval's own ``hf`` model (HFLM) reads it, so that the numbers are the ones
users compare with, and does the arithmetic on paxlite's Transformer (harness.ModelRunner):
- It is a ``TemplateLM``: lm_eval's own code splits a (context, continuation) pair (trailing spaces
  of the context move to the continuation; whole = enc(context + continuation), continuation =
  whole[len(enc(context)):]) and gives an empty context the prefix token.
- BOS: text is encoded with the BOS id first exactly when `bos_id` is given (HFLM's
  ``add_bos_token``), except where lm_eval asks for no special tokens. The prefix token is the
  tokenizer's BOS, else its EOS, whatever `bos_id` says (as HFLM's ``prefix_token_id``).
- Longer than MAX_SEQ_LEN: a pair keeps its last MAX_SEQ_LEN + 1 tokens; rolling log-likelihoods
  run over lm_eval's own windows (``get_rolling_token_windows`` / ``make_disjoint_window``, context
  1, at MAX_SEQ_LEN); a generation's context keeps its last MAX_SEQ_LEN - max_gen_toks tokens.
- Generation is greedy (KV-cache decoding), max_gen_toks tokens or to EOS, then cut at the first
  ``until`` string; only ids the tokenizer can decode are generated.
- Chat templates (`--apply_chat_template`): lm_eval's chat histories are rendered with the
  tokenizer's template as HFLM renders them (transformers' apply_chat_template, the last message
  continued where no generation prompt is asked for; a template that refuses a system message is
  rendered again without it), then read as any text (a template that writes the BOS text gets no
  second BOS).
lm_eval sees one process (rank 0, world size 1): the other processes compute the same batches
through the runner, so lm_eval never splits the requests itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from paxlite.errors import SettingError, UserError

EVAL_EXTRA = "pip install -e '.[eval]'"
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's default


class MissingExtraError(UserError, ImportError):
    """lm_eval is not installed."""


def import_lm_eval():
    """The lm_eval package, or one error saying how to install it."""
    try:
        import lm_eval
        import lm_eval.api.model
    except ImportError as e:
        raise MissingExtraError(
            f"lm-evaluation-harness is not installed ({e}); install paxlite's eval extra: "
            f"{EVAL_EXTRA}") from None
    return lm_eval


def task_manager(include_path: str | None, tasks: list[str]):
    """lm_eval's TaskManager that knows every task in `tasks`; an unknown name is one error with
    lm_eval's closest names. Only the include_path is indexed when it holds all of them (lm_eval's
    own index of thousands of tasks takes seconds to build)."""
    import difflib

    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not _missing(local, tasks):
            return local
    manager = _full_index(include_path)
    missing = _missing(manager, tasks)
    if missing:
        close = difflib.get_close_matches(missing[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        where = "lm_eval's tasks" + ("" if include_path is None else f" or {include_path}")
        raise SettingError(f"--tasks: {missing[0]!r} is not a task in {where}{hint}; "
                           "`lm_eval ls tasks` lists them")
    return manager


@functools.cache
def _full_index(include_path: str | None):
    """lm_eval's TaskManager over its own tasks (and include_path's), built once per process and
    include path: its index of thousands of task files took ~8 CPU-s, which a training run with an
    lm_eval interval paid at every scoring. The task files are read when the index is built: one
    edited during the run is read by the next process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _missing(manager, tasks: list[str]) -> list[str]:
    found = set(manager.match_tasks(tasks))
    return [t for t in tasks if t not in found]


@functools.cache
def lm_class() -> type:
    """The LM subclass (built on first use, so that importing this module imports no lm_eval)."""
    import_lm_eval()
    from lm_eval import utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )

    class PaxliteLM(TemplateLM):
        """A paxlite model, scored as lm_eval's ``hf`` model scores a transformers one."""

        backend = "causal"

        def __init__(self, *, runner, tokenizer, bos_id: int | None, chat=None):
            super().__init__()
            self.runner = runner
            self.paxlite_tokenizer = tokenizer
            self.bos_id = bos_id
            self.chat = chat  # data/chat_template.py's ChatTemplate, for --apply_chat_template

        def apply_chat_template(self, chat_history: list[dict[str, str]],
                                add_generation_prompt: bool = True) -> str:
            if self.chat is None:
                raise SettingError("--apply_chat_template: this model's tokenizer has no chat "
                                   "template (chat_template.jinja or tokenizer_config.json)")
            where = "lm_eval's chat history"
            try:
                return self.chat.render(chat_history, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=not add_generation_prompt,
                                        where=where)
            except UserError:  # the template refused it (HFLM's fallback: no system messages)
                history = [m for m in chat_history if m.get("role") != "system"]
                return self.chat.render(history, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=not add_generation_prompt,
                                        where=where)

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return self.chat.text if chat_template and self.chat is not None else None

        @property
        def eot_token_id(self) -> int:
            eos = self.paxlite_tokenizer.eos_id
            if eos is None or eos < 0:
                raise SettingError(f"the tokenizer {self.paxlite_tokenizer.path} defines no EOS "
                                   "piece, which lm_eval needs (its end-of-text token)")
            return eos

        @property
        def prefix_token_id(self) -> int:
            bos = self.paxlite_tokenizer.bos_id
            return self.eot_token_id if bos is None else bos

        @property
        def max_length(self) -> int:
            return self.runner.max_len

        @property
        def max_gen_toks(self) -> int:
            return DEFAULT_MAX_GEN_TOKS

        @property
        def batch_size(self) -> int:
            return self.runner.batch_size

        @property
        def tokenizer_name(self) -> str:
            return self.paxlite_tokenizer.path.replace("/", "__")

        def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                       **kwargs) -> list[int]:
            ids = self.paxlite_tokenizer.encode(string)
            add = self.bos_id is not None and add_special_tokens is not False
            if add_special_tokens is None and self._starts_with_prefix(string):
                add = False  # the text carries its BOS already (HFLM's has_bos_prefix)
            return [self.bos_id, *ids] if add else ids

        def _starts_with_prefix(self, string: str) -> bool:
            piece = self.paxlite_tokenizer.id_to_piece(self.prefix_token_id)
            return bool(piece) and string.startswith(piece)

        def tok_decode(self, ids: list[int]) -> str:
            special = {self.paxlite_tokenizer.eos_id, self.paxlite_tokenizer.bos_id}
            return self.paxlite_tokenizer.decode([i for i in ids if i not in special])

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                                  **kwargs) -> list[tuple[float, bool]]:
            rows = []
            for key, context, continuation in requests:
                if not continuation:
                    raise SettingError(f"lm_eval asked to score an empty continuation of {key!r}")
                if len(continuation) > self.max_length:
                    raise SettingError(
                        f"a continuation of {len(continuation)} tokens is longer than the "
                        f"model's MAX_SEQ_LEN={self.max_length}; it cannot be scored")
                rows.append(((context + continuation)[-(self.max_length + 1):],
                             len(continuation)))
            scored = self.runner.loglikelihoods(rows)
            answers = [(s.logprob, s.is_greedy) for s in scored]
            for (key, _, _), answer in zip(requests, answers, strict=True):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return answers

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owners = [], []
            for index, (string,) in enumerate(req.args for req in requests):
                for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                    windows.append((None, *window))
                    owners.append(index)
            totals = [0.0] * len(requests)
            for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows),
                                           strict=True):
                totals[owner] += logprob
            for req, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            groups: dict[str, list[int]] = {}  # one decode setting per group, as HFLM batches
            for index, req in enumerate(requests):
                groups.setdefault(repr(sorted(req.args[1].items())), []).append(index)
            out: list[str | None] = [None] * len(requests)
            eos_text = self.paxlite_tokenizer.id_to_piece(self.eot_token_id)
            for indices in groups.values():
                gen_kwargs = requests[indices[0]].args[1]
                kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
                if kwargs.get("do_sample"):
                    raise SettingError(
                        f"task {requests[indices[0]].task_name!r} samples (do_sample=True, "
                        f"{gen_kwargs}); paxlite's lm_eval model decodes greedily only")
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
                new = int(kwargs.pop("max_gen_toks"))
                room = self.max_length - new
                if room <= 0:
                    raise SettingError(f"max_gen_toks={new} leaves no room for a context in the "
                                       f"model's MAX_SEQ_LEN={self.max_length}")
                prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in indices]
                generated = self.runner.generate(prompts, max_new_tokens=new, until=until)
                for i, ids in zip(indices, generated, strict=True):
                    text = postprocess_generated_text(self.tok_decode(ids), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
            return out  # type: ignore[return-value]

    return PaxliteLM


def make_lm(*, runner, tokenizer, bos_id: int | None, chat=None) -> Any:
    """paxlite's lm_eval LM over `runner` (harness.ModelRunner); `chat`: the chat template
    (data/chat_template.py) lm_eval's --apply_chat_template renders with."""
    return lm_class()(runner=runner, tokenizer=tokenizer, bos_id=bos_id, chat=chat)


def results_tables(results: dict) -> str:
    """lm_eval's own Markdown table of the results (and of the groups, when there are any)."""
    from lm_eval.utils import make_table

    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


def results_json(results: dict) -> str:
    """The results dict as lm_eval's own command line writes it (its encoder for what JSON
    lacks)."""
    import json

    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def evaluate(*, runner, tokenizer, bos_id: int | None, tasks: list[str],
             num_fewshot: int | None = None, limit: float | None = None,
             include_path: str | None = None, log_samples: bool = False,
             bootstrap_iters: int = 100000, manager=None, gen_kwargs: str | None = None,
             random_seed: int | None = 0, numpy_random_seed: int | None = 1234,
             fewshot_random_seed: int | None = 1234, chat=None,
             apply_chat_template: bool | str = False, system_instruction: str | None = None,
             fewshot_as_multiturn: bool | None = None) -> dict | None:
    """lm_eval's ``simple_evaluate`` of paxlite's model: its results dict on process 0, None on
    the others (which compute the same batches until process 0 is done). Every process calls it.
    The seeds, `gen_kwargs`, `apply_chat_template` (True or a template's name),
    `system_instruction` and `fewshot_as_multiturn` are simple_evaluate's (its defaults: the seeds
    of lm_eval's CLI; few-shot examples as turns of the chat exactly when a template is
    applied, as lm_eval's CLI decides); `chat`: the template to apply."""
    import jax

    if jax.process_index() != 0:
        runner.follow()
        return None
    try:
        import_lm_eval()
        from lm_eval.evaluator import simple_evaluate

        if manager is None:
            manager = task_manager(include_path, tasks)
        with _environment_of_this_process():
            return simple_evaluate(
                model=make_lm(runner=runner, tokenizer=tokenizer, bos_id=bos_id, chat=chat),
                tasks=tasks, apply_chat_template=apply_chat_template,
                system_instruction=system_instruction,
                fewshot_as_multiturn=(bool(apply_chat_template) if fewshot_as_multiturn is None
                                      else fewshot_as_multiturn),
                num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                batch_size=runner.batch_size, gen_kwargs=gen_kwargs, random_seed=random_seed,
                numpy_random_seed=numpy_random_seed, fewshot_random_seed=fewshot_random_seed,
                torch_random_seed=None)  # no torch here: its seed would import it
    finally:
        runner.finish()


@contextlib.contextmanager
def _environment_of_this_process() -> Iterator[None]:
    """simple_evaluate's results describe the environment (``pretty_env_info``) with torch's
    collector: where torch is installed (the `hf` extra) that imports torch and transformers and
    runs torch's probes, ~3 s and hundreds of MB at every evaluation, during training at every
    LM_EVAL interval, in a process that never computes with torch. While paxlite evaluates, the
    same keys are filled without importing either: ``pretty_env_info`` is JAX's report of the
    runtime that computed the scores, the versions come from the installed packages' metadata, the
    commit is lm_eval's own reading."""
    import importlib.metadata
    import os
    import pathlib

    import jax
    import lm_eval.evaluator as lm_eval_evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "N/A"

    def add_env_info(storage: dict[str, Any]) -> None:
        storage.update({
            "pretty_env_info": jax.print_environment_info(return_string=True),
            "transformers_version": version("transformers"),
            "lm_eval_version": version("lm_eval"),
            "upper_git_hash": get_commit_from_path(pathlib.Path(os.getcwd(), "..")),
        })

    original = lm_eval_evaluator.add_env_info
    lm_eval_evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        lm_eval_evaluator.add_env_info = original
