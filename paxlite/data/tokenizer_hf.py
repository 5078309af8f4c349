"""A Hugging Face tokenizer.json, read as transformers' AutoTokenizer reads it (the `hf` extra).

The tokenizer.json is a whole `tokenizers` pipeline (normalizer, pre-tokenizer, model,
post-processor, decoder) and is used as written, as AutoTokenizer uses it for the generic tokenizer
classes (`PreTrainedTokenizerFast`, which LLaMA-3 names). From the tokenizer_config.json beside it
(and a legacy special_tokens_map.json) come the named special tokens (`bos_token`, `eos_token`,
`pad_token`, ...) and its `added_tokens_decoder`; a named or added token the tokenizer.json lacks
is added to it, as transformers adds it, so it is matched in text and gets the same id.

One class is rebuilt as transformers 5 rebuilds it: a tokenizer_config.json naming
`LlamaTokenizer` (LLaMA-2's, and converted SentencePiece models') makes transformers keep only the
vocabulary, merges, added tokens and post-processor of a tokenizer.json that is not byte-level, and
build the rest itself (no normalizer; a Metaspace pre-tokenizer that puts "▁" before the text, or
before its first piece unless `legacy`; its own decoder). transformers hands a directory whose
config.json says `mistral` or `mixtral` to its generic reader instead (the tokenizer.json as
written), and so does paxlite: only a directory without config.json or with `model_type: llama` is
rebuilt (config.json is read for that one field; the tokenizer's sha256 covers the tokenizer files
alone).

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


# The model types whose directories transformers reads through the class tokenizer_config.json
# names, when that class is LlamaTokenizer (none: no config.json beside the tokenizer)
_LLAMA_CLASS_MODEL_TYPES = (None, "", "llama")


def _model_type_beside(path: str) -> str | None:
    """config.json's model_type in the tokenizer's directory; None without one."""
    try:
        with open(os.path.join(os.path.dirname(path), "config.json"), "rb") as f:
            value = json.loads(f.read().decode("utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _rebuilt_as_llama(text: str, settings: dict[str, Any], *, model_type: str | None) -> bool:
    """Whether transformers 5's AutoTokenizer builds this tokenizer.json's pipeline itself, as
    `LlamaTokenizer` (a byte-level tokenizer.json it reads as written, whatever the class)."""
    named = settings.get("tokenizer_class")
    return (isinstance(named, str) and named.removesuffix("Fast") == "LlamaTokenizer"
            and '"ByteLevel"' not in text and model_type in _LLAMA_CLASS_MODEL_TYPES)


def _as_llama_tokenizer_builds(text: str, settings: dict[str, Any]) -> str:
    """The tokenizer.json of the pipeline transformers' LlamaTokenizer builds from ``text``: its
    BPE vocabulary, merges, added tokens and post-processor; no normalizer; Metaspace with "▁"
    before the text (``add_prefix_space``, default true), before every piece between added
    tokens (``legacy``) or only the first (not legacy, the default), without splitting on it; a
    decoder that turns "▁" into spaces, joins byte pieces and drops the prefix space."""
    try:
        spec = json.loads(text)
    except ValueError:
        return text  # tokenizers says what is wrong with it
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict) or spec[
            "model"].get("type") != "BPE":
        return text  # not a BPE model: tokenizers refuses or reads it as it stands
    add_prefix_space = settings.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if settings.get("legacy", False) else "first") if add_prefix_space \
        else "never"
    spec["model"] = {**spec["model"], "dropout": None, "unk_token": None, "fuse_unk": True,
                     "byte_fallback": True, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "ignore_merges": False}
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme,
                             "split": False}
    steps = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
             {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_prefix_space:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    spec["decoder"] = {"type": "Sequence", "decoders": steps}
    return json.dumps(spec)


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
        if _rebuilt_as_llama(text, settings, model_type=_model_type_beside(path)):
            text = _as_llama_tokenizer_builds(text, settings)
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
