"""A model's chat template: where it is found and how it renders, as transformers does both.

Chat SFT must train on exactly the token ids the model will see when it is served through
transformers' `apply_chat_template` (or anything that copies it: vLLM, lm_eval's
`--apply_chat_template`), so the template is found and rendered the same way:

- Found: a template file the user names; else, beside the tokenizer, `chat_template.jinja` (the
  "default" template) and `additional_chat_templates/NAME.jinja`, which take priority over the
  `chat_template` of tokenizer_config.json (a string, or a list of `{"name", "template"}`). When a
  tokenizer has several, the one named "default" is used unless another is asked for by name.
- Rendered: Jinja2's immutable sandbox (templates come from the Hub and are untrusted), with
  trim_blocks and lstrip_blocks; `raise_exception(message)`, `strftime_now(format)`, a `dict` and a
  `namespace` that refuses underscore names; `tojson` as `json.dumps` (no HTML escaping, unicode
  kept); a `{% generation %}` block rendered as its body. The variables are `messages` (each
  message's None-valued keys dropped; a reasoning under `reasoning_content`, `thinking` or
  `reasoning` given under the first two as well), `add_generation_prompt`, `tools` and
  `documents` (None) and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...).

`strftime_now` reads a clock (LLaMA-3.1's template writes today's date into its system turn), so
the rendered text of such a template depends on the day; `ChatTemplate` takes the clock as an
argument for runs that must render the same text when resumed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from paxlite.data.errors import DatasetError
from paxlite.errors import NotFoundError, UserError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_TEMPLATE_NAME = "default"
TEMPLATE_SETTING = "--fdl.CHAT_TEMPLATE=FILE"
MIN_JINJA_VERSION = (3, 1, 6)  # older versions have known sandbox escapes
# Names a message's reasoning comes under; templates read the first (and gpt-oss's `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to a final message's content to find where it ends in the rendered text (transformers'
# continue_final_message uses the same marker)
_CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(UserError, ValueError):
    """No chat template where one was looked for, or one that is not valid Jinja."""


class BadRowError(DatasetError):
    """A row that cannot become a training example (an empty conversation, a bad role or content,
    a role its chat template refuses, ...). A caller may skip and count such rows."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TemplateSource:
    text: str
    origin: str  # where it came from, for messages: a file, or a config file and template name


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{path} is not UTF-8 text: {e}") from None


def _templates_in_config(path: str) -> dict[str, str] | str | None:
    """tokenizer_config.json's `chat_template`: a string, or named templates; None if absent."""
    try:
        config = json.loads(_read_text(path))
    except (UnicodeDecodeError, ValueError) as e:
        raise ChatTemplateError(f"{path} is not readable JSON: {e}") from None
    value = config.get("chat_template") if isinstance(config, dict) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(entry, dict) and isinstance(
            entry.get("name"), str) and isinstance(entry.get("template"), str) for entry in value):
        return {entry["name"]: entry["template"] for entry in value}
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    raise ChatTemplateError(f"{path}: chat_template is neither a string nor a list of "
                            '{"name": ..., "template": ...} objects')


def _templates_beside(directory: str) -> tuple[dict[str, str] | str | None, str]:
    """The templates a tokenizer directory holds, with transformers' priority, and their origin."""
    named: dict[str, str] = {}
    origins = []
    jinja_file = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_file):
        named[DEFAULT_TEMPLATE_NAME] = _read_text(jinja_file)
        origins.append(jinja_file)
    extra_dir = os.path.join(directory, ADDITIONAL_TEMPLATES_DIR)
    extra: list[str] = []
    if os.path.isdir(extra_dir):
        extra = sorted(name for name in os.listdir(extra_dir) if name.endswith(".jinja")
                       and os.path.isfile(os.path.join(extra_dir, name)))
    for name in extra:
        named[name.removesuffix(".jinja")] = _read_text(os.path.join(extra_dir, name))
    if extra:
        origins.append(extra_dir)
    if named:
        if list(named) == [DEFAULT_TEMPLATE_NAME]:
            return named[DEFAULT_TEMPLATE_NAME], jinja_file
        return named, " and ".join(origins)
    config = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if os.path.isfile(config):
        return _templates_in_config(config), f"{config}'s chat_template"
    return None, ""


def find_chat_template(*, tokenizer_path: str | os.PathLike, template_file: str | None = None,
                       template_name: str | None = None) -> TemplateSource:
    """The template text to render chats with: `template_file` when given, else the tokenizer's
    (`tokenizer_path`: its file or directory), chosen by `template_name` (default: "default")."""
    if template_file:
        path = os.path.abspath(os.path.expanduser(template_file))
        if not os.path.isfile(path):
            raise NotFoundError(f"no chat template file at {path}")
        return TemplateSource(text=_read_text(path), origin=path)
    directory = os.path.abspath(os.path.expanduser(os.fspath(tokenizer_path)))
    if not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    found, origin = _templates_beside(directory)
    if found is None:
        raise ChatTemplateError(
            f"no chat template in {directory} (looked for {CHAT_TEMPLATE_FILE}, "
            f"{ADDITIONAL_TEMPLATES_DIR}/*.jinja and chat_template in {TOKENIZER_CONFIG_FILE}); "
            f"pass one with {TEMPLATE_SETTING}")
    if isinstance(found, str):
        if template_name not in (None, DEFAULT_TEMPLATE_NAME):
            raise ChatTemplateError(f"{origin} is one template, not one named {template_name!r}")
        return TemplateSource(text=found, origin=origin)
    name = template_name or DEFAULT_TEMPLATE_NAME
    if name not in found:
        raise ChatTemplateError(
            f"{origin} holds chat templates {sorted(found)}, none named {name!r}; name one of "
            f"them, or pass a template file with {TEMPLATE_SETTING}")
    return TemplateSource(text=found[name], origin=f"{origin} ({name!r})")


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ChatTemplateError("chat templates need the jinja2 package: pip install "
                                "'jinja2>=3.1.6'") from None
    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < MIN_JINJA_VERSION:
        raise ChatTemplateError(f"chat templates need jinja2>=3.1.6 (older versions have known "
                                f"sandbox escapes); this is {jinja2.__version__}")
    return jinja2


def _environment(*, clock: Callable[[], datetime.datetime]):
    """A sandbox with the globals and filters transformers gives chat templates."""
    jinja2 = _jinja()

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' masks;
        here it renders its body (the masks come from rendering prefixes instead)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format_):
        return clock().strftime(format_)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself (no attribute tricks)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that stores no underscore names (a way into Python's internals)."""

        def __init__(*args, **kwargs):  # Namespace's signature: `self` may be a key
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore names on a namespace: {name!r}")

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                               dict=TemplateDict(), namespace=TemplateNamespace)
    return environment


def _plain(value: Any) -> Any:
    """A fresh copy of JSON-like data (the template never sees or changes the caller's)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: None-valued keys dropped, the
    reasoning given under every name templates read it by."""
    out = []
    for message in messages:
        message = {key: _plain(item) for key, item in message.items() if item is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with."""

    def __init__(self, *, source: TemplateSource, special_tokens: Mapping[str, str],
                 clock: Callable[[], datetime.datetime] = datetime.datetime.now):
        jinja2 = _jinja()
        self.origin = source.origin
        self.text = source.text
        self._special_tokens = dict(special_tokens)
        self._template_error = jinja2.exceptions.TemplateError
        try:
            self._template = _environment(clock=clock).from_string(source.text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template from {self.origin} is not valid Jinja: "
                                    f"line {e.lineno}: {e.message}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               where: str, continue_final_message: bool = False) -> str:
        """The text transformers' `apply_chat_template(messages, tokenize=False)` returns; a
        template's `raise_exception` (or any template error) is a BadRowError naming `where`.

        `continue_final_message` (transformers' argument of that name): the text stops right
        after the last message's content, left open for the model to continue (lm_eval's
        `--apply_chat_template` scores a continuation so). Found as transformers finds it: a
        marker appended to that content, cut off after rendering."""
        messages = template_messages(messages)
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise BadRowError(f"{where}: continuing the final message needs one with a text "
                                  "content")
            final = messages[-1]["content"]
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_MARKER}
        text = self._render(messages, add_generation_prompt=add_generation_prompt, where=where)
        if not continue_final_message:
            return text
        marker = _CONTINUE_MARKER.strip()
        if final.strip() not in text or marker not in text:
            raise BadRowError(f"{where}: the chat template ({self.origin}) drops part of the "
                              "final message, so it cannot be continued")
        at = text.rindex(marker)
        if text[at:at + len(_CONTINUE_MARKER)] == _CONTINUE_MARKER:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content's trailing space

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                where: str) -> str:
        try:
            return self._template.render(
                **self._special_tokens, messages=messages, tools=None,
                documents=None, add_generation_prompt=add_generation_prompt)
        except self._template_error as e:
            # raise_exception raises the base class; the sandbox and Jinja raise its subclasses
            verdict = ("refused it" if type(e) is self._template_error
                       else f"failed on it ({type(e).__name__})")
            raise BadRowError(f"{where}: the chat template ({self.origin}) {verdict}: "
                              f"{e.message or 'no message'}") from None


class TokenizerWithSpecials(Protocol):
    path: str  # its file; the templates beside it are found from there
    special_tokens: dict[str, str]


def chat_template_for(tokenizer: TokenizerWithSpecials, *, template_file: str | None = None,
                      template_name: str | None = None,
                      clock: Callable[[], datetime.datetime] = datetime.datetime.now
                      ) -> ChatTemplate:
    """The template a tokenizer's chats are rendered with (`find_chat_template`), rendered with
    its special tokens (`paxlite.data.tokenizer.Tokenizer`)."""
    source = find_chat_template(tokenizer_path=tokenizer.path, template_file=template_file,
                                template_name=template_name)
    return ChatTemplate(source=source, special_tokens=tokenizer.special_tokens, clock=clock)
