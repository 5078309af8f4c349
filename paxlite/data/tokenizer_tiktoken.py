"""A tiktoken BPE file (LLaMA-3's original tokenizer.model, AXLearn's Fuji v3-tiktoken), read with
the `tiktoken` package (the `hf` extra).

The file holds only the byte-level merges' ranks (a base64 token and its rank per line); the rest
of the tokenizer is assumed to be LLaMA-3's, as Meta's tokenizer.py defines it: its
pre-tokenization regex, 256 special tokens numbered right after the ranks (`<|begin_of_text|>`,
`<|end_of_text|>`, ..., `<|eot_id|>`, `<|python_tag|>`, then reserved ones), BOS
`<|begin_of_text|>`, EOS `<|end_of_text|>`, no padding token, and BOS at the start of every text.
Special tokens written in the text are encoded as their ids (as the tokenizer.json transformers
ships for the same model does; Meta's reader encodes them as plain text by default), and a text is
encoded whole (Meta's reader cuts texts longer than 400,000 characters, and runs of more than
25,000 spaces or non-spaces, into pieces first).
"""

from __future__ import annotations

import base64
import binascii
import os

from paxlite.data.errors import VocabError

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL_TOKENS = 256
LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)
BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"
HF_EXTRA = "pip install 'paxlite[hf]'"


def llama3_special_tokens() -> list[str]:
    """LLaMA-3's special tokens in id order (the first follows the last rank)."""
    named = list(LLAMA3_NAMED_SPECIAL_TOKENS)
    reserved = [f"<|reserved_special_token_{2 + i}|>"
                for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(named))]
    return named + reserved


def parse_ranks(data: bytes) -> tuple[dict[bytes, int] | None, str | None]:
    """(token bytes -> rank, None) when `data` is a tiktoken BPE file, else (None, why not)."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None, "it is not ASCII text"
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("not two fields")
            ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
        except (ValueError, binascii.Error):
            return None, f"line {number} is not a base64 token and a rank"
    if not ranks:
        return None, "it holds no ranks"
    return ranks, None


def _byte_pieces() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte (as tokenizer.json
    vocabularies name byte-level tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    pieces, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            pieces[byte] = chr(byte)
        else:
            pieces[byte] = chr(256 + shifted)
            shifted += 1
    return [pieces[byte] for byte in range(256)]


class TiktokenBackend:
    """LLaMA-3's tokenizer over the ranks of a tiktoken file."""

    def __init__(self, *, path: str, ranks: dict[bytes, int]):
        try:
            import tiktoken
        except ImportError:
            raise VocabError(f"{path} is a tiktoken BPE file, which needs the `tiktoken` "
                             f"package: {HF_EXTRA}") from None
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise VocabError(f"{path}: the ranks of a tiktoken BPE file must be 0, 1, ... "
                             f"{len(ranks) - 1}, each once")
        specials = {token: len(ranks) + i for i, token in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                           mergeable_ranks=ranks, special_tokens=specials)
        self._pieces = {rank: token for token, rank in ranks.items()}
        self._specials = {i: token for token, i in specials.items()}
        self._byte_pieces = _byte_pieces()
        self.vocab_size: int = len(ranks) + len(specials)
        self.bos_id: int | None = specials[BOS_TOKEN]
        self.eos_id: int = specials[EOS_TOKEN]
        self.pad_id: int = -1
        self.adds_bos: bool = True
        self.named_special_tokens: dict[str, str] = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_batch(texts, allowed_special="all",
                                           num_threads=os.cpu_count() or 1)

    def decode(self, ids: list[int]) -> str:
        """The bytes of the ids as UTF-8, an invalid sequence replaced (tiktoken's and Meta's)."""
        return self._encoding.decode(ids)

    def id_to_piece(self, token_id: int) -> str:
        """A special token's text, else the token's bytes as byte-level BPE names them."""
        if token_id in self._specials:
            return self._specials[token_id]
        return "".join(self._byte_pieces[b] for b in self._pieces[token_id])
