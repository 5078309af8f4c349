"""lm_eval with `--apply_chat_template`: paxlite's LM against lm_eval's own `hf` model (HFLM).

The tiny chat model of test_chat_sft.py (a transformers LLaMA, a byte-level BPE tokenizer with a
ChatML-style template), scored by HFLM on its transformers directory and by paxlite's LM on the
converted checkpoint, both with the chat template applied, a system instruction and one few-shot
example as a turn of the chat: every per-sample log-likelihood agrees to 1e-4 and every generated
string is the same. Then the command line, and the one-line refusals.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest

pytest.importorskip("transformers")

from paxlite.__main__ import main
from tests.eval.test_lm_eval import TASKS_DIR
from tests.train.test_chat_sft import make_chat_model

TASKS = ["paxlite_mc", "paxlite_gen"]
SYSTEM = "answer briefly"
MAX_LEN = 64  # the chat model's max_position_embeddings


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(tokenizer dir, converted paxlite dir with the tokenizer, transformers dir)."""
    import shutil

    root = tmp_path_factory.mktemp("lm_eval_chat")
    tokenizer, _, _ = make_chat_model(root)
    shutil.copytree(tokenizer, root / "hf", dirs_exist_ok=True)  # one HF directory, as published
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={root / 'hf'}",
                 f"--output={root / 'pax'}"]) == 0
    return tokenizer, str(root / "pax"), str(root / "hf")


@pytest.fixture(autouse=True)
def _in_tasks_dir(monkeypatch):
    monkeypatch.chdir(TASKS_DIR)  # the task YAMLs name their data relative to it


def _hf(model):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tokenizer, _, hf_dir = model
    lm = HFLM(pretrained=hf_dir, tokenizer=tokenizer, max_length=MAX_LEN, batch_size=4,
              device="cpu", add_bos_token=False)
    return simple_evaluate(model=lm, tasks=TASKS, num_fewshot=1, log_samples=True,
                           bootstrap_iters=0, apply_chat_template=True,
                           system_instruction=SYSTEM, fewshot_as_multiturn=True,
                           task_manager=TaskManager(include_path=str(TASKS_DIR),
                                                    include_defaults=False))


def _paxlite(model):
    import argparse

    from paxlite.cli import model_source
    from paxlite.data.chat_template import chat_template_for
    from paxlite.eval.harness import ModelRunner
    from paxlite.eval.harness_lm import evaluate

    _, pax, _ = model
    source = model_source.resolve_model(
        argparse.Namespace(checkpoint=pax, job_log_dir=None, fdl_config=None), [])
    tokenizer = model_source.load_tokenizer(source)
    runner = ModelRunner(model_config=source.config,
                         params=model_source.restore_params(source, None), mesh=None,
                         batch_size=4,
                         eos_id=tokenizer.eos_id, decode=tokenizer.decode)
    return evaluate(runner=runner, tokenizer=tokenizer, bos_id=None, tasks=TASKS, num_fewshot=1,
                    include_path=str(TASKS_DIR), log_samples=True, bootstrap_iters=0,
                    chat=chat_template_for(tokenizer), apply_chat_template=True,
                    system_instruction=SYSTEM)


def test_scores_equal_lm_evals_own_hf_model_with_the_chat_template(model):
    import numpy as np

    ours, theirs = _paxlite(model), _hf(model)
    for task in TASKS:
        mine = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        want = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert len(mine) == len(want) > 0
        for a, b in zip(mine, want, strict=True):
            # the same prompt text: the system turn, the few-shot turn, the template's markers
            assert a["arguments"] == b["arguments"]
            prompt = a["arguments"][0][0]  # the first request's context
            assert prompt.startswith("<|im_start|>s\n" + SYSTEM) and prompt.count("<|im_start|>u")
            if task == "paxlite_gen":
                assert [r[0] for r in a["resps"]] == [r[0] for r in b["resps"]]
            else:
                np.testing.assert_allclose([r[0][0] for r in a["resps"]],
                                           [r[0][0] for r in b["resps"]], atol=1e-4)
        assert ours["results"][task] == pytest.approx(theirs["results"][task], abs=1e-6)


def test_the_command_line_applies_the_template(model, capsys):
    _, pax, _ = model
    code = main(["lm_eval", f"--checkpoint={pax}",
                 "--tasks=paxlite_mc", f"--include_path={TASKS_DIR}", "--limit=2",
                 "--apply_chat_template", "--bootstrap_iters=0"])
    assert code == 0
    assert "paxlite_mc" in capsys.readouterr().out


def test_refusals_are_one_line(model, capsys):
    _, pax, _ = model
    code = main(["lm_eval", f"--checkpoint={pax}",
                 "--tasks=paxlite_mc", f"--include_path={TASKS_DIR}", "--fewshot_as_multiturn"])
    assert code == 2
    assert "--fewshot_as_multiturn needs --apply_chat_template" in capsys.readouterr().err
    code = main(["lm_eval", f"--checkpoint={pax}",
                 "--tasks=paxlite_mc", f"--include_path={TASKS_DIR}",
                 "--apply_chat_template=tool_use"])
    assert code == 2
    assert "tool_use" in capsys.readouterr().err
