"""A Hugging Face tokenizer.json, read as transformers' AutoTokenizer reads it (the `hf` extra).

The tokenizer.json is a whole `tokenizers` pipeline (normalizer, pre-tokenizer, model,
post-processor, decoder) and is used as written, as AutoTokenizer uses it for the generic tokenizer
classes (`PreTrainedTokenizerFast`, which LLaMA-3 names). From the tokenizer_config.json beside it
(and a legacy special_tokens_map.json) come the named special tokens (`bos_token`, `eos_token`,
`pad_token`, ...) and its `added_tokens_decoder`; a named or added token the tokenizer.json lacks
is added to it, as transformers adds it, so it is matched in text and gets the same id.

A model-specific class is built as transformers 5 builds it (tokenizer_hf_classes.py): where
tokenizer_config.json and config.json make transformers pick `LlamaTokenizer` (LLaMA-2's hub
files), `GemmaTokenizer` or `Qwen2Tokenizer`, only the tokenizer.json's vocabulary, merges, added
tokens and post-processor are kept, and the class's own pipeline and special-token defaults are
used (config.json is read for its model_type alone; the tokenizer's sha256 covers the tokenizer
files).

Whether BOS is added is the post-processor's answer (e.g. a TemplateProcessing that writes
`<|begin_of_text|> $A`): with a tokenizer.json, transformers ignores `add_bos_token` and
`add_eos_token` in tokenizer_config.json, and without a post-processor adds neither.
"""

from __future__ import annotations

import json
import os
from typing import Any

from paxlite.data.errors import VocabError

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # older directories; read as transformers does
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES)
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
EXTRA_SPECIAL_TOKENS = ("extra_special_tokens", "additional_special_tokens")
# What `convert --to=paxlite` writes beside the tokenizer files it copies: the HF model's
# model_type, which transformers' choice of tokenizer class depends on (the HF config.json is not
# copied: a paxlite directory's config.json is a training job's)
MODEL_TYPE_FILE = "tokenizer_model_type.json"
HF_EXTRA = "pip install 'paxlite[hf]'"


def read_config_files(directory: str) -> list[tuple[str, bytes]]:
    """The settings files beside a tokenizer.json that change what it encodes: (path, bytes)."""
    contents = []
    for name in (CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                contents.append((path, f.read()))
    return contents


def _json_object(path: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise VocabError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise VocabError(f"{path} does not hold a JSON object")
    return value


def _settings(contents: list[tuple[str, bytes]]) -> dict[str, Any]:
    """tokenizer_config.json's settings; special_tokens_map.json's override them only where the
    config has no `added_tokens_decoder` (transformers' legacy rule)."""
    by_name = {os.path.basename(path): (path, data) for path, data in contents[1:]}
    settings = _json_object(*by_name[CONFIG_FILE]) if CONFIG_FILE in by_name else {}
    if SPECIAL_TOKENS_MAP_FILE in by_name and "added_tokens_decoder" not in settings:
        settings.update(_json_object(*by_name[SPECIAL_TOKENS_MAP_FILE]))
    return settings


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_token(value: Any, *, special: bool):
    """A `tokenizers.AddedToken` for a config entry (its flags where the entry has them)."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        flags = {key: value[key] for key in ("single_word", "lstrip", "rstrip", "normalized",
                                             "special") if key in value}
        flags.setdefault("special", special)
        return AddedToken(value["content"], **flags)
    return AddedToken(value, special=special)


def _model_type_beside(path: str) -> str | None:
    """config.json's model_type in the tokenizer's directory, else the one a conversion recorded
    beside the tokenizer it copied (MODEL_TYPE_FILE: the HF model's); None without either."""
    for name in ("config.json", MODEL_TYPE_FILE):
        try:
            with open(os.path.join(os.path.dirname(path), name), "rb") as f:
                value = json.loads(f.read().decode("utf-8")).get("model_type")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            return value
    return None


def _as_transformers_builds(text: str, settings: dict[str, Any], *, path: str
                            ) -> tuple[str, dict[str, Any]]:
    """(the tokenizer.json, the settings) as transformers builds the class it picks for them
    (tokenizer_hf_classes.py): unchanged for a file read as written."""
    from paxlite.data import tokenizer_hf_classes as classes

    name = classes.transformers_class(settings, model_type=_model_type_beside(path),
                                      byte_level='"ByteLevel"' in text)
    if name is None:
        return text, settings
    try:
        spec = json.loads(text)
    except ValueError:
        return text, settings  # tokenizers says what is wrong with it
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict) or spec[
            "model"].get("type") != "BPE":
        return text, settings  # the classes built here are BPE; tokenizers reads the rest
    return (json.dumps(classes.built_as(spec, settings, name)),
            {**classes.CLASS_SPECIAL_TOKENS[name], **settings})


class HfTokenizerBackend:
    """The tokenizer.json pipeline plus the special tokens its config names."""

    def __init__(self, *, path: str, contents: list[tuple[str, bytes]]):
        try:
            import tokenizers
        except ImportError:
            raise VocabError(f"{path} is a Hugging Face tokenizer.json, which needs the "
                             f"`tokenizers` library: {HF_EXTRA}") from None
        settings = _settings(contents)
        try:
            text = contents[0][1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise VocabError(f"{path} is not a valid Hugging Face tokenizer.json: {e}") from None
        text, settings = _as_transformers_builds(text, settings, path=path)
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception)
            raise VocabError(f"{path} is not a valid Hugging Face tokenizer.json: {e}") from None
        self._add_config_tokens(backend, settings)
        self._backend = backend
        ids = {key: self._id_of(settings.get(key)) for key in ("bos_token", "eos_token",
                                                                "pad_token")}
        self.bos_id: int | None = ids["bos_token"]
        self.eos_id: int = -1 if ids["eos_token"] is None else ids["eos_token"]
        self.pad_id: int = -1 if ids["pad_token"] is None else ids["pad_token"]
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.adds_bos: bool = self._post_processor_adds_bos()
        self.named_special_tokens: dict[str, str] = {
            key: content for key in NAMED_SPECIAL_TOKENS
            if (content := _token_content(settings.get(key))) is not None}
        self._clean_up_spaces = bool(settings.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE" or bool(settings.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))

    @staticmethod
    def _add_config_tokens(backend, settings: dict[str, Any]) -> None:
        """The config's added tokens (in id order) and named special tokens that the
        tokenizer.json does not hold as added tokens, added as transformers adds them."""
        present = {token.content for token in backend.get_added_tokens_decoder().values()}
        new = []
        decoder = settings.get("added_tokens_decoder") or {}
        for _, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
            content = _token_content(entry)
            if content is not None and content not in present:
                new.append(_added_token(entry, special=True))
                present.add(content)
        named = [settings.get(key) for key in NAMED_SPECIAL_TOKENS]
        for key in EXTRA_SPECIAL_TOKENS:
            extra = settings.get(key)
            named += list(extra.values() if isinstance(extra, dict) else extra or [])
        for value in named:
            content = _token_content(value)
            if content is not None and content not in present:
                new.append(_added_token(value, special=True))
                present.add(content)
        if new:
            backend.add_tokens(new)

    def _id_of(self, value: Any) -> int | None:
        content = _token_content(value)
        return None if content is None else self._backend.token_to_id(content)

    def _post_processor_adds_bos(self) -> bool:
        """Whether the default encoding (add_special_tokens=True) puts BOS before the text."""
        if self.bos_id is None or self._backend.post_processor is None:
            return False
        probe = "a"
        plain = self._backend.encode(probe, add_special_tokens=False).ids
        full = self._backend.encode(probe, add_special_tokens=True).ids
        return full[:1] == [self.bos_id] and full[1:1 + len(plain)] == plain

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """transformers' `decode(ids)` with its defaults: special tokens kept, the tokenizer.json's
        decoder (a ByteFallback decoder turns each byte of an invalid UTF-8 run into U+FFFD), and
        the config's clean_up_tokenization_spaces, which transformers skips for BPE models."""
        text = self._backend.decode(ids, skip_special_tokens=False)
        if self._clean_up_spaces:
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","),
                                  (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"),
                                  (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def id_to_piece(self, token_id: int) -> str:
        piece = self._backend.id_to_token(token_id)
        return "" if piece is None else piece
