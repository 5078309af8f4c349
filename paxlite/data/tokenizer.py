"""The tokenizer every command reads text with, and the rules for finding its files.

Three formats open through one class (`Tokenizer`), picked from what the path holds:

- a SentencePiece model (`.model`, the Pax / T5 / LLaMA-2 format);
- a Hugging Face `tokenizer.json` (the `tokenizers` library, the `hf` extra), with the
  tokenizer_config.json beside it for its named special tokens, as transformers reads them;
- a tiktoken BPE file (LLaMA-3's original `tokenizer.model`, AXLearn's Fuji v3-tiktoken: a base64
  token and its rank per line), read with LLaMA-3's regex and special tokens (`tokenizer_tiktoken`).

A directory is read as transformers' AutoTokenizer reads it: its tokenizer.json when it has one
(even beside a SentencePiece tokenizer.model), else its tokenizer.model.

The files are read once into memory and both loaded and hashed from those bytes, so the sha256
recorded in a dataset manifest always describes exactly the tokenizer that produced its tokens.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import sentencepiece as spm

from paxlite.data.errors import VocabError
from paxlite.errors import NotFoundError

# The environment variable Pax's GPU scripts use to point at the tokenizer.
VOCAB_PATH_ENV = "VOCAB_PATH"
HF_TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "tokenizer.model"  # SentencePiece or tiktoken, told apart by content
VALID_TOKENIZERS = ("a SentencePiece or tiktoken .model file, a Hugging Face tokenizer.json, or a "
                    f"directory holding {HF_TOKENIZER_FILE} or {MODEL_FILE}")


class TokenizerFormat(str, enum.Enum):
    SENTENCEPIECE = "sentencepiece"
    HF_TOKENIZER_JSON = "tokenizer.json"
    TIKTOKEN = "tiktoken"


class TokenizerBackend(Protocol):
    """What each format supplies; `Tokenizer` adds BOS and the checks common to all."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    adds_bos: bool | None
    named_special_tokens: dict[str, str]

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def id_to_piece(self, token_id: int) -> str: ...


class _SentencePieceBackend:
    def __init__(self, *, path: str, proto: bytes, tiktoken_problem: str | None):
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(proto)
        except RuntimeError as e:
            tried = f"; nor a tiktoken BPE file ({tiktoken_problem})" if tiktoken_problem else ""
            raise VocabError(f"{path} is not a valid SentencePiece model: {e}{tried}. A tokenizer "
                             f"is {VALID_TOKENIZERS}") from e
        self._processor = processor
        self.vocab_size: int = processor.get_piece_size()
        self.eos_id: int = processor.eos_id()
        self.pad_id: int = processor.pad_id()
        bos = processor.bos_id()
        self.bos_id: int | None = None if bos < 0 else bos
        # SentencePiece says nothing about it: a tokenizer_config.json beside it may
        # (cli.model_source.tokenizer_adds_bos).
        self.adds_bos: bool | None = None
        self.named_special_tokens: dict[str, str] = {
            name: processor.id_to_piece(token_id) for name, token_id in (
                ("bos_token", bos), ("eos_token", self.eos_id), ("unk_token", processor.unk_id()),
                ("pad_token", self.pad_id)) if token_id >= 0}

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # SentencePiece spreads the batch over all CPU threads.
        return self._processor.encode(texts, out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: list[int]) -> str:
        return self._processor.decode(ids)

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(token_id)


def tokenizer_in(directory: str | os.PathLike) -> str | None:
    """The tokenizer file a directory holds, as AutoTokenizer prefers them: its tokenizer.json,
    else its tokenizer.model; None when it holds neither."""
    for name in (HF_TOKENIZER_FILE, MODEL_FILE):
        candidate = os.path.join(os.fspath(directory), name)
        if os.path.isfile(candidate):
            return candidate
    return None


def find_tokenizer_file(path: str | os.PathLike) -> str:
    """The one file that defines the tokenizer at `path` (absolute): the file itself, or the one
    a directory holds (`tokenizer_in`)."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(path):
        found = tokenizer_in(path)
        if found is not None:
            return found
        raise VocabError(f"directory {path} holds neither {HF_TOKENIZER_FILE} nor {MODEL_FILE}; "
                         f"a tokenizer is {VALID_TOKENIZERS}")
    if not os.path.isfile(path):
        if path.endswith(".model"):
            raise NotFoundError(f"no SentencePiece model file at {path}")
        raise NotFoundError(f"no tokenizer at {path}; a tokenizer is {VALID_TOKENIZERS}")
    return path


def _looks_like_json(data: bytes) -> bool:
    return data.lstrip()[:1] == b"{"


def _files_sha256(contents: Sequence[tuple[str, bytes]]) -> str:
    """sha256 of the one file read (a SentencePiece or tiktoken model: its bytes, as before), or
    of the files' names and sha256s, one `name<TAB>sha256` line each, in reading order."""
    if len(contents) == 1:
        return hashlib.sha256(contents[0][1]).hexdigest()
    lines = "".join(f"{os.path.basename(name)}\t{hashlib.sha256(data).hexdigest()}\n"
                    for name, data in contents)
    return hashlib.sha256(lines.encode()).hexdigest()


def _read_files(main_file: str) -> tuple[TokenizerFormat, list[tuple[str, bytes]]]:
    """The format and every file it reads (the main file first), each read once."""
    from paxlite.data import tokenizer_hf

    with open(main_file, "rb") as f:
        data = f.read()
    if _looks_like_json(data):
        return TokenizerFormat.HF_TOKENIZER_JSON, [
            (main_file, data), *tokenizer_hf.read_config_files(os.path.dirname(main_file))]
    return TokenizerFormat.SENTENCEPIECE, [(main_file, data)]


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """The sha256 `Tokenizer(path).sha256()` returns, without loading the tokenizer."""
    _, contents = _read_files(find_tokenizer_file(path))
    return _files_sha256(contents)


class Tokenizer:
    """A loaded tokenizer of any supported format.

    Attributes:
        path: absolute path of the file that defines it (tokenizer.json or the .model file).
        format: which of the formats it is.
        files: absolute paths of every file read (the sha256 covers them all).
        vocab_size: ids are in [0, vocab_size).
        eos_id, pad_id: special ids (-1 when the tokenizer defines none).
        bos_id: the BOS id, or None when the tokenizer has no BOS (T5/Pax style models have none).
        adds_bos: whether the tokenizer's own default encoding starts with BOS (a tokenizer.json's
            post-processor, as transformers applies it); None when the format does not say.
        special_tokens: the named special tokens' strings (`bos_token`, `eos_token`, ...), the
            variables a chat template is rendered with (transformers' `special_tokens_map`).
        model_vocab_size: the embedding rows of the model the ids feed (``bind_model_vocab``);
            None: unbound, every id the tokenizer has is accepted.
    """

    def __init__(self, path: str | os.PathLike):
        from paxlite.data import tokenizer_hf, tokenizer_tiktoken

        main_file = find_tokenizer_file(path)
        format_, contents = _read_files(main_file)
        data = contents[0][1]
        backend: TokenizerBackend
        if format_ is TokenizerFormat.HF_TOKENIZER_JSON:
            backend = tokenizer_hf.HfTokenizerBackend(path=main_file, contents=contents)
        else:
            ranks, problem = tokenizer_tiktoken.parse_ranks(data)
            if ranks is not None:
                format_ = TokenizerFormat.TIKTOKEN
                backend = tokenizer_tiktoken.TiktokenBackend(path=main_file, ranks=ranks)
            else:
                backend = _SentencePieceBackend(path=main_file, proto=data,
                                                tiktoken_problem=problem)
        self._backend = backend
        self._sha256 = _files_sha256(contents)
        self.path: str = main_file
        self.format: TokenizerFormat = format_
        self.files: tuple[str, ...] = tuple(name for name, _ in contents)
        self.vocab_size: int = backend.vocab_size
        self.eos_id: int = backend.eos_id
        self.pad_id: int = backend.pad_id
        self.bos_id: int | None = backend.bos_id
        self.adds_bos: bool | None = backend.adds_bos
        self.special_tokens: dict[str, str] = dict(backend.named_special_tokens)
        self.model_vocab_size: int | None = None  # set by bind_model_vocab

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, no EOS added; BOS first only when asked (paxlite's data pipeline
        adds none, but LLaMA-family models were trained with every document starting with it, so
        prompting them needs it). Special tokens written in the text are their ids."""
        ids = self._check_ids(self._backend.encode(text))
        if not add_bos:
            return ids
        if self.bos_id is None:
            raise VocabError(f"{self.path} defines no BOS piece, so none can be added")
        return [self.bos_id, *ids]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts (no BOS, no EOS), spread over the CPU's threads."""
        if not texts:
            return []
        return [self._check_ids(ids) for ids in self._backend.encode_batch(list(texts))]

    def _check_ids(self, ids: list[int]) -> list[int]:
        """``ids``, unless one is past the bound model's embedding table. Checked only when the
        tokenizer has more pieces than the model has rows: otherwise no id can be."""
        limit = self.model_vocab_size
        if limit is None or self.vocab_size <= limit or not ids or max(ids) < limit:
            return ids
        bad = next(i for i in ids if i >= limit)
        raise VocabError(
            f"the text holds token {self.id_to_piece(bad)!r} (id {bad}), past the model's "
            f"vocabulary: it embeds ids 0..{limit - 1} and tokenizer {self.path} has "
            f"{self.vocab_size} pieces; use text without it, or a model with VOCAB_SIZE >= "
            f"{bad + 1}")

    def id_to_piece(self, token_id: int) -> str:
        return self._backend.id_to_piece(int(token_id))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included; for a tokenizer.json exactly what
        transformers' `tokenizer.decode(ids)` returns. An id the tokenizer does not have (a model's
        vocabulary is often padded beyond its tokenizer's) decodes to nothing, as transformers'
        tokenizers decode it."""
        return self._backend.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def sha256(self) -> str:
        """Hex sha256 of the file(s) read (see `_files_sha256`)."""
        return self._sha256


def resolve_vocab_path(value: str | None, *, environ: Mapping[str, str] = os.environ) -> str:
    """The tokenizer path: `--fdl.VOCAB_PATH` wins, else the VOCAB_PATH environment variable (Pax).

    Returns an absolute path to an existing file or directory.
    """
    if value:
        path, source = value, "--fdl.VOCAB_PATH"
    elif environ.get(VOCAB_PATH_ENV):
        path, source = environ[VOCAB_PATH_ENV], f"the {VOCAB_PATH_ENV} environment variable"
    else:
        raise VocabError(
            "no tokenizer given: pass --fdl.VOCAB_PATH=/path/to/spm.model or set the "
            f"{VOCAB_PATH_ENV} environment variable to a SentencePiece .model file"
        )
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(resolved):
        raise VocabError(f"tokenizer file {resolved!r} (from {source}) does not exist")
    return resolved


def bind_model_vocab(tokenizer: Tokenizer, *, vocab_size: int) -> None:
    """Ties ``tokenizer`` to a model of ``vocab_size`` embedding rows: from now on it refuses to
    encode a text into an id past them.

    A tokenizer with more pieces than the model has rows is not refused by itself: transformers
    runs such a model (its logits never produce those ids) and fails only when an input holds one.
    paxlite does the same, with a clear error at the encode instead of an index error."""
    tokenizer.model_vocab_size = vocab_size

