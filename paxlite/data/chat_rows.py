"""Chat and prompt/completion rows as token ids with a loss mask, packed several to a training row.

Supervised fine-tuning learns only what the model must say, so every example carries, per token,
whether it is learned. The conventions:

- A chat row `{"messages": [{"role": ..., "content": ...}, ...]}` is the conversation rendered with
  the chat template (`paxlite.data.chat_template`) and tokenised as transformers'
  `apply_chat_template(messages, tokenize=True)` does: the rendered text encoded without the
  tokenizer adding special tokens of its own (a template that writes `{{ bos_token }}` gives one
  BOS). The tokens of assistant message i are those that rendering `messages[:i+1]` adds over
  rendering `messages[:i]` with `add_generation_prompt=True`: the assistant's text and whatever the
  template writes after it up to the next message, so the end-of-turn token (`<|im_end|>` and its
  newline, `<|eot_id|>`, `<end_of_turn>` and its newline) is learned, and the model learns to
  stop. Those tokens must be a prefix-extension at every step (the conversation before the message
  with the generation prompt is a prefix of the conversation through it, which is a prefix of the
  whole conversation); a template for which that fails (one that rewrites earlier turns) is an
  error naming the message, never a guessed mask.
- A prompt/completion row `{"prompt": str, "completion": str}`: the prompt tokenised as plain text
  (BOS first where the tokenizer adds one), then the completion without special tokens, then EOS;
  the completion and the EOS are learned.
- Token 0 of an example is never learned: no token before it predicts it (in paxlite's rows, as
  in transformers' shifted labels).

Packing: examples are laid into rows of `seq_len` in order, greedily (an example that does not fit
in the rest of the row starts the next row), never split; each keeps its own segment id (1, 2, ...
within the row) and positions from 0, so attention and positions restart per example. An example
longer than `seq_len` is dropped or truncated to its first `seq_len` tokens, as `Overlong` says,
and counted. A batch of rows (`next_token_batch`) is in transformers' causal-LM layout, not the
text pipeline's: `inputs` the tokens themselves from position 0 (nothing prepended: a model
converted from transformers never saw the text pipeline's leading 0), `targets` at position t the
next token of the same example, `weights` 1.0 where that token is learned (0 at an example's last
token and on padding), `positions`, `segment_ids` (0 on padding). The loss is then transformers'
for the same ids and labels.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from paxlite.data.chat_template import BadRowError, ChatTemplate
from paxlite.data.errors import VocabError

ASSISTANT_ROLE = "assistant"
MESSAGES_KEY = "messages"
PROMPT_KEY, COMPLETION_KEY = "prompt", "completion"


class Overlong(str, enum.Enum):
    """What becomes of an example longer than a row."""

    DROP = "drop"
    TRUNCATE = "truncate"  # its first seq_len tokens


class RowKind(str, enum.Enum):
    CHAT = "chat"  # {"messages": [...]}
    PROMPT_COMPLETION = "prompt_completion"  # {"prompt", "completion"}


class TextTokenizer(Protocol):
    """What encoding rows needs of a tokenizer (paxlite.data.tokenizer.Tokenizer)."""

    path: str
    bos_id: int | None
    eos_id: int
    adds_bos: bool | None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatExample:
    ids: np.ndarray  # int32 [n]
    loss: np.ndarray  # bool [n]: True where the token is learned


def row_kind(row: Any, *, where: str) -> RowKind:
    """Which convention a row follows, from its keys."""
    if not isinstance(row, Mapping):
        raise BadRowError(f"{where}: a row is a JSON object, got {type(row).__name__}")
    has_chat = MESSAGES_KEY in row
    has_pair = PROMPT_KEY in row or COMPLETION_KEY in row
    if has_chat and not has_pair:
        return RowKind.CHAT
    if has_pair and not has_chat:
        return RowKind.PROMPT_COMPLETION
    what = "both" if has_chat else "neither"
    raise BadRowError(
        f"{where}: a row holds either {MESSAGES_KEY!r} (a list of {{role, content}} messages) or "
        f"{PROMPT_KEY!r} and {COMPLETION_KEY!r} (strings); this one holds {what} (keys "
        f"{sorted(map(str, row))})")


def check_messages(messages: Any, *, where: str, key: str = MESSAGES_KEY,
                   needs_assistant: bool = True) -> None:
    """`messages` (the row's `key`) is a non-empty list of {role, content} messages; a chat row's
    also holds an assistant message (`needs_assistant`), else nothing would be learned."""
    label = "message" if key == MESSAGES_KEY else f"{key!r} message"
    if not isinstance(messages, list):
        raise BadRowError(f"{where}: {key!r} must be a list of messages, got "
                          f"{type(messages).__name__}")
    if not messages:
        raise BadRowError(f"{where}: an empty conversation ({key!r} is [])")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRowError(f"{where}: {label} {index} is not an object with role and content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise BadRowError(f"{where}: {label} {index} has no role (a non-empty string)")
        if not isinstance(content, str):
            got = "none" if content is None else f"a {type(content).__name__}"
            raise BadRowError(f"{where}: {label} {index} ({role}) needs a string content, got "
                              f"{got}")
    if needs_assistant and not any(message["role"] == ASSISTANT_ROLE for message in messages):
        raise BadRowError(f"{where}: no {ASSISTANT_ROLE!r} message, so nothing to learn (roles "
                          f"{[message['role'] for message in messages]})")


def prompt_bos_id(tokenizer: TextTokenizer) -> int | None:
    """The BOS a prompt starts with: the tokenizer's, where its own encoding adds it. A tokenizer
    that does not say (SentencePiece; `adds_bos` None) gets none: the caller decides then."""
    return tokenizer.bos_id if tokenizer.adds_bos else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowEncoder:
    """Rows -> ChatExamples with one tokenizer and chat template (None: chat rows are refused).

    `bos_id` starts every prompt of a prompt/completion row (`prompt_bos_id(tokenizer)` is
    transformers' choice); chat rows get only what their template writes.
    """

    tokenizer: TextTokenizer
    template: ChatTemplate | None
    bos_id: int | None

    def encode(self, row: Any, *, where: str) -> ChatExample:
        """The example of one row (`where` names it in errors: a file and row number)."""
        if row_kind(row, where=where) is RowKind.CHAT:
            return self.encode_messages(row[MESSAGES_KEY], where=where)
        return self.encode_prompt_completion(prompt=row.get(PROMPT_KEY),
                                             completion=row.get(COMPLETION_KEY), where=where)

    def conversation_ids(self, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool, where: str) -> list[int]:
        """transformers' `apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`:
        the rendered text, no special tokens added to it (a prompt to generate from, too)."""
        if self.template is None:
            raise BadRowError(f"{where}: a chat row, but no chat template was given")
        text = self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    where=where)
        return self.tokenizer.encode(text)

    def encode_messages(self, messages: Any, *, where: str) -> ChatExample:
        """A conversation's ids and its assistant tokens (the module docstring's convention)."""
        if self.template is None:
            raise BadRowError(f"{where}: a chat row, but no chat template was given")
        check_messages(messages, where=where)
        ids = self.conversation_ids(messages, add_generation_prompt=False, where=where)
        loss = np.zeros(len(ids), dtype=bool)
        for index, message in enumerate(messages):
            if message["role"] != ASSISTANT_ROLE:
                continue
            before = self.conversation_ids(messages[:index], add_generation_prompt=True,
                                           where=where)
            through = ids if index == len(messages) - 1 else self.conversation_ids(
                messages[:index + 1], add_generation_prompt=False, where=where)
            if through[:len(before)] != before:
                raise BadRowError(
                    f"{where}: message {index} ({ASSISTANT_ROLE}): the conversation before it "
                    "with the generation prompt is not a prefix of the conversation through it "
                    f"(in tokens), so its tokens are not known; the chat template "
                    f"({self.template.origin}) cannot mark what the assistant says")
            if ids[:len(through)] != through:
                raise BadRowError(
                    f"{where}: message {index} ({ASSISTANT_ROLE}): the conversation through it is "
                    "not a prefix of the whole conversation (in tokens): the chat template "
                    f"({self.template.origin}) writes it differently once later messages follow")
            loss[len(before):len(through)] = True
        return learned_example(ids, loss)

    def encode_prompt_completion(self, *, prompt: Any, completion: Any,
                                 where: str) -> ChatExample:
        """[BOS] + prompt + completion + EOS; the completion and the EOS learned."""
        for key, value in ((PROMPT_KEY, prompt), (COMPLETION_KEY, completion)):
            if not isinstance(value, str):
                got = "missing" if value is None else f"a {type(value).__name__}"
                raise BadRowError(f"{where}: {key!r} must be a string, got {got}")
        if not completion:
            raise BadRowError(f"{where}: an empty {COMPLETION_KEY!r}, so nothing to learn")
        if self.tokenizer.eos_id < 0:
            raise VocabError(f"{self.tokenizer.path} defines no EOS token, which ends every "
                             "completion")
        prompt_ids = [] if self.bos_id is None else [self.bos_id]
        prompt_ids += self.tokenizer.encode(prompt)
        completion_ids = [*self.tokenizer.encode(completion), self.tokenizer.eos_id]
        loss = np.zeros(len(prompt_ids) + len(completion_ids), dtype=bool)
        loss[len(prompt_ids):] = True
        return learned_example(prompt_ids + completion_ids, loss)


def learned_example(ids: list[int], loss: np.ndarray) -> ChatExample:
    """The example of `ids`, learned where `loss` says except at token 0."""
    loss[:1] = False  # nothing before token 0 predicts it
    return ChatExample(ids=np.asarray(ids, dtype=np.int32), loss=loss)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedRow:
    """One row of `seq_len` and the examples it covers: [first_example, next_example) of the
    input, the ones it holds and the dropped ones that came after them (or before the first row's
    first). Packing again from `next_example` gives the rows that follow, so it is the position a
    resumed pipeline restarts from."""

    targets: np.ndarray  # int32 [seq_len], 0 on padding
    loss: np.ndarray  # bool [seq_len]
    segment_ids: np.ndarray  # int32 [seq_len], 1.. per example, 0 on padding
    positions: np.ndarray  # int32 [seq_len], from 0 per example, 0 on padding
    first_example: int
    next_example: int
    examples: int  # packed into this row
    dropped: int  # longer than seq_len and dropped (Overlong.DROP)
    truncated: int  # longer than seq_len and cut (Overlong.TRUNCATE)


@dataclasses.dataclass(kw_only=True)
class RowBuilder:
    """A row being filled: its examples in order (segments 1, 2, ...) and what it counts."""

    first_example: int
    parts: list[ChatExample] = dataclasses.field(default_factory=list)
    used: int = 0
    dropped: int = 0
    truncated: int = 0

    def row(self, *, seq_len: int, next_example: int) -> PackedRow:
        targets = np.zeros(seq_len, dtype=np.int32)
        loss = np.zeros(seq_len, dtype=bool)
        segment_ids = np.zeros(seq_len, dtype=np.int32)
        positions = np.zeros(seq_len, dtype=np.int32)
        start = 0
        for segment, part in enumerate(self.parts, start=1):
            stop = start + part.ids.shape[0]
            targets[start:stop] = part.ids
            loss[start:stop] = part.loss
            segment_ids[start:stop] = segment
            positions[start:stop] = np.arange(stop - start, dtype=np.int32)
            start = stop
        return PackedRow(targets=targets, loss=loss, segment_ids=segment_ids, positions=positions,
                         first_example=self.first_example, next_example=next_example,
                         examples=len(self.parts), dropped=self.dropped,
                         truncated=self.truncated)


def pack_examples(examples: Iterable[ChatExample], *, seq_len: int, overlong: Overlong,
                  first_example: int = 0) -> Iterator[PackedRow]:
    """Rows of `seq_len`, the examples greedily in order (the module docstring); `first_example`
    numbers the first input (the `next_example` a resumed pipeline restarts from).

    A pure function of its inputs. A row is yielded once the next example that does not fit is
    seen (or the input ends). Nothing is yielded when no example is kept (all dropped): the caller
    says so, since an input that loops over epochs would otherwise never yield.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    overlong = Overlong(overlong)
    current = RowBuilder(first_example=first_example)
    end = first_example  # past the last example seen
    for index, example in enumerate(examples, start=first_example):
        end = index + 1
        length = example.ids.shape[0]
        if length != example.loss.shape[0]:
            raise ValueError(f"example {index}: {length} ids but {example.loss.shape[0]} loss "
                             "flags")
        cut = length > seq_len
        if cut and overlong is Overlong.DROP:
            current.dropped += 1
            continue
        if cut:
            example = ChatExample(ids=example.ids[:seq_len], loss=example.loss[:seq_len])
            length = seq_len
        if current.parts and current.used + length > seq_len:
            yield current.row(seq_len=seq_len, next_example=index)
            current = RowBuilder(first_example=index)
        current.parts.append(example)
        current.used += length
        current.truncated += int(cut)
    if current.parts:
        yield current.row(seq_len=seq_len, next_example=end)


def next_token_batch(rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
    """[len(rows), seq_len] features in transformers' causal-LM layout (module docstring):
    `inputs` the tokens, `targets` and `weights` the next token of the same example and whether
    it is learned (0 at an example's last token and on padding)."""
    if not rows:
        raise ValueError("a batch needs at least one row")
    tokens = np.stack([row.targets for row in rows]).astype(np.int32)
    segment_ids = np.stack([row.segment_ids for row in rows]).astype(np.int32)
    learned = np.stack([row.loss for row in rows])
    same_example = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    targets = np.zeros_like(tokens)
    targets[:, :-1] = np.where(same_example, tokens[:, 1:], 0)
    weights = np.zeros(tokens.shape, np.float32)
    weights[:, :-1] = same_example & learned[:, 1:]
    return {"inputs": tokens, "targets": targets, "weights": weights,
            "positions": np.stack([row.positions for row in rows]).astype(np.int32),
            "segment_ids": segment_ids}
