"""Chat templates: a model's Jinja ``chat_template`` rendered the way Hugging Face transformers renders it.

transformers compiles the template in an ``ImmutableSandboxedEnvironment`` (``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension and a ``{% generation %}`` block), with a ``raise_exception`` global, a
``strftime_now`` global, a ``namespace`` that refuses underscore names and a ``tojson`` filter that keeps
non-ASCII text; it renders with the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``
and the special tokens (``bos_token``, ``eos_token``, ...). Messages are copied to plain dicts and lists first,
keys whose value is None dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError, TokenizerError

# The names a message's reasoning comes under; transformers fills the first two from whichever is given.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class TemplateRaised(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises: the template rejected its input."""


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' marker of assistant text; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

    def render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class GuardedNamespace(jinja2.utils.Namespace):
    """``namespace()`` without underscore names: a template from a model repository is untrusted code, and the
    sandbox guards attribute reads, not a namespace's stored names."""

    def __init__(*args: Any, **kwargs: Any) -> None:   # Namespace's signature: ``self`` may be a stored name
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            GuardedNamespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        GuardedNamespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")


def raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = GuardedNamespace
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template, with the special tokens it sees (``bos_token``, ``eos_token``, ...)."""

    source: str
    origin: str                                   # the file it was read from
    special_tokens: Mapping[str, str]
    template: jinja2.Template = field(compare=False, repr=False)


def compile_chat_template(source: str, origin: str, special_tokens: Mapping[str, str]) -> ChatTemplate:
    """The template compiled; TokenizerError naming ``origin`` when it does not compile."""
    try:
        template = make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{origin}: the chat template does not compile (line {e.lineno}: "
                             f"{one_line(e.message)})") from None
    return ChatTemplate(source, origin, dict(special_tokens), template)


def template_source(value: Any, origin: str) -> str | None:
    """``chat_template`` as the config gives it: a string, or a list of ``{name, template}`` (the "default" one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(f"{origin}: chat_template list entries must be {{name, template}} strings")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise TokenizerError(f"{origin}: chat_template names {sorted(named)} but no 'default' template")
        return named["default"]
    raise TokenizerError(f"{origin}: chat_template must be a string or a list of {{name, template}}, "
                         f"not {type(value).__name__}")


def plain_data(value: Any, where: str) -> Any:
    """``value`` rebuilt from plain JSON types (dict, list, str, numbers), as the template may only see those."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):   # subclasses (enums, ...) back to the base type
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {str(k): plain_data(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where} is not JSON data (a {type(value).__name__})")


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them; ChatTemplateError naming the first one that is not a message."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is a {type(message).__name__}, not a {{role, content}} object")
        # as transformers: a key whose value is None is left out (OpenAI clients send content=None with tool_calls)
        m = {str(k): plain_data(v, f"messages[{i}].{k}") for k, v in message.items() if v is not None}
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ChatTemplateError(f"messages[{i}] has no role (a non-empty string)")
        if "content" not in m and "tool_calls" not in m:
            raise ChatTemplateError(f"messages[{i}] ({m['role']}) has no content")
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(template: ChatTemplate | None, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True) -> str:
    """The chat as the model's template renders it; ChatTemplateError (one line) when it cannot be rendered."""
    if template is None:
        raise ChatTemplateError("this model has no chat template (no chat_template in tokenizer_config.json "
                                "and no chat_template.jinja)")
    chat = chat_messages(messages)
    try:
        return template.template.render(messages=chat, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **template.special_tokens)
    except TemplateRaised as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {one_line(e.message)}") from None
    except Exception as e:  # anything a template can raise on unexpected input (undefined, type, sandbox)
        raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: "
                                f"{one_line(e)})") from None
