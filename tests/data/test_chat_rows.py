"""Chat templates, chat and prompt/completion rows and their packing, against transformers'
`apply_chat_template` and tokenizer on tiny tokenizers built here, and packed rows written by hand.

The templates are written here in the styles of the families (ChatML as Qwen writes it, LLaMA-3's
headers after `{{ bos_token }}`, Gemma's turns with `raise_exception`), each stored the way
checkpoints carry them: chat_template.jinja, a string in tokenizer_config.json, or the list of
named templates there."""

import datetime
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from paxlite.data.chat_rows import (
    ChatExample,
    Overlong,
    RowEncoder,
    next_token_batch,
    pack_examples,
    prompt_bos_id,
)
from paxlite.data.chat_template import (
    BadRowError,
    ChatTemplate,
    ChatTemplateError,
    chat_template_for,
    find_chat_template,
)
from paxlite.data.tokenizer import Tokenizer
from paxlite.errors import UserError

CORPUS = ["Hello there, how are you today? I am fine, thanks for asking.",
          "The king said: what is two plus two? The answer is four.",
          "Système, café, 汉字 and a question: why is the sky blue?"] * 20

CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA = (  # one line, as Gemma's
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

# tojson as transformers defines it (no HTML escaping, unicode kept), namespace, dict, generation
TOOLS_STYLE = """{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
{%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}<|im_end|>
{%- endgeneration %}
{% else %}{{ dict(text=message.content, n=ns.turns) | tojson }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you?"},
     {"role": "assistant", "content": "I am fine, thanks for asking."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "Why is the sky <blue> & \"café\"?"},
     {"role": "assistant", "content": "Rayleigh 汉字.", "reasoning_content": None}],
    [{"role": "user", "content": "Say <|im_end|> or <end_of_turn> literally."},
     {"role": "assistant", "content": "  spaced  \n"},
     {"role": "user", "content": "Thanks"}],
]
PAIRS = [("What is two plus two?", " Four."), ("", "Hello there"),
         ("The king said:\n", "why is the sky blue?\n")]


def _save(directory, *, specials, bos=None, post_bos=False, **config):
    """A byte-level BPE with `specials` first, saved by transformers with `config`."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials, show_progress=False))
    if post_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, specials.index(bos))])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos,
                            **config).save_pretrained(directory)
    return str(directory)


def _set_config(directory, **fields):
    path = f"{directory}/tokenizer_config.json"
    with open(path) as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """Qwen's way: no BOS, EOS <|im_end|>, the template in chat_template.jinja."""
    return _save(tmp_path_factory.mktemp("chatml"),
                 specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """LLaMA-3's way: BOS added by the post-processor and written by the template, which is a
    string in tokenizer_config.json."""
    directory = _save(tmp_path_factory.mktemp("llama3"), specials=[
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>"], bos="<|begin_of_text|>", post_bos=True, eos_token="<|eot_id|>")
    _set_config(directory, chat_template=LLAMA3)
    return directory


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma's way: <bos> added and written by the template; named templates in the config."""
    directory = _save(tmp_path_factory.mktemp("gemma"), specials=[
        "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>",
        "<|im_end|>"], bos="<bos>", post_bos=True, eos_token="<eos>", pad_token="<pad>")
    _set_config(directory, chat_template=[{"name": "default", "template": GEMMA},
                                          {"name": "tool_use", "template": TOOLS_STYLE}])
    return directory


def _encoder(directory, **template_choice):
    tokenizer = Tokenizer(directory)
    return RowEncoder(tokenizer=tokenizer, template=chat_template_for(tokenizer, **template_choice),
                      bos_id=prompt_bos_id(tokenizer))


def _reference_mask(theirs, messages, **kwargs):
    """Assistant tokens computed with transformers: what each assistant message adds over the
    conversation before it with the generation prompt (token 0 excluded)."""
    def ids(part, **more):
        return theirs.apply_chat_template(part, tokenize=True, return_dict=False, **kwargs, **more)

    whole = ids(messages)
    mask = np.zeros(len(whole), dtype=bool)
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            before, through = ids(messages[:index], add_generation_prompt=True), ids(
                messages[:index + 1])
            assert through[:len(before)] == before and whole[:len(through)] == through
            mask[len(before):len(through)] = True
    mask[0] = False
    return whole, mask


@pytest.mark.parametrize("family", ["chatml", "llama3", "gemma"])
def test_rendering_ids_and_masks_equal_transformers(family, request):
    directory = request.getfixturevalue(family)
    ours, theirs = _encoder(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.tokenizer.special_tokens == theirs.special_tokens_map
    # Gemma's template refuses a system message
    conversations = CONVERSATIONS[::2] if family == "gemma" else CONVERSATIONS
    for number, messages in enumerate(conversations):
        for prompt in (False, True):
            text = ours.template.render(messages, add_generation_prompt=prompt, where="t")
            assert text == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.conversation_ids(messages, add_generation_prompt=prompt, where="t") == (
                theirs.apply_chat_template(messages, tokenize=True, return_dict=False,
                                           add_generation_prompt=prompt))
        # the last message left open to be continued (lm_eval's --apply_chat_template prefill),
        # its content with and without trailing space
        for tail in ("", " "):
            opened = [*messages[:-1], {**messages[-1],
                                       "content": messages[-1]["content"] + tail}]
            assert ours.template.render(opened, add_generation_prompt=False, where="t",
                                        continue_final_message=True) == (
                theirs.apply_chat_template(opened, tokenize=False, continue_final_message=True))
        example = ours.encode({"messages": messages}, where=f"row {number}")
        ids, mask = _reference_mask(theirs, messages)
        assert example.ids.tolist() == ids and example.ids.dtype == np.int32
        assert example.loss.tolist() == mask.tolist()
    if family == "llama3":  # the template writes BOS and the tokenizer adds no second one
        assert example.ids.tolist().count(theirs.bos_token_id) == 1


def test_learned_tokens_are_the_answer_and_the_end_of_turn(chatml, llama3, gemma):
    messages = CONVERSATIONS[0]
    answer = messages[1]["content"]
    for directory, learned in ((chatml, f"{answer}<|im_end|>\n"), (llama3, f"{answer}<|eot_id|>"),
                               (gemma, f"{answer}<end_of_turn>\n")):
        example = _encoder(directory).encode({"messages": messages}, where="row 0")
        theirs = AutoTokenizer.from_pretrained(directory)
        assert theirs.decode(example.ids[example.loss].tolist()) == learned


def test_named_templates_and_the_clock(gemma, llama3):
    theirs = AutoTokenizer.from_pretrained(gemma)
    tools = _encoder(gemma, template_name="tool_use")
    for messages in CONVERSATIONS:
        assert tools.template.render(messages, add_generation_prompt=True, where="t") == (
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       chat_template="tool_use"))
        ids, mask = _reference_mask(theirs, messages, chat_template="tool_use")
        example = tools.encode({"messages": messages}, where="t")
        assert (example.ids.tolist(), example.loss.tolist()) == (ids, mask.tolist())
    day = datetime.datetime(2026, 2, 3, 4, 5)
    tokenizer = Tokenizer(llama3)
    template = chat_template_for(tokenizer, clock=lambda: day)
    assert template.render(CONVERSATIONS[0], add_generation_prompt=False, where="t") == (
        AutoTokenizer.from_pretrained(llama3).apply_chat_template(
            CONVERSATIONS[0], tokenize=False, date_string="03 Feb 2026"))


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_prompt_completion_rows_equal_transformers(family, request):
    directory = request.getfixturevalue(family)
    ours, theirs = _encoder(directory), AutoTokenizer.from_pretrained(directory)
    for prompt, completion in PAIRS:
        example = ours.encode({"prompt": prompt, "completion": completion}, where="t")
        prompt_ids = theirs(prompt)["input_ids"]
        completion_ids = theirs(completion, add_special_tokens=False)["input_ids"]
        assert example.ids.tolist() == prompt_ids + completion_ids + [theirs.eos_token_id]
        learned = [False] * len(prompt_ids) + [True] * (len(completion_ids) + 1)
        learned[0] = False
        assert example.loss.tolist() == learned


def _example(ids, learned):
    return ChatExample(ids=np.asarray(ids, np.int32), loss=np.asarray(learned, bool))


EXAMPLES = [_example([11, 12, 13], [0, 1, 1]), _example([21, 22, 23, 24], [0, 0, 1, 1]),
            _example(range(31, 40), [0] * 6 + [1] * 3), _example([41, 42], [0, 1])]


def test_packing_by_hand():
    dropped = list(pack_examples(EXAMPLES, seq_len=8, overlong=Overlong.DROP))
    assert [(r.first_example, r.next_example, r.examples, r.dropped, r.truncated)
            for r in dropped] == [(0, 3, 2, 1, 0), (3, 4, 1, 0, 0)]
    batch = next_token_batch(dropped)
    assert sorted(batch) == ["inputs", "positions", "segment_ids", "targets", "weights"]
    # transformers' layout: the tokens are the input; position t is scored on token t + 1 of the
    # same example where that token is learned
    assert batch["inputs"].tolist() == [[11, 12, 13, 21, 22, 23, 24, 0],
                                        [41, 42, 0, 0, 0, 0, 0, 0]]
    assert batch["targets"].tolist() == [[12, 13, 0, 22, 23, 24, 0, 0], [42, 0, 0, 0, 0, 0, 0, 0]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["weights"].tolist() == [[1, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert batch["weights"].dtype == np.float32 and batch["targets"].dtype == np.int32

    cut = list(pack_examples(EXAMPLES, seq_len=8, overlong="truncate"))
    assert [(r.first_example, r.next_example, r.examples, r.dropped, r.truncated)
            for r in cut] == [(0, 2, 2, 0, 0), (2, 3, 1, 0, 1), (3, 4, 1, 0, 0)]
    assert cut[1].targets.tolist() == list(range(31, 39))
    assert cut[1].loss.tolist() == [0] * 6 + [1] * 2
    assert cut[1].segment_ids.tolist() == [1] * 8
    # resuming at a row's next_example gives the rows that followed it
    resumed = list(pack_examples(EXAMPLES[2:], seq_len=8, overlong="truncate", first_example=2))
    for row, again in zip(cut[1:], resumed, strict=True):
        assert row.first_example == again.first_example
        assert row.targets.tolist() == again.targets.tolist()
    assert list(pack_examples(EXAMPLES[2:3], seq_len=8, overlong="drop")) == []


def _error(encoder, row):
    with pytest.raises(BadRowError) as caught:
        encoder.encode(row, where="data.jsonl row 7")
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert message.startswith("data.jsonl row 7: ")
    return message


def test_bad_rows_are_one_line_naming_the_row(chatml, gemma, tmp_path):
    encoder = _encoder(chatml)
    assert "holds neither" in _error(encoder, {"text": "hi"})
    assert "holds both" in _error(encoder, {"messages": [], "prompt": "a", "completion": "b"})
    assert "empty conversation" in _error(encoder, {"messages": []})
    assert "message 1 has no role" in _error(encoder, {"messages": [
        {"role": "user", "content": "a"}, {"content": "b"}]})
    assert "message 0 (user) needs a string content, got a int" in _error(
        encoder, {"messages": [{"role": "user", "content": 5}]})
    assert "no 'assistant' message" in _error(encoder, {"messages": [
        {"role": "user", "content": "a"}]})
    assert "'completion' must be a string, got missing" in _error(encoder, {"prompt": "a"})
    assert "empty 'completion'" in _error(encoder, {"prompt": "a", "completion": ""})

    system_first = [{"role": "system", "content": "a"}, *CONVERSATIONS[0]]
    with pytest.raises(Exception, match="System role not supported"):
        AutoTokenizer.from_pretrained(gemma).apply_chat_template(system_first, tokenize=False)
    assert _error(_encoder(gemma), {"messages": system_first}).endswith(
        "refused it: System role not supported")

    escape = tmp_path / "escape.jinja"  # the sandbox keeps templates out of Python's internals
    escape.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    assert "failed on it (SecurityError): access to attribute '__class__'" in _error(
        _encoder(chatml, template_file=str(escape)), {"messages": CONVERSATIONS[0]})
    underscore = tmp_path / "underscore.jinja"
    underscore.write_text("{% set ns = namespace(_hidden=1) %}{{ messages[0].content }}")
    assert "cannot store underscore names" in _error(
        _encoder(chatml, template_file=str(underscore)), {"messages": CONVERSATIONS[0]})

    last_marked = tmp_path / "last.jinja"  # writes a message differently when it is the last
    last_marked.write_text("{% for m in messages %}{% if loop.last %}[last]{% endif %}"
                           "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    message = _error(_encoder(chatml, template_file=str(last_marked)),
                     {"messages": CONVERSATIONS[0]})
    assert "message 1 (assistant): the conversation before it with the generation prompt is " \
           "not a prefix" in message and str(last_marked) in message
    earlier_hidden = tmp_path / "hidden.jinja"  # drops earlier answers, as reasoning models do
    earlier_hidden.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
        "loop.last %}(earlier){% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert "message 1 (assistant): the conversation through it is not a prefix of the whole" in (
        _error(_encoder(chatml, template_file=str(earlier_hidden)),
               {"messages": [*CONVERSATIONS[0], *CONVERSATIONS[0]]}))


def test_finding_templates(chatml, gemma, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match=r"^no chat template in .*bare \(looked for "
                       r"chat_template.jinja, .*\); pass one with --fdl.CHAT_TEMPLATE=FILE$"):
        find_chat_template(tokenizer_path=str(bare))
    _set_config(bare, chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(ChatTemplateError, match=r"holds chat templates \['tool_use'\], none "
                       "named 'default'"):
        find_chat_template(tokenizer_path=str(bare / "tokenizer.json"))
    assert find_chat_template(tokenizer_path=str(bare), template_name="tool_use").text == "x"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="broken.jinja is not valid Jinja: line 1: "):
        ChatTemplate(source=find_chat_template(tokenizer_path=chatml, template_file=str(broken)),
                     special_tokens={})
    with pytest.raises(UserError, match="no chat template file at"):
        find_chat_template(tokenizer_path=chatml, template_file=str(tmp_path / "missing.jinja"))
    # chat_template.jinja wins over the config's, as in transformers
    both = shutil.copytree(chatml, tmp_path / "both")
    _set_config(both, chat_template="unused")
    assert AutoTokenizer.from_pretrained(both).chat_template == CHATML
    assert find_chat_template(tokenizer_path=str(both)).text == CHATML
    (both / "additional_chat_templates").mkdir()
    (both / "additional_chat_templates" / "tool_use.jinja").write_text(TOOLS_STYLE)
    theirs, ours = AutoTokenizer.from_pretrained(both), _encoder(both, template_name="tool_use")
    for name, template in (("default", CHATML), ("tool_use", TOOLS_STYLE)):
        assert theirs.chat_template[name] == template
        assert find_chat_template(tokenizer_path=both, template_name=name).text == template
    assert ours.template.render(CONVERSATIONS[1], add_generation_prompt=True, where="t") == (
        theirs.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True,
                                   chat_template="tool_use"))
    assert "gemma" in find_chat_template(tokenizer_path=gemma).origin
