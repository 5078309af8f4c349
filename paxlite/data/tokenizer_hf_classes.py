"""The tokenizer classes transformers 5 builds themselves from a tokenizer.json (the `hf` extra).

`AutoTokenizer` picks a class from tokenizer_config.json's `tokenizer_class` and config.json's
`model_type` (`transformers_class` below follows the rules of transformers 5.24's
`AutoTokenizer.from_pretrained`). The generic classes (`TokenizersBackend`,
`PreTrainedTokenizerFast`) use the tokenizer.json as written. A model-specific class with its own
constructor keeps only the file's vocabulary, merges, added tokens and post-processor, and builds
the normalizer, pre-tokenizer, decoder and BPE options itself; its constructor's defaults name the
special tokens the config does not. Three of them are built here as transformers builds them:
`LlamaTokenizer` (LLaMA-2's hub files; Metaspace instead of their Prepend + Replace normalizer),
`GemmaTokenizer` and `Qwen2Tokenizer`. Any other class is read as written.
"""

from __future__ import annotations

from typing import Any

# config.json's model_type -> the class transformers registers for it (the families paxlite
# converts; `llama` registers none, so its hub class decides)
_REGISTERED = {
    "mistral": "TokenizersBackend", "mixtral": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer", "qwen3_moe": "Qwen2Tokenizer",
    "gemma": "GemmaTokenizer", "gemma2": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer",
    "gpt2": "GPT2Tokenizer",
}
# model types whose hub files name a wrong class: the registered one is used instead
_HUB_CLASS_IGNORED = frozenset({"qwen2"})
_GENERIC = frozenset({"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast",
                      "MistralCommonBackend"})
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# each class's constructor defaults for the named special tokens (None: none)
CLASS_SPECIAL_TOKENS: dict[str, dict[str, str | None]] = {
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GemmaTokenizer": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>",
                       "pad_token": "<pad>", "mask_token": "<mask>"},
    "Qwen2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": None,
                       "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
}


def transformers_class(settings: dict[str, Any], *, model_type: str | None,
                       byte_level: bool) -> str | None:
    """The class transformers builds for a tokenizer.json beside these settings, when it is one
    built here; None when the file is read as written."""
    named = settings.get("tokenizer_class")
    hub = named.removesuffix("Fast") if isinstance(named, str) and named else None
    registered = _REGISTERED.get(model_type or "")
    if (hub == "LlamaTokenizer" and byte_level and model_type not in _HUB_CLASS_IGNORED):
        chosen = None  # transformers: a byte-level file under LlamaTokenizer is read as written
    elif hub and registered and registered != hub:
        chosen = None if registered in _GENERIC else (
            registered if model_type in _HUB_CLASS_IGNORED else hub)
    else:
        chosen = hub or registered
    return chosen if chosen in CLASS_SPECIAL_TOKENS else None


def built_as(spec: dict[str, Any], settings: dict[str, Any], name: str) -> dict[str, Any]:
    """``spec`` (a parsed BPE tokenizer.json) with the pipeline class ``name`` builds."""
    spec = dict(spec)
    model = {**spec["model"], "dropout": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "ignore_merges": False}
    if name == "LlamaTokenizer":
        add_prefix_space = settings.get("add_prefix_space")
        add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
        scheme = ("always" if settings.get("legacy", False) else "first") if add_prefix_space \
            else "never"
        spec["model"] = {**model, "unk_token": None, "fuse_unk": True, "byte_fallback": True}
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁",
                                 "prepend_scheme": scheme, "split": False}
        steps = [_replace("▁", " "), {"type": "ByteFallback"}, {"type": "Fuse"}]
        if add_prefix_space:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        spec["decoder"] = {"type": "Sequence", "decoders": steps}
    elif name == "GemmaTokenizer":
        unk = _content(settings.get("unk_token")) or "<unk>"
        spec["model"] = {**model, "unk_token": unk, "fuse_unk": True, "byte_fallback": True}
        spec["normalizer"] = _replace(" ", "▁")
        spec["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "},
                                 "behavior": "MergedWithPrevious", "invert": False}
        spec["decoder"] = {"type": "Sequence", "decoders": [
            _replace("▁", " "), {"type": "ByteFallback"}, {"type": "Fuse"}]}
    else:  # Qwen2Tokenizer
        add_prefix_space = bool(settings.get("add_prefix_space") or False)
        spec["model"] = {**model, "unk_token": None, "fuse_unk": False, "byte_fallback": False,
                         "continuing_subword_prefix": "", "end_of_word_suffix": ""}
        spec["normalizer"] = {"type": "NFC"}
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
             "use_regex": False}]}
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True}
    return spec


def _replace(pattern: str, content: str) -> dict[str, Any]:
    return {"type": "Replace", "pattern": {"String": pattern}, "content": content}


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
