"""The API's request bodies and their checks: every bad input becomes an :class:`ApiError` naming its field.

Bodies are parsed strictly (no "5" for 5) and unknown fields are refused (``extra="forbid"``), so a client
that relies on a field this server ignores hears about it. :func:`parse_body` turns a body into a
:class:`Completion` or :class:`Chat` model; :func:`sampling_for` checks what needs the tokenized prompt (the
context) and makes the engine's :class:`SamplingParams`. Error objects follow OpenAI's form:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling import SamplingParams

MAX_STOPS = 16
SEED_LIMIT = 2**63
# OpenAI's default for the legacy completions endpoint; chat defaults to the rest of the context
COMPLETION_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An error response: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)   # -1 or 0: off (vLLM's convention and the engine's)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: bool = False       # vLLM's extension: generate past EOS

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class Completion(Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        return {"role": self.role, "content": text or "", **({"name": self.name} if self.name else {})}


class Chat(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


Body = TypeVar("Body", Completion, Chat)

# what a field whose type is a union expects, for its error message
EXPECTED = {"prompt": "a string, an array of one string, or an array of token ids",
            "stop": "a string or an array of strings", "content": "a string or an array of text parts",
            "max_tokens": "an integer", "max_completion_tokens": "an integer", "seed": "an integer",
            "logprobs": "not set", "top_logprobs": "not set"}
FIELD_NAMES = frozenset(name for m in (StreamOptions, Completion, Chat, Message, TextPart) for name in m.model_fields)


def param_of(loc: tuple[Any, ...]) -> str:
    """The field a pydantic error location names (``messages[0].role``), without union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FIELD_NAMES:
            out += f".{part}" if out else part
        else:
            break
    return out


def parse_body(cls: type[Body], raw: bytes) -> Body:
    """The body as ``cls``, or ApiError 400 naming the first bad field."""
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e) from None
    check_body(body)
    return body


def from_validation(e: ValidationError) -> ApiError:
    errors = e.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "the body must be a JSON object")
    if first["type"] == "extra_forbidden":
        inside, name = param_of(first["loc"][:-1]), str(first["loc"][-1])
        param = f"{inside}.{name}" if inside else name
        return ApiError(400, f"unknown or unsupported field: {param!r}", param)
    param = param_of(first["loc"])
    if first["type"] == "missing":
        return ApiError(400, f"field {param!r} is required", param)
    same = [er for er in errors if param_of(er["loc"]) == param]
    leaf = param.rsplit(".", 1)[-1].split("[")[0]
    if len(same) > 1 and leaf in EXPECTED:
        return ApiError(400, f"{param}: must be {EXPECTED[leaf]}", param)
    got = first.get("input")
    shown = repr(got) if isinstance(got, (int, float, str, bool)) and len(repr(got)) < 40 else type(got).__name__
    return ApiError(400, f"{param}: {first['msg'][:1].lower()}{first['msg'][1:]} (got {shown})", param)


def check_body(body: Completion | Chat) -> None:
    """What the types alone do not say."""
    if body.n != 1:
        raise ApiError(400, f"n: only n = 1 is supported (got {body.n})", "n")
    stops = body.stop_strings()
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings (got {len(stops)})", "stop")
    if isinstance(body, Completion):
        if body.logprobs is not None:
            raise ApiError(400, "logprobs: not supported by this server", "logprobs")
        if isinstance(body.prompt, list) and not body.prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) and len(body.prompt) != 1:
            raise ApiError(400, f"prompt: one prompt per request is supported (got {len(body.prompt)})", "prompt")
    else:
        if body.logprobs or body.top_logprobs is not None:
            which = "logprobs" if body.logprobs else "top_logprobs"
            raise ApiError(400, f"{which}: not supported by this server", which)
        if not body.messages:
            raise ApiError(400, "messages: must hold at least one message", "messages")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "max_completion_tokens: give it or max_tokens, not both", "max_completion_tokens")


def requested_max_tokens(body: Completion | Chat) -> tuple[int | None, str]:
    """The request's token limit (None: not given) and the field that set it."""
    if isinstance(body, Chat) and body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def sampling_for(body: Completion | Chat, n_prompt: int, context: int) -> SamplingParams:
    """The engine's parameters for a prompt of ``n_prompt`` tokens on a model of ``context`` positions."""
    where = "prompt" if isinstance(body, Completion) else "messages"
    if n_prompt == 0:
        raise ApiError(400, f"{where}: the prompt has no tokens", where)
    if n_prompt >= context:
        raise ApiError(400, f"{where}: the prompt has {n_prompt} tokens; the model's context is {context} "
                       "(max_position_embeddings), which leaves no room to generate", where)
    asked, field = requested_max_tokens(body)
    if asked is None:
        asked = context - n_prompt if isinstance(body, Chat) else min(COMPLETION_DEFAULT_MAX_TOKENS,
                                                                          context - n_prompt)
    elif n_prompt + asked > context:
        raise ApiError(400, f"{field}: {asked} tokens asked for, but the prompt has {n_prompt} and the model's "
                       f"context is {context}: at most {context - n_prompt}", field)
    return SamplingParams(max_tokens=asked, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(body.top_k, 0), seed=body.seed, ignore_eos=body.ignore_eos)
