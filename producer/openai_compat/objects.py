"""OpenAI response objects built from tokenmill results: ``chat.completion`` / ``text_completion``
objects (a chat answer read for tool calls when the request has tools), their stream chunks,
logprobs in both shapes, and errors in OpenAI's error shape.

Pure: no I/O; never imports torch, the engine, the worker or a web framework.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tokenmill.producer.openai_compat.bodies import Endpoint
from tokenmill.producer.openai_compat.tool_calls import ParsedAnswer, ToolCall, call_id, parse_answer
from tokenmill.producer.openai_compat.tools import ToolPlan
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import GenerationResult

OBJECT_NAMES: dict[Endpoint, str] = {"chat": "chat.completion", "completions": "text_completion"}
CHUNK_NAMES: dict[Endpoint, str] = {"chat": "chat.completion.chunk", "completions": "text_completion"}
_ID_PREFIXES: dict[Endpoint, str] = {"chat": "chatcmpl-", "completions": "cmpl-"}
# Wire error code (or non-ok status) -> HTTP status, OpenAI error type, OpenAI error code.
_ERRORS: dict[str, tuple[int, str, str | None]] = {
    ErrorCode.VALIDATION.value: (400, "invalid_request_error", None),
    ErrorCode.UNDECODABLE.value: (400, "invalid_request_error", None),
    ErrorCode.UNKNOWN_VERSION.value: (400, "invalid_request_error", None),
    ErrorCode.PROMPT_TOO_LONG.value: (400, "invalid_request_error", "context_length_exceeded"),
    ErrorCode.MODEL_NOT_SERVED.value: (404, "invalid_request_error", "model_not_found"),
    "expired": (408, "timeout_error", "request_timeout"),
    "cancelled": (409, "invalid_request_error", "request_cancelled"),
}
_SERVER_ERROR = (500, "server_error", None)


def response_id(endpoint: Endpoint, request_id: str) -> str:
    """The ``id`` of a response: OpenAI's prefix and the tokenmill request id."""
    return _ID_PREFIXES[endpoint] + request_id


def completion_object(endpoint: Endpoint, result: GenerationResult, *, model: str, created: int,
                      tools: ToolPlan | None = None) -> dict[str, Any]:
    """The response body of an ``ok`` result (``choices`` from its samples when ``n > 1``); with
    ``tools`` (the request's plan) a chat answer that is a call comes back as ``tool_calls``."""
    return {"id": response_id(endpoint, result.id), "object": OBJECT_NAMES[endpoint], "created": created,
            "model": result.model or model, "system_fingerprint": None,
            "choices": [_choice(endpoint, sample, i, result.id, tools) for i, sample in enumerate(_samples(result))],
            "usage": usage_object(result)}


def usage_object(result: GenerationResult) -> dict[str, int]:
    usage = result.usage
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _samples(result: GenerationResult) -> Sequence[Any]:
    """The result's samples (parallel sampling), else the result itself as the one sample."""
    samples = getattr(result, "samples", None)
    return samples if samples else [result]


def _choice(endpoint: Endpoint, sample: Any, position: int, request_id: str, tools: ToolPlan | None) -> dict[str, Any]:
    index = getattr(sample, "index", position)
    finish_reason = sample.finish_reason or "stop"
    token_logprobs = getattr(sample, "token_logprobs", None)
    if endpoint == "chat":
        answer = parse_answer(sample.text, tools.names) if tools is not None else ParsedAnswer(sample.text)
        message: dict[str, Any] = {"role": "assistant", "content": answer.content, "refusal": None}
        if answer.calls:
            message["tool_calls"] = tool_call_objects(request_id, index, answer.calls)
            finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": chat_logprobs(token_logprobs),
                "finish_reason": finish_reason}
    return {"index": index, "text": sample.text, "logprobs": completion_logprobs(token_logprobs),
            "finish_reason": finish_reason}


def _as_dict(item: Any) -> dict[str, Any]:
    return item.model_dump() if isinstance(item, BaseModel) else dict(item)


def chat_logprobs(token_logprobs: Sequence[Any] | None) -> dict[str, Any] | None:
    """Chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, or None when not asked for."""
    if token_logprobs is None:
        return None
    content = []
    for item in map(_as_dict, token_logprobs):
        top = [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
               for t in map(_as_dict, item.get("top_logprobs") or [])]
        content.append({"token": item["token"], "logprob": item["logprob"], "bytes": item.get("bytes"),
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(token_logprobs: Sequence[Any] | None) -> dict[str, Any] | None:
    """Completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, or None."""
    if token_logprobs is None:
        return None
    items = [_as_dict(item) for item in token_logprobs]
    offsets, offset = [], 0
    for item in items:
        offsets.append(offset)
        offset += len(item["token"])
    return {"tokens": [item["token"] for item in items], "token_logprobs": [item["logprob"] for item in items],
            "top_logprobs": [{t["token"]: t["logprob"] for t in map(_as_dict, item.get("top_logprobs") or [])}
                             for item in items],
            "text_offset": offsets}


def tool_call_objects(request_id: str, choice: int, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """A message's ``tool_calls``: ``[{id, type: "function", function: {name, arguments}}]``."""
    return [{"id": call_id(request_id, choice, i), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for i, call in enumerate(calls)]


def tool_call_deltas(request_id: str, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The streamed ``delta.tool_calls`` of a choice's calls, as OpenAI sends them: per call (its
    ``index``), first its id, type and name with empty arguments, then the arguments."""
    deltas: list[dict[str, Any]] = []
    for i, call in enumerate(tool_call_objects(request_id, 0, calls)):
        deltas.append({"index": i, **call, "function": {"name": call["function"]["name"], "arguments": ""}})
        deltas.append({"index": i, "function": {"arguments": call["function"]["arguments"]}})
    return deltas


def chunk_object(endpoint: Endpoint, request_id: str, *, model: str, created: int, text: str = "",
                 finish_reason: str | None = None, is_first: bool = False,
                 tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk carrying a text delta or one ``tool_call`` delta (:func:`tool_call_deltas`;
    chat: the first chunk also names the role)."""
    if endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if is_first else {}
        if tool_call is not None:
            delta.update({"content": None, "tool_calls": [tool_call]} if is_first else {"tool_calls": [tool_call]})
        elif text or finish_reason is None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": response_id(endpoint, request_id), "object": CHUNK_NAMES[endpoint], "created": created,
            "model": model, "system_fingerprint": None, "choices": [choice]}


def usage_chunk(endpoint: Endpoint, result: GenerationResult, *, model: str, created: int) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    return {"id": response_id(endpoint, result.id), "object": CHUNK_NAMES[endpoint], "created": created,
            "model": result.model or model, "system_fingerprint": None, "choices": [], "usage": usage_object(result)}


def error_object(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def result_error(result: GenerationResult) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a result that is not ``ok``."""
    key = result.error.code if result.error is not None else result.status
    if result.status in ("expired", "cancelled"):
        key = result.status
    status, type_, code = _ERRORS.get(key, _SERVER_ERROR)
    message = result.error.message if result.error is not None else f"request {result.status}"
    return status, error_object(message, type_=type_, code=code or key)
