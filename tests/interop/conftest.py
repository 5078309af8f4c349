"""Tiny, randomly initialised transformers models saved as HF directories (no downloads).

Norm weights and biases are pushed away from 1 / 0 so that a converter that drops or swaps them is
caught, and LLaMA weights use initializer_range 0.1 so attention is far from uniform and a wrong
RoPE row order changes the logits by far more than the tolerance.
"""

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
