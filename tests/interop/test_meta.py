"""Meta consolidated checkpoints: 2 model-parallel shards made from an HF model; safe unpickling."""

import json

import numpy as np
import pytest

from paxlite.interop import hf
from paxlite.interop.meta import UnsafeCheckpointError, ffn_hidden_dims, load_torch_file
from tests.interop.conftest import TOKENS, hf_logits

TOL = 1e-4


def _hf_to_meta_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k row order back to Meta's, written out index by index (independent of paxlite):
    within each head, meta_row[2j + p] = hf_row[p * h/2 + j]."""
    head_dim = w.shape[0] // heads
    out = np.empty_like(w)
    for n in range(heads):
        for j in range(head_dim // 2):
            for p in range(2):
                out[n * head_dim + 2 * j + p] = w[n * head_dim + p * head_dim // 2 + j]
    return out


def write_meta(directory, model, *, permute: bool, shards: int = 2, dtype=None,
               embedding_axis: int = 1) -> None:
    """consolidated.NN.pth shards split as Meta's model-parallel code splits them (docs/interop.md),
    stored in ``dtype`` (a torch dtype; None: the model's float32); the token embedding split along
    model dims (``embedding_axis=1``, LLaMA-1/2) or the vocabulary (0, LLaMA-3)."""
    import torch

    config = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    meta = {"tok_embeddings.weight": state["model.embed_tokens.weight"],
            "norm.weight": state["model.norm.weight"], "output.weight": state["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        q, k = state[src + "self_attn.q_proj.weight"], state[src + "self_attn.k_proj.weight"]
        if permute:
            q, k = _hf_to_meta_rows(q, heads), _hf_to_meta_rows(k, kv)
        meta.update({
            dst + "attention.wq.weight": q, dst + "attention.wk.weight": k,
            dst + "attention.wv.weight": state[src + "self_attn.v_proj.weight"],
            dst + "attention.wo.weight": state[src + "self_attn.o_proj.weight"],
            dst + "feed_forward.w1.weight": state[src + "mlp.gate_proj.weight"],
            dst + "feed_forward.w2.weight": state[src + "mlp.down_proj.weight"],
            dst + "feed_forward.w3.weight": state[src + "mlp.up_proj.weight"],
            dst + "attention_norm.weight": state[src + "input_layernorm.weight"],
            dst + "ffn_norm.weight": state[src + "post_attention_layernorm.weight"],
        })
    directory.mkdir()
    for s in range(shards):
        shard = {"rope.freqs": torch.ones(8)}
        for name, array in meta.items():
            if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight",
                              "output.weight")):
                part = np.split(array, shards, axis=0)[s]
            elif name.endswith(("wo.weight", "w2.weight")):
                part = np.split(array, shards, axis=1)[s]
            elif name == "tok_embeddings.weight":
                part = np.split(array, shards, axis=embedding_axis)[s]
            else:
                part = array
            shard[name] = torch.from_numpy(np.ascontiguousarray(part)).to(dtype or torch.float32)
        torch.save(shard, directory / f"consolidated.{s:02d}.pth")
    params = {"dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": heads,
              "n_kv_heads": kv, "multiple_of": 4, "ffn_dim_multiplier": None,
              "norm_eps": config.rms_norm_eps, "vocab_size": -1}
    (directory / "params.json").write_text(json.dumps(params))


def test_ffn_size_formula():
    assert ffn_hidden_dims(dim=4096, multiple_of=256, ffn_dim_multiplier=None) == 11008
    assert ffn_hidden_dims(dim=5120, multiple_of=256, ffn_dim_multiplier=None) == 13824
    assert ffn_hidden_dims(dim=8192, multiple_of=4096, ffn_dim_multiplier=1.3) == 28672
    assert ffn_hidden_dims(dim=64, multiple_of=4, ffn_dim_multiplier=None) == 172


def test_two_shards_match_hf_and_a_wrong_permutation_is_caught(llama_gqa, tmp_path):
    _, model = llama_gqa
    ref = hf_logits(model)
    write_meta(tmp_path / "meta", model, permute=True)
    with pytest.raises(ValueError, match="vocab_size=-1 .* --vocab_size"):
        hf.from_meta(tmp_path / "meta")
    pretrained = hf.from_meta(tmp_path / "meta", vocab_size=256)
    assert pretrained.config.hidden_dims == 172 and pretrained.config.kv_heads == 2
    np.testing.assert_allclose(pretrained.logits(TOKENS), ref, atol=TOL, rtol=0)
    # The same shards without Meta's row order: the model runs, and its logits are wrong.
    write_meta(tmp_path / "unpermuted", model, permute=False)
    wrong = hf.from_meta(tmp_path / "unpermuted", vocab_size=256)
    assert np.abs(wrong.logits(TOKENS) - ref).max() > 1e-2


class _NotATensor:
    """Any class: unpickling it would mean running its module's code."""


def test_pickles_holding_objects_are_refused(tmp_path):
    import torch

    torch.save({"w": torch.zeros(2), "extra": _NotATensor()}, tmp_path / "evil.pth")
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True"):
        load_torch_file(tmp_path / "evil.pth")
    torch.save({"w": torch.zeros(2), "step": "100"}, tmp_path / "str.pth")
    with pytest.raises(UnsafeCheckpointError, match="'step' is a str, not a tensor"):
        load_torch_file(tmp_path / "str.pth")
    torch.save({"w": torch.arange(3, dtype=torch.bfloat16)}, tmp_path / "ok.pth")
    np.testing.assert_array_equal(load_torch_file(tmp_path / "ok.pth")["w"].astype(np.float32),
                                  [0.0, 1.0, 2.0])
