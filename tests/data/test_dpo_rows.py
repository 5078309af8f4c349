"""Preference rows as pairs of examples (data/dpo_rows.py): the ids and learned tokens against
transformers' tokenizer and `apply_chat_template`, computed here; the one-pair-a-row batch written
out by hand; cutting a long pair; bad rows."""

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from transformers import AutoTokenizer

from paxlite.data.chat_rows import ChatExample, RowEncoder
from paxlite.data.chat_template import BadRowError
from paxlite.data.dpo_rows import (
    PreferencePair,
    encode_pair,
    pair_batch,
    pair_row,
    side_length,
)
from paxlite.errors import UserError

# the tokenizers (fixtures, looked up by name) and their encoders
from tests.data.test_chat_rows import _encoder, chatml, llama3  # noqa: F401

STRING_ROWS = [
    {"prompt": "What is two plus two?", "chosen": " Four.", "rejected": " Five, or so."},
    {"prompt": "", "chosen": "Hello there", "rejected": "why is the sky blue?\n"},
]
CONVERSATION_ROWS = [
    {"prompt": [{"role": "user", "content": "Hello there, how are you?"}],
     "chosen": [{"role": "assistant", "content": "I am fine, thanks for asking."}],
     "rejected": [{"role": "assistant", "content": "Why?"}]},
    {"prompt": [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "Four."},
                {"role": "user", "content": "And the sky?"}],
     "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "The king said: café 汉字."}]},
]


def _learned(length, first):
    """Learned from `first` on, never token 0."""
    return [0 < i and i >= first for i in range(length)]


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_pairs_equal_transformers(family, request):
    directory = request.getfixturevalue(family)
    ours, theirs = _encoder(directory), AutoTokenizer.from_pretrained(directory)
    for row in STRING_ROWS:  # each side the prompt/completion row (prompt, side)
        pair = encode_pair(ours, row, where="t")
        prompt = theirs(row["prompt"])["input_ids"]
        for side, example in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            completion = theirs(row[side], add_special_tokens=False)["input_ids"]
            assert example.ids.tolist() == prompt + completion + [theirs.eos_token_id]
            assert example.loss.tolist() == _learned(len(example.ids), len(prompt))

    def ids(messages, **more):
        return theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **more)

    for row in CONVERSATION_ROWS:  # learned: what the side adds after the generation prompt
        pair = encode_pair(ours, row, where="t")
        before = ids(row["prompt"], add_generation_prompt=True)
        for side, example in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            whole = ids(row["prompt"] + row[side])
            assert example.ids.tolist() == whole and example.ids.dtype == np.int32
            assert example.loss.tolist() == _learned(len(whole), len(before))
            end = "<|im_end|>\n" if family == "chatml" else "<|eot_id|>"
            content = row[side][0]["content"]
            assert theirs.decode(example.ids[example.loss].tolist()) == content + end


def _pair(chosen, rejected):
    return PreferencePair(**{
        side: ChatExample(ids=np.asarray(ids, np.int32), loss=np.asarray(learned, bool))
        for side, (ids, learned) in (("chosen", chosen), ("rejected", rejected))})


def test_one_pair_a_row_by_hand():
    pairs = [_pair(([11, 12, 13], [0, 1, 1]), ([21, 22], [0, 1])),
             _pair(([31, 32, 33, 34, 35], [0, 0, 1, 1, 1]), ([41, 42, 43, 44], [0, 0, 1, 1]))]
    rows = [pair_row(pair, seq_len=8, index=index) for index, pair in enumerate(pairs)]
    assert [(r.first_example, r.next_example, r.examples, r.truncated) for r in rows] == [
        (0, 1, 2, 0), (1, 2, 2, 1)]
    batch = pair_batch(rows)
    assert sorted(batch) == ["inputs", "positions", "segment_ids", "targets", "weights"]
    # the second pair is 9 tokens: each side keeps its first 4 (4 + 4 <= 8 < 5 + 4)
    assert batch["inputs"].tolist() == [[11, 12, 13, 21, 22, 0, 0, 0],
                                        [31, 32, 33, 34, 41, 42, 43, 44]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]]
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch["targets"].tolist() == [[12, 13, 0, 22, 0, 0, 0, 0],
                                         [32, 33, 34, 0, 42, 43, 44, 0]]
    assert batch["weights"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 1, 1, 0]]
    assert batch["weights"].dtype == np.float32
    # the learned sums the loss takes: chosen = segment 1, rejected = segment 2
    chosen = (batch["weights"] * (batch["segment_ids"] == 1)).sum(axis=1)
    rejected = (batch["weights"] * (batch["segment_ids"] == 2)).sum(axis=1)
    assert chosen.tolist() == [2, 2] and rejected.tolist() == [1, 2]


@pytest.mark.parametrize("chosen, rejected, seq_len, keep", [
    (3, 2, 8, 3),  # fits: nothing cut
    (5, 4, 8, 4),
    (2, 9, 8, 6),  # the short side whole, the rest to the long one
    (9, 7, 8, 4),  # both long: half the row each
    (9, 7, 7, 3),
])
def test_a_long_pair_keeps_the_longest_equal_prefixes(chosen, rejected, seq_len, keep):
    pair = _pair((range(chosen), [1] * chosen), (range(rejected), [1] * rejected))
    assert side_length(pair, seq_len=seq_len) == keep
    fits = [length for length in range(1, 20)
            if min(chosen, length) + min(rejected, length) <= seq_len]
    assert min(keep, max(chosen, rejected)) == min(max(fits), max(chosen, rejected))
    row = pair_row(pair, seq_len=seq_len, index=0)
    assert (row.segment_ids == 1).sum() == min(chosen, keep)
    assert (row.segment_ids == 2).sum() == min(rejected, keep)


def _error(encoder, row):
    with pytest.raises(BadRowError) as caught:
        encode_pair(encoder, row, where="pairs.jsonl:7")
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert message.startswith("pairs.jsonl:7: ")
    return message


def test_bad_pairs_are_one_line_naming_the_row_and_side(request, tmp_path):
    directory = request.getfixturevalue("chatml")
    encoder = _encoder(directory)
    strings, messages = STRING_ROWS[0], CONVERSATION_ROWS[0]
    assert "this one lacks ['rejected']" in _error(encoder, {"prompt": "a", "chosen": "b"})
    assert "a row is a JSON object, got list" in _error(encoder, [1])
    assert "all strings or all lists of messages; got prompt a str, chosen a list" in _error(
        encoder, {**strings, "chosen": messages["chosen"]})
    assert "an empty 'rejected'" in _error(encoder, {**strings, "rejected": ""})
    assert "an empty conversation ('chosen' is [])" in _error(encoder, {**messages, "chosen": []})
    assert "'rejected' message 0 (assistant) needs a string content, got a int" in _error(
        encoder, {**messages, "rejected": [{"role": "assistant", "content": 3}]})
    no_template = RowEncoder(tokenizer=encoder.tokenizer, template=None, bos_id=None)
    assert "no chat template was given" in _error(no_template, messages)

    last_marked = tmp_path / "last.jinja"  # writes the last message differently
    last_marked.write_text("{% for m in messages %}{% if loop.last %}[last]{% endif %}"
                           "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    message = _error(_encoder(directory, template_file=str(last_marked)), messages)
    assert message.startswith("pairs.jsonl:7: 'chosen': the prompt with the generation prompt "
                              "is not a prefix") and str(last_marked) in message
    users_only = tmp_path / "users.jinja"  # renders no assistant turn: nothing to learn
    users_only.write_text("{% for m in messages %}{% if m.role == 'user' %}<|im_start|>"
                          "{{ m.content }}<|im_end|>{% endif %}{% endfor %}")
    assert "'chosen' adds no token to learn after the prompt" in _error(
        _encoder(directory, template_file=str(users_only)), messages)
