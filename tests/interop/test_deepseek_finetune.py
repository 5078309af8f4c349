"""A tiny DeepSeek-V3 that transformers writes (low-rank query, grouped sigmoid routing with a
nonzero choice bias, a shared expert, a dense first layer), with a tokenizer.json beside it,
converted once by `python -m paxlite convert` for the module: `generate --prompt=TEXT` continues as
transformers' tokenizer and greedy generate do; `FineTune` from the converted directory trains a
step on a data x fsdp x tensor mesh with the router's choice bias unchanged (speed 0, the default)
and the rest moving; LoRA trains only its adapters (the base, the bias included, stays as
converted; its checkpoint holds them); `plan --fdl_config=FineTune` gives a verdict.

Plain RoPE: FineTune reads a YaRN checkpoint's own scaling fields once RopeScalingSettings knows
'yarn' (the gpt-oss work); YaRN itself is tested against transformers in test_hf_deepseek.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paxlite.__main__ import main
from paxlite.checkpointing.pretrained import restore_params, saved_param_shapes
from tests.interop.conftest import convert_with_tokenizer, finetune, generate_matches_transformers
from tests.interop.test_hf_deepseek import CASES, SIZES
from tests.interop.test_tokenizer_json_generate import NEW, TEXTS

BIAS = "score_correction_bias"
# data x fsdp x tensor; one step shows what trains and what stays
MESH = ("ICI_MESH_SHAPE=[2,2,2]", "LEARNING_RATE=1e-3")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its directory with a tokenizer.json, the converted paxlite
    directory)."""
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
    model.save_pretrained(root / "model")
    return (model, *convert_with_tokenizer(root / "model", root))


def test_generate_through_the_tokenizer_json_matches_transformers(converted, capsys):
    from transformers import AutoTokenizer

    model, hf_dir, out = converted
    prompts = generate_matches_transformers(model, hf_dir, out, TEXTS, NEW, capsys)
    assert all(ids[0] == AutoTokenizer.from_pretrained(hf_dir).bos_token_id for ids in prompts)


def _finetune(out, job, *overrides: str, save: bool = False):
    """conftest.finetune on MESH, its one step's loss logged and finite."""
    _, start, after = finetune(out, job, *MESH, *overrides, save=save)
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert len(losses) == 1 and all(np.isfinite(losses)), losses
    return start, after


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
    """The base (the choice biases included) stays as converted, in the run and in its checkpoint,
    which holds the adapters too; the adapters move."""
    import jax

    from paxlite.interop import hf

    def keyed(params):
        return {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(params)}

    _, _, out = converted
    job = tmp_path / "job"
    start, after = _finetune(out, job, "USE_LORA=true", "LORA_RANK=4",
                             "LORA_TARGET_LAYERS=attention", save=True)
    base = hf.from_paxlite(out).params
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), base)
    saved = keyed(restore_params(job / "checkpoints", abstract)[1])  # the base (LoRA's left out)
    base = keyed(base)
    assert any(BIAS in name for name in base)
    for name, value in base.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    adapters = [name for name in after if name not in base]
    assert adapters and all("lora" in name for name in adapters), adapters
    assert any(not np.array_equal(after[name], start[name]) for name in adapters)
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
