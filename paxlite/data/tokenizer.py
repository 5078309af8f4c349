"""SentencePiece tokenizer wrapper and the rules for finding the vocabulary file.

The model file is read once into memory and both loaded and hashed from those bytes, so the sha256
recorded in a dataset manifest always describes exactly the model that produced its tokens.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence

import sentencepiece as spm

from paxlite.errors import NotFoundError, UserError

# The environment variable Pax's GPU scripts use to point at the tokenizer.
VOCAB_PATH_ENV = "VOCAB_PATH"


class VocabError(UserError, ValueError):
    """The tokenizer file is missing, unusable, or does not fit the model."""


class Tokenizer:
    """A loaded SentencePiece model.

    Attributes:
        path: absolute path of the model file.
        vocab_size: number of pieces (ids are in [0, vocab_size)).
        eos_id, pad_id: special ids (-1 when the model defines none).
        bos_id: the BOS id, or None when the model has no BOS (T5/Pax style models have none).
    """

    def __init__(self, path: str | os.PathLike):
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.isfile(path):
            raise NotFoundError(f"no SentencePiece model file at {path}")
        with open(path, "rb") as f:
            proto = f.read()
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(proto)
        except RuntimeError as e:
            raise VocabError(f"{path} is not a valid SentencePiece model: {e}") from e
        self._processor = processor
        self._sha256 = hashlib.sha256(proto).hexdigest()
        self.path: str = path
        self.vocab_size: int = processor.get_piece_size()
        self.eos_id: int = processor.eos_id()
        self.pad_id: int = processor.pad_id()
        bos = processor.bos_id()
        self.bos_id: int | None = None if bos < 0 else bos

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, no EOS added; BOS first only when asked (paxlite's data pipeline
        adds none, but LLaMA-family models were trained with every document starting with it, so
        prompting them needs it)."""
        ids = self._processor.encode(text, out_type=int)
        if not add_bos:
            return ids
        if self.bos_id is None:
            raise VocabError(f"{self.path} defines no BOS piece, so none can be added")
        return [self.bos_id, *ids]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts; SentencePiece spreads the batch over all CPU threads."""
        if not texts:
            return []
        return self._processor.encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    def sha256(self) -> str:
        """Hex sha256 of the model file's bytes."""
        return self._sha256

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(int(token_id))


def resolve_vocab_path(value: str | None, *, environ: Mapping[str, str] = os.environ) -> str:
    """The tokenizer path: `--fdl.VOCAB_PATH` wins, else the VOCAB_PATH environment variable (Pax).

    Returns an absolute path to an existing file.
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
    if not os.path.isfile(resolved):
        raise VocabError(f"tokenizer file {resolved!r} (from {source}) does not exist")
    return resolved


def check_vocab_fits(tokenizer: Tokenizer, *, vocab_size: int) -> None:
    """Every id the tokenizer can emit must index the model's embedding table."""
    if tokenizer.vocab_size > vocab_size:
        raise VocabError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but the model's "
            f"VOCAB_SIZE is {vocab_size}; set --fdl.VOCAB_SIZE to at least {tokenizer.vocab_size}"
        )
