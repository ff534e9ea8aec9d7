"""The OpenAI-compatible HTTP protocol (/v1/models, /v1/completions, /v1/chat/completions).

Independent of Ray and of any model library: each handler takes an engine fulfilling
`CompletionEngine` and a raw starlette `Request`, so a Ray Serve ingress class wires it in one
line. Shapes and status codes follow OpenAI and what vLLM returns, so the `openai` client raises
its usual exceptions (`NotFoundError`, `BadRequestError`).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

# --- The contract between the protocol and an engine ------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How to generate: temperature 0 is greedy; `max_tokens` None runs to the context's end."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """A whole generation, or one piece of a stream (`finish_reason` is set on the last only)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length"] | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class CompletionEngine(Protocol):
    """What the handlers need from an engine. A request it cannot serve raises ValueError (-> 400).

    `stream` checks the request before it returns, so a bad request is a 400, not a broken stream.
    """

    def model_ids(self) -> list[str]: ...

    def chat_prompt(self, model_id: str, messages: list[ChatMessage]) -> list[int]: ...

    async def generate(
        self, model_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Generation: ...

    def stream(
        self, model_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[Generation]: ...


# --- Errors in OpenAI's shape -----------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with `status_code`."""

    status_code = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.error_type, "param": self.param}
        return {"error": {**error, "code": self.status_code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


class InvalidRequestError(OpenAIError):
    status_code = 400
    error_type = "BadRequestError"


class ModelNotFoundError(OpenAIError):
    status_code = 404
    error_type = "NotFoundError"


def install_error_handlers(app: FastAPI) -> None:
    """Answer `OpenAIError`s and malformed typed bodies in OpenAI's shape (400, not a 422)."""

    async def openai_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return exc.to_response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _invalid_body(list(exc.errors())).to_response()

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def _invalid_body(errors: list[Any]) -> InvalidRequestError:
    def where(error: Any) -> str:
        return ".".join(str(part) for part in error.get("loc", ()) if part != "body")

    problems = "; ".join(f"{where(e) or 'body'}: {e.get('msg')}" for e in errors)
    return InvalidRequestError(f"Invalid request: {problems}", param=where(errors[0]) or None)


@contextlib.contextmanager
def _engine_refusals() -> Iterator[None]:
    """An engine's ValueError is the request at fault (too long, no chat template): a 400."""
    try:
        yield
    except ValueError as err:
        raise InvalidRequestError(str(err)) from err


# --- Request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do;
    null means the default, as in OpenAI's API."""

    model: str
    temperature: float | None = Field(default=1.0, ge=0, le=2)
    top_p: float | None = Field(default=1.0, gt=0, le=1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # Parsed only to refuse: ignoring them would silently change what the user gets.
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingRequest:
        if self.n not in (None, 1):
            raise ValueError(f"n={self.n} is not supported: one choice (n=1) per request")
        if refused := self._unsupported():
            raise ValueError(f"not supported by this server: {', '.join(refused)}")
        return self

    def _unsupported(self) -> list[str]:
        """Names of fields set to something we cannot honour."""
        penalties = ("presence_penalty", "frequency_penalty")
        refused = [name for name in penalties if getattr(self, name)]
        return refused + ([] if self.logprobs is None or self.logprobs is False else ["logprobs"])

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(s for s in stops if s),
            seed=self.seed,
        )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: one prompt (text or token ids), one choice."""

    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> list[str]:
        refused = [name for name in ("echo", "suffix") if getattr(self, name)]
        refused += ["best_of"] if self.best_of not in (None, 1) else []
        return super()._unsupported() + refused

    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, str) or all(isinstance(p, int) for p in self.prompt):
            return self.prompt  # type: ignore[return-value]
        if len(self.prompt) != 1:
            raise InvalidRequestError(
                f"prompt is a list of {len(self.prompt)} strings: send one prompt per request",
                param="prompt",
            )
        return str(self.prompt[0])


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart] | None = None

    def plain(self) -> ChatMessage:
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return ChatMessage(role=self.role, content=content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. Without a token limit, generation runs to the context's end."""

    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def _unsupported(self) -> list[str]:
        refused = [name for name in ("top_logprobs", "tools") if getattr(self, name)]
        if (self.response_format or {}).get("type", "text") != "text":
            refused.append("response_format")
        return super()._unsupported() + refused


# --- Handlers ---------------------------------------------------------------------------------


async def list_models(engine: CompletionEngine) -> Response:
    """GET /v1/models: the base model first, then each adapter."""
    created = int(time.time())
    data = [
        {"id": model_id, "object": "model", "created": created, "owned_by": "orchestrator"}
        for model_id in engine.model_ids()
    ]
    return JSONResponse({"object": "list", "data": data})


async def completions(engine: CompletionEngine, request: Request) -> Response:
    """POST /v1/completions, streamed as server-sent events when `stream` is true."""
    try:
        body = await _parse(request, CompletionRequest)
        _check_model(engine, body.model)
        prompt, params = body.single_prompt(), body.sampling(body.max_tokens)
        reply = _Reply(f"cmpl-{uuid.uuid4().hex}", body.model, body.include_usage())
        with _engine_refusals():
            if body.stream:
                return _sse(reply.completion_chunks(engine.stream(body.model, prompt, params)))
            result = await engine.generate(body.model, prompt, params)
    except OpenAIError as err:
        return err.to_response()
    choice = {"index": 0, "text": result.text, "logprobs": None}
    choice["finish_reason"] = result.finish_reason
    return JSONResponse(reply.body("text_completion", choice, result))


async def chat_completions(engine: CompletionEngine, request: Request) -> Response:
    """POST /v1/chat/completions: the model's chat template renders the messages."""
    try:
        body = await _parse(request, ChatCompletionRequest)
        _check_model(engine, body.model)
        params = body.sampling(body.max_completion_tokens or body.max_tokens)
        reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", body.model, body.include_usage())
        with _engine_refusals():
            prompt = engine.chat_prompt(body.model, [m.plain() for m in body.messages])
            if body.stream:
                return _sse(reply.chat_chunks(engine.stream(body.model, prompt, params)))
            result = await engine.generate(body.model, prompt, params)
    except OpenAIError as err:
        return err.to_response()
    message = {"role": "assistant", "content": result.text}
    choice = {"index": 0, "message": message, "logprobs": None}
    choice["finish_reason"] = result.finish_reason
    return JSONResponse(reply.body("chat.completion", choice, result))


_Body = TypeVar("_Body", bound=BaseModel)


async def _parse(request: Request, model: type[_Body]) -> _Body:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as err:
        raise _invalid_body(list(err.errors(include_url=False))) from None


def _check_model(engine: CompletionEngine, model_id: str) -> None:
    served = engine.model_ids()
    if model_id not in served:
        raise ModelNotFoundError(
            f"The model `{model_id}` does not exist. Served models: {', '.join(served)}",
            param="model",
        )


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events; a failure after the 200 went out is reported in-band, as vLLM does."""

    async def encode() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as err:
            kind = InvalidRequestError if isinstance(err, ValueError) else OpenAIError
            yield f"data: {json.dumps(kind(str(err)).body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream")


@dataclass
class _Reply:
    """What every response or chunk of one request shares."""

    id: str
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def body(self, object_: str, choice: dict[str, Any], result: Generation) -> dict[str, Any]:
        return {**self.head(object_), "choices": [choice], "usage": _usage(result)}

    async def completion_chunks(
        self, pieces: AsyncIterator[Generation]
    ) -> AsyncIterator[dict[str, Any]]:
        last = None
        async for last in pieces:
            choice = {"index": 0, "text": last.text, "logprobs": None}
            choice["finish_reason"] = last.finish_reason
            yield {**self.head("text_completion"), "choices": [choice]}
        if last and self.include_usage:
            yield {**self.head("text_completion"), "choices": [], "usage": _usage(last)}

    async def chat_chunks(self, pieces: AsyncIterator[Generation]) -> AsyncIterator[dict[str, Any]]:
        head = self.head("chat.completion.chunk")

        def chunk(delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**head, "choices": [choice]}

        yield chunk({"role": "assistant", "content": ""})
        last = None
        async for last in pieces:
            if last.text:
                yield chunk({"content": last.text})
            if last.finish_reason:
                yield chunk({}, last.finish_reason)
        if last and self.include_usage:
            yield {**head, "choices": [], "usage": _usage(last)}


def _usage(result: Generation) -> dict[str, int]:
    """Counts of the whole request; a stream's last piece carries the final ones."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
