"""Tiny, randomly initialised transformers models saved as HF directories (no downloads).

Norm weights and biases are pushed away from 1 / 0 so that a converter that drops or swaps them is
caught, and LLaMA weights use initializer_range 0.1 so attention is far from uniform and a wrong
RoPE row order changes the logits by far more than the tolerance.
"""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest

TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 16)).astype(np.int32)
LLAMA_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                   num_attention_heads=4)


def _perturb_norms(model, *, names: tuple[str, ...]) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(n in name for n in names):
                param.add_(0.3 * torch.randn_like(param))


def hf_logits(model, tokens: np.ndarray = TOKENS) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def make_llama(directory, *, kv_heads: int, rope_theta: float = 10000.0):
    """(saved dir, torch model) of a tiny LlamaForCausalLM."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_SIZES, num_key_value_heads=kv_heads, initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    model = LlamaForCausalLM(config).eval()
    _perturb_norms(model, names=("norm",))
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


@pytest.fixture(scope="session")
def llama_gqa(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("hf") / "llama_gqa", kv_heads=2)


@pytest.fixture(scope="session")
def llama_mha(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("hf") / "llama_mha", kv_heads=4)


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=128)).eval()
    _perturb_norms(model, names=("ln_",))
    directory = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


# ---------------------------------------------------------------- shared by the family files
# (test_hf_llama4.py, test_hf_gpt_oss.py, test_hf_deepseek.py, test_deepseek_finetune.py)
def safetensors_of(directory) -> dict[str, np.ndarray]:
    """Every tensor of `directory`/model.safetensors by name."""
    from safetensors import safe_open

    with safe_open(os.path.join(directory, "model.safetensors"), framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  not iterable


def transformers_greedy(model, prompts, new: int, *, eos_token_id=None,
                        pad_token_id=0) -> list[list[int]]:
    """The ids transformers' `generate(do_sample=False)` appends to each prompt (one at a time)."""
    import torch

    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                 eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        out.append(ids[0, len(prompt):].tolist())
    return out


def save_and_read_back(pretrained, directory, out):
    """`hf.save(pretrained, out)`: the same tensor names and bytes as `directory`, the written
    config.json reading back as `pretrained.config`; returns (written config.json, transformers'
    eager model of `out`) for the family's own checks and logits."""
    import transformers

    from paxlite.interop import hf
    from paxlite.interop.hf_config import from_hf_config

    hf.save(pretrained, out)
    original, ours = safetensors_of(directory), safetensors_of(out)
    assert sorted(ours) == sorted(original)
    for tensor in original:
        assert ours[tensor].tobytes() == original[tensor].tobytes(), tensor
    written = json.loads((out / "config.json").read_text())
    assert from_hf_config(written)[1] == pretrained.config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager").eval()
    return written, model


def convert_with_tokenizer(source, root):
    """(a copy of the HF directory `source` with a tokenizer.json beside the model, its
    `convert --to=paxlite` output), both under `root`."""
    import shutil

    from paxlite.__main__ import main
    from tests.interop.test_tokenizer_json_generate import _tokenizer_json

    hf_dir, out = root / "hf", root / "pax"
    shutil.copytree(source, hf_dir)
    _tokenizer_json(hf_dir)
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={hf_dir}",
                 f"--output={out}"]) == 0
    return hf_dir, out


def generate_matches_transformers(model, hf_dir, out, texts, new: int, capsys, *,
                                  stop_at_eos: bool = True) -> list[list[int]]:
    """`generate --prompt=TEXT` on the converted `out`: each text's ids are transformers'
    AutoTokenizer's of `hf_dir` and its continuation transformers' greedy ids (stopping at the
    tokenizer's EOS, or `stop_at_eos=False`: at none, padding with 0). Returns the prompt ids."""
    from transformers import AutoTokenizer

    from paxlite.__main__ import main

    capsys.readouterr()
    assert main(["generate", f"--checkpoint={out}", *[f"--prompt={t}" for t in texts],
                 f"--max_new_tokens={new}", "--format=json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [theirs(text)["input_ids"] for text in texts]
    eos = dict(eos_token_id=theirs.eos_token_id, pad_token_id=theirs.eos_token_id)
    want = transformers_greedy(model, prompts, new,
                               **(eos if stop_at_eos else dict(eos_token_id=None)))
    assert [r["prompt_ids"] for r in records] == prompts
    assert [r["ids"] for r in records] == want
    return prompts


# FineTune runs of the tiny models: synthetic data, 16 positions, one row per device, one step.
FINETUNE = ("SYNTHETIC_DATA=true", "MAX_STEPS=1", "MAX_SEQ_LEN=16", "PERCORE_BATCH_SIZE=1",
            "SUMMARY_INTERVAL_STEPS=1")


def finetune(restore_path, job, *overrides: str, save: bool = False):
    """FineTune from the converted `restore_path` in this process with FINETUNE's settings and then
    `overrides`: (the run's config, its parameters at the start, after training), each flat by
    `jax.tree_util.keystr` as NumPy. No evaluation (eval_data dropped: no test here reads it, and
    it compiled an eval step per run); `save`: checkpoints under `job`/checkpoints (none
    otherwise)."""
    import jax

    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext

    _, config = build_run_config(
        "FineTune", [f"CHECKPOINT_RESTORE_PATH={restore_path}", *FINETUNE, *overrides])

    def flat(params):
        return {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(params))}

    with Run(config, RunContext(job_dir=str(job), enable_checkpoint_saving=save)) as run:
        eval_data, run.eval_data = run.eval_data, None
        try:
            start = flat(run.restore_or_init().params)
            final = run.train()
        finally:
            run.eval_data = eval_data  # closed with the run
    assert int(final.step) == config.loop.max_steps
    return config, start, flat(final.params)
