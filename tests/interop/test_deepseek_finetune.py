"""A tiny DeepSeek-V3 that transformers writes (low-rank query, grouped sigmoid routing with a
nonzero choice bias, a shared expert, a dense first layer), with a tokenizer.json beside it,
converted once by `python -m paxlite convert` for the module: `generate --prompt=TEXT` continues as
transformers' tokenizer and greedy generate do; `FineTune` from the converted directory trains a
few steps on a data x fsdp x tensor mesh with the router's choice bias unchanged (speed 0, the
default) and the rest moving; LoRA trains only its adapters (the base, the bias included, stays as
converted); `plan --fdl_config=FineTune` gives a verdict.

Plain RoPE: FineTune reads a YaRN checkpoint's own scaling fields once RopeScalingSettings knows
'yarn' (the gpt-oss work); YaRN itself is tested against transformers in test_hf_deepseek.py."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from paxlite.__main__ import main
from paxlite.checkpointing.pretrained import (
    load_model_config,
    restore_params,
    saved_param_shapes,
)
from paxlite.experiments.build import build_run_config
from paxlite.interop import hf
from paxlite.train.loop import Run, RunContext
from tests.interop.test_hf_deepseek import CASES, SIZES
from tests.interop.test_tokenizer_json_generate import NEW, TEXTS, _tokenizer_json

STEPS = 3
BIAS = "score_correction_bias"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its directory, the converted paxlite directory)."""
    pytest.importorskip("tokenizers")
    import torch
    import transformers

    root = tmp_path_factory.mktemp("deepseek_v3")
    torch.manual_seed(0)
    config_class, fields = CASES["v3"]
    fields = {k: v for k, v in fields.items() if k != "rope_parameters"}  # plain RoPE (docstring)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**SIZES, **fields), attn_implementation="eager").eval()
    with torch.no_grad():  # a choice bias that changes which experts are chosen
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(root / "hf")
    _tokenizer_json(root / "hf")
    out = root / "paxlite"
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={root / 'hf'}",
                 f"--output={out}"]) == 0
    return model, root / "hf", out


def _flat(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(params)}


def test_generate_through_the_tokenizer_json_matches_transformers(converted, capsys):
    import torch
    from transformers import AutoTokenizer

    model, hf_dir, out = converted
    capsys.readouterr()
    assert main(["generate", f"--checkpoint={out}", *[f"--prompt={t}" for t in TEXTS],
                 f"--max_new_tokens={NEW}", "--format=json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    for record, text in zip(records, TEXTS, strict=True):
        ids = theirs(text)["input_ids"]
        assert record["prompt_ids"] == ids and ids[0] == theirs.bos_token_id
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                  eos_token_id=theirs.eos_token_id,
                                  pad_token_id=theirs.eos_token_id)
        assert record["ids"] == want[0, len(ids):].tolist()


def _finetune(converted_dir, job, *extra: str):
    overrides = [f"CHECKPOINT_RESTORE_PATH={converted_dir}", "SYNTHETIC_DATA=true",
                 f"MAX_STEPS={STEPS}", "MAX_SEQ_LEN=16", "PERCORE_BATCH_SIZE=1",
                 "ICI_MESH_SHAPE=[2,2,2]", "SUMMARY_INTERVAL_STEPS=1", "LEARNING_RATE=1e-3",
                 f"CHECKPOINT_EVERY_N_STEPS={STEPS}", "EVAL_INTERVAL_STEPS=1000", *extra]
    with Run(build_run_config("FineTune", overrides)[1], RunContext(job_dir=str(job))) as run:
        run.train()
    losses = [json.loads(line).get("loss") for line in
              (job / "metrics.jsonl").read_text().splitlines()]
    losses = [loss for loss in losses if loss is not None]
    assert len(losses) == STEPS and all(np.isfinite(losses)), losses
    start = hf.from_paxlite(converted_dir, config=load_model_config(converted_dir)).params
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), start)
    _, trained = restore_params(job / "checkpoints", abstract)  # the base (LoRA's left out)
    return _flat(start), _flat(trained)


def test_finetune_trains_and_keeps_the_router_bias(converted, tmp_path):
    _, _, out = converted
    before, after = _finetune(out, tmp_path / "job")
    biases = [name for name in before if BIAS in name]
    assert biases  # the MoE layers' choice biases
    for name in biases:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    moved = [name for name in before if np.max(np.abs(after[name] - before[name])) > 0]
    assert any("router" in n for n in moved) and any("kv_b" in n or "value_b" in n or "key_b" in n
                                                      for n in moved), moved


def test_lora_trains_only_its_adapters(converted, tmp_path):
    _, _, out = converted
    job = tmp_path / "job"
    before, after = _finetune(out, job, "USE_LORA=true", "LORA_RANK=4",
                              "LORA_TARGET_LAYERS=attention")
    for name, value in before.items():  # the base, the choice biases included
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    _, _, shapes = saved_param_shapes(job / "checkpoints")
    assert any("lora" in name for name in shapes), sorted(shapes)[:5]


def test_plan_gives_a_verdict(converted, capsys):
    _, _, out = converted
    capsys.readouterr()
    code = main(["plan", "--fdl_config=FineTune", f"--fdl.CHECKPOINT_RESTORE_PATH={out}",
                 "--devices=8", "--fdl.MAX_SEQ_LEN=16"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "fits" in printed.out or "does not fit" in printed.out, printed.out
