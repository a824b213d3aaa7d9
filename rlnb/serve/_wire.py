"""The OpenAI API's wire format, as the endpoint reads and writes it.

Requests are checked by pydantic models that forbid unknown fields, so a typo or a
field this endpoint cannot honour is a 400 naming it, never silently ignored; a
field it accepts but can only honour at one value (``presence_penalty``,
``top_logprobs``, ...) is refused at any other. Responses are plain dicts in the
shapes the ``openai`` client parses, with vLLM's extensions: ``prompt_token_ids``,
each choice's ``token_ids``, and ``return_tokens_as_token_ids`` (log-prob tokens
written ``"token_id:N"``); and rlnb's own: each choice's ``policy_version`` and
``token_versions``, and the response's ``policy_version``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlnb._errors import InvalidValueError
from rlnb.engines import SamplingParams
from rlnb.rollout import ServedChoice, ServedRequest

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "WireError",
    "chat_chunks",
    "chat_response",
    "completion_chunks",
    "completion_response",
    "parse",
]

MAX_N = 64  # completions one call may ask for
MAX_STOP = 16  # stop strings one call may give


class WireError(Exception):
    """A request the endpoint refuses: its HTTP ``status``, a message naming the field
    and the fix, and OpenAI's error ``type`` and ``param``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Function(_Strict):
    name: str
    arguments: str


class _ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function
    index: int | None = None  # a streamed call's, sent back as it came


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # sent back by clients that keep it; not shown to the model

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template gets it: text parts joined, empty fields left out."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                | ({"id": c.id} if c.id else {})
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Strict):
    type: Literal["function"]
    function: _FunctionSpec


class _StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(_Strict):
    """What both endpoints take."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise InvalidValueError(f"at most {MAX_STOP} stop strings")
        return value

    def unsupported(self) -> Iterator[tuple[str, str]]:
        """(field, why) for each value this endpoint cannot honour."""
        for field in ("presence_penalty", "frequency_penalty"):
            if getattr(self, field) not in (None, 0, 0.0):
                yield field, "penalties are not applied by the engine: leave it 0 (the default)"
        if self.repetition_penalty not in (None, 1, 1.0):
            yield "repetition_penalty", "penalties are not applied by the engine: leave it 1 (the default)"
        if self.logit_bias:
            yield "logit_bias", "the engine samples from the policy as it is: leave it out"

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's; only an empty one
    add_generation_prompt: bool = True

    def unsupported(self) -> Iterator[tuple[str, str]]:
        yield from super().unsupported()
        if self.top_logprobs:
            yield "top_logprobs", "only the sampled token's log-prob is returned: leave it 0 or out"
        if self.response_format not in (None, {"type": "text"}):
            yield "response_format", 'only {"type": "text"} is served: ask for JSON in the prompt'
        if self.chat_template_kwargs:
            yield "chat_template_kwargs", "the session's chat template is rendered as it is: leave it out"
        if not self.add_generation_prompt:
            yield "add_generation_prompt", "the reply always starts a new assistant turn: leave it true"


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> Iterator[tuple[str, str]]:
        yield from super().unsupported()
        if self.logprobs and self.logprobs > 1:
            yield "logprobs", "only the sampled token's log-prob is returned: use logprobs=1 (or 0)"
        if self.echo:
            yield "echo", "the prompt is not scored: leave it false (prompt_token_ids gives its ids)"
        if self.suffix:
            yield "suffix", "insertion is not served: leave it out"
        if self.best_of not in (None, 1):
            yield "best_of", "use n= and choose among them yourself"


def parse(kind: str, body: bytes, *, defaults: SamplingParams, episode: str | None) -> tuple[Any, ServedRequest]:
    """The checked request of ``kind`` ("chat" or "completion") in ``body`` and what the
    rollouts serve for it (fields it leaves out take ``defaults``: the rollouts').
    Raises WireError (400) naming the first bad field."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise WireError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(400, f"the body must be a JSON object, got {type(data).__name__}")
    model: type[_Common] = ChatRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or "body"
        what = "is not a field of this endpoint" if error["type"] == "extra_forbidden" else error["msg"]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise WireError(400, f"{field}: {what}{more}", param=field) from None
    for field, why in request.unsupported():
        raise WireError(400, f"{field}={getattr(request, field)!r} is not supported: {why}", param=field)
    sampling = _sampling(request, defaults)
    if isinstance(request, ChatRequest):
        served = ServedRequest(
            messages=tuple(m.as_dict() for m in request.messages),
            tools=None if not request.tools or request.tool_choice == "none" else _tools(request.tools),
            sampling=sampling,
            n=request.n,
            stop=request.stops(),
            seed=request.seed,
            episode=episode,
        )
    else:
        assert isinstance(request, CompletionRequest)
        served = ServedRequest(
            prompt=_prompt(request.prompt),
            sampling=sampling,
            n=request.n,
            stop=request.stops(),
            seed=request.seed,
            episode=episode,
        )
    return request, served


def _tools(tools: Sequence[_Tool]) -> tuple[dict[str, Any], ...]:
    return tuple(tool.model_dump(exclude_none=True) for tool in tools)


def _prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise WireError(400, "prompt: give a string, or a list of token ids", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return tuple(prompt)  # type: ignore[arg-type]
    if len(prompt) == 1:
        return _prompt(prompt[0])  # type: ignore[arg-type]
    raise WireError(400, "prompt: one prompt a request (a batch is several requests, or n=)", param="prompt")


def _sampling(request: _Common, defaults: SamplingParams) -> SamplingParams:
    if isinstance(request, ChatRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens
    else:
        max_tokens = request.max_tokens  # type: ignore[attr-defined]
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    return SamplingParams(
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else top_k,
        max_new_tokens=max_tokens or defaults.max_new_tokens,
        ignore_eos=request.ignore_eos,
    )


# --- responses ------------------------------------------------------------------------------


def _token(token: int, piece: Callable[[int], str], as_ids: bool) -> str:
    """A token as a log-prob entry names it: its text, or ``"token_id:N"`` (vLLM's
    ``return_tokens_as_token_ids``)."""
    return f"token_id:{token}" if as_ids else piece(token)


def _logprob_entries(choice: ServedChoice, piece: Callable[[int], str], as_ids: bool) -> list[dict[str, Any]]:
    entries = []
    for token, logprob in zip(choice.token_ids, choice.logprobs, strict=True):
        text = _token(token, piece, as_ids)
        entries.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return entries


def _tool_calls(choice: ServedChoice) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{secrets.token_hex(8)}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for name, args in choice.tool_calls
    ]


def _usage(choices: Sequence[ServedChoice]) -> dict[str, int]:
    prompt = len(choices[0].prompt_ids) if choices else 0
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _version(choices: Sequence[ServedChoice]) -> int | None:
    versions = [c.version for c in choices if c.version is not None]
    return max(versions) if versions else None


def _extras(choice: ServedChoice) -> dict[str, Any]:
    return {
        "token_ids": list(choice.token_ids),
        "policy_version": choice.version,
        "token_versions": list(choice.versions),
    }


def _response(
    prefix: str, kind: str, request: _Common, choices: Sequence[ServedChoice], out: list[dict[str, Any]]
) -> dict[str, Any]:
    """A whole reply of ``kind`` around its choices ``out``, with usage and vLLM's and rlnb's extensions."""
    return {
        "id": f"{prefix}-{secrets.token_hex(12)}",
        "object": kind,
        "created": int(time.time()),
        "model": request.model,
        "choices": out,
        "usage": _usage(choices),
        "prompt_token_ids": list(choices[0].prompt_ids) if choices else [],
        "policy_version": _version(choices),
    }


def chat_response(
    request: ChatRequest, choices: Sequence[ServedChoice], *, piece: Callable[[int], str]
) -> dict[str, Any]:
    """A ``chat.completion`` for ``choices``."""
    out = []
    for i, choice in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.content}
        if choice.tool_calls:
            message["tool_calls"] = _tool_calls(choice)
        logprobs = (
            {"content": _logprob_entries(choice, piece, request.return_tokens_as_token_ids)}
            if request.logprobs
            else None
        )
        out.append(
            {"index": i, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs}
            | _extras(choice)
        )
    return _response("chatcmpl", "chat.completion", request, choices, out)


def completion_response(
    request: CompletionRequest, choices: Sequence[ServedChoice], *, piece: Callable[[int], str]
) -> dict[str, Any]:
    """A ``text_completion`` for ``choices``."""
    out = []
    for i, choice in enumerate(choices):
        logprobs = None
        if request.logprobs is not None:
            tokens = [_token(t, piece, request.return_tokens_as_token_ids) for t in choice.token_ids]
            offsets, at = [], 0
            for token in tokens:
                offsets.append(at)
                at += len(token)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": list(choice.logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, choice.logprobs, strict=True)],
                "text_offset": offsets,
            }
        out.append(
            {"index": i, "text": choice.text, "finish_reason": choice.finish_reason, "logprobs": logprobs}
            | _extras(choice)
        )
    return _response("cmpl", "text_completion", request, choices, out)


def _pieces(choice: ServedChoice, decode: Callable[[list[int]], str]) -> Iterator[tuple[int, str]]:
    """Each token of ``choice`` and the text it adds (a token that ends inside a
    character adds nothing until the character is whole), up to the choice's text."""
    shown = 0
    for k in range(1, len(choice.token_ids) + 1):
        text = decode(list(choice.token_ids[:k]))
        if text.endswith("\ufffd") and k < len(choice.token_ids):
            yield k - 1, ""
            continue
        text = text[: len(choice.text)]
        yield k - 1, text[shown:]
        shown = max(shown, len(text))


def chat_chunks(
    request: ChatRequest,
    choices: Sequence[ServedChoice],
    *,
    piece: Callable[[int], str],
    decode: Callable[[list[int]], str],
) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` s of a streamed reply: a role, then a token at a
    time (its text and log-prob), then tool calls whole, then the finish reason (and
    usage, when ``stream_options.include_usage``)."""
    base = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.model,
    }
    for i, choice in enumerate(choices):
        yield base | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        if choice.tool_calls:
            delta: dict[str, Any] = {"content": choice.content or None}
            delta["tool_calls"] = [c | {"index": k} for k, c in enumerate(_tool_calls(choice))]
            logprobs = (
                {"content": _logprob_entries(choice, piece, request.return_tokens_as_token_ids)}
                if request.logprobs
                else None
            )
            yield base | {"choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}
        else:
            entries = _logprob_entries(choice, piece, request.return_tokens_as_token_ids) if request.logprobs else []
            for k, text in _pieces(choice, decode):
                logprobs = {"content": [entries[k]]} if request.logprobs else None
                yield base | {
                    "choices": [
                        {
                            "index": i,
                            "delta": {"content": text},
                            "logprobs": logprobs,
                            "finish_reason": None,
                            "token_ids": [choice.token_ids[k]],
                        }
                    ]
                }
        yield base | {
            "choices": [{"index": i, "delta": {}, "finish_reason": choice.finish_reason} | _extras(choice)],
            "prompt_token_ids": list(choice.prompt_ids),
            "policy_version": choice.version,
        }
    if request.stream_options is not None and request.stream_options.include_usage:
        yield base | {"choices": [], "usage": _usage(choices)}


def completion_chunks(
    request: CompletionRequest,
    choices: Sequence[ServedChoice],
    *,
    piece: Callable[[int], str],
    decode: Callable[[list[int]], str],
) -> Iterator[dict[str, Any]]:
    """The ``text_completion`` chunks of a streamed reply, a token at a time."""
    base = {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
    }
    for i, choice in enumerate(choices):
        for k, text in _pieces(choice, decode):
            token = _token(choice.token_ids[k], piece, request.return_tokens_as_token_ids)
            logprobs = (
                {
                    "tokens": [token],
                    "token_logprobs": [choice.logprobs[k]],
                    "top_logprobs": [{token: choice.logprobs[k]}],
                }
                if request.logprobs is not None
                else None
            )
            yield base | {
                "choices": [
                    {
                        "index": i,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": None,
                        "token_ids": [choice.token_ids[k]],
                    }
                ]
            }
        yield base | {
            "choices": [{"index": i, "text": "", "finish_reason": choice.finish_reason} | _extras(choice)],
            "prompt_token_ids": list(choice.prompt_ids),
            "policy_version": choice.version,
        }
    if request.stream_options is not None and request.stream_options.include_usage:
        yield base | {"choices": [], "usage": _usage(choices)}
