"""``POST /v1/chat/completions`` and ``POST /v1/completions``: a request on the queue, answered from
its result (non-streaming) or its token stream (server-sent events). A client that disconnects
cancels its request. A chat request with tools is answered with its ``tool_calls`` when the answer
is a call (producer/openai_compat/tool_calls.py); streamed, content goes out as it comes and a call
when it is complete: a chunk with its id and name, then one with its arguments. A request naming a
model no live worker serves is answered 503 at once, never queued (serve/live_models.py).

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.producer.errors import ResultTimeout
from tokenmill.producer.openai_compat import (
    BodyError,
    Endpoint,
    ParsedBody,
    completion_object,
    parse_body,
    result_error,
)
from tokenmill.producer.openai_compat.objects import chunk_object, tool_call_deltas, usage_chunk
from tokenmill.producer.openai_compat.tool_calls import ParsedAnswer, ToolCallStream
from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.schema import GenerationResult
from tokenmill.serve.body import json_object
from tokenmill.serve.context import CallContext, call_context, state_of
from tokenmill.serve.errors import APIError
from tokenmill.serve.logs import traffic_of

T = TypeVar("T")
STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do
router = APIRouter()
_background: set[asyncio.Task[None]] = set()  # fire-and-forget cancels, kept alive until done


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _complete(request, "chat")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _complete(request, "completions")


async def _complete(request: Request, endpoint: Endpoint) -> Response:
    body = await json_object(request)
    call = call_context(request, body)
    parsed = parse_body(body, endpoint)
    if parsed.stream and parsed.num_choices > 1:
        raise BodyError("n", "streaming supports n = 1 only")
    if parsed.stream and parsed.options.get("logprobs") is not None:
        raise BodyError("logprobs", "logprobs are not streamed; ask without stream")
    state = state_of(request)
    producer = state.producer
    queued = build_request(producer.keys, {**parsed.options, "request_id": call.request_id, "priority": call.priority,
                                           "deadline": call.deadline, "stream_tokens": parsed.stream})
    if queued.model is not None:  # NOTE: queued, it would wait in lanes no live worker reads
        await state.live_models.require(queued.model)
    await producer.submit_many([queued])
    if parsed.stream:
        return StreamingResponse(_events(request, call, parsed), media_type="text/event-stream")
    result = await _until_disconnect(request, call, producer.result(call.request_id, timeout=call.timeout_s))
    if result is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    traffic_of(request).add_usage(result.usage)
    if not result.ok:
        raise APIError.from_body(*result_error(result))
    return JSONResponse(completion_object(endpoint, result, model=parsed.model or "", created=call.created,
                                          tools=parsed.tools))


async def _until_disconnect(request: Request, call: CallContext, wait: Awaitable[T]) -> T | None:
    """``await wait``, or None (and the request cancelled) when the client goes first.

    Raises:
        APIError: 504 when the client's timeout ran out first (the request is cancelled too).
    """
    waiter = asyncio.ensure_future(wait)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiter, listener):
            task.cancel()
    if not waiter.done() or waiter.cancelled():
        _cancel_later(request, call.request_id)
        return None
    try:
        return waiter.result()
    except ResultTimeout:
        _cancel_later(request, call.request_id)
        raise APIError(504, f"no answer within {call.timeout_s:g} s", type_="timeout_error",
                       code="request_timeout") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: the next message can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _cancel_later(request: Request, request_id: str) -> None:
    """Cancel ``request_id`` in the background: the caller may itself be in a cancelled scope."""
    task = asyncio.get_running_loop().create_task(state_of(request).producer.cancel(request_id))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _events(request: Request, call: CallContext, parsed: ParsedBody) -> AsyncIterator[str]:
    """Server-sent events: a chunk per text delta as the worker writes it, a last chunk with the
    finish reason (and one with usage when asked for), then ``data: [DONE]``."""
    producer, endpoint, model = state_of(request).producer, parsed.endpoint, parsed.model or ""
    calls = ToolCallStream(parsed.tools.names) if parsed.tools is not None else None
    is_finished = False
    try:
        is_first = True
        async for text in producer.stream(call.request_id, timeout=call.timeout_s):
            content = calls.feed(text) if calls is not None else text
            if content:
                yield _sse(chunk_object(endpoint, call.request_id, model=model, created=call.created, text=content,
                                        is_first=is_first))
                is_first = False
        result = await producer.result(call.request_id, timeout=call.timeout_s)
        is_finished = True
        traffic_of(request).add_usage(result.usage)
        answer = calls.finish() if calls is not None else ParsedAnswer(None)
        for event in _closing_events(result, call, parsed, answer, is_first):
            yield event
    except ResultTimeout:
        yield _sse(APIError(504, f"no answer within {call.timeout_s:g} s", type_="timeout_error",
                            code="request_timeout").body)
    finally:
        if not is_finished:  # NOTE: the client went away (or timed out): stop the work
            _cancel_later(request, call.request_id)
    yield "data: [DONE]\n\n"


def _closing_events(result: GenerationResult, call: CallContext, parsed: ParsedBody, answer: ParsedAnswer,
                    is_first: bool) -> list[str]:
    """The chunks after the last delta: what the answer held back (content, calls), the finish
    reason, the usage when asked for."""
    if not result.ok:
        return [_sse(result_error(result)[1])]
    model = result.model or parsed.model or ""
    held: list[tuple[str, dict[str, Any] | None]] = [(answer.content, None)] if answer.content else []
    held += [("", delta) for delta in tool_call_deltas(call.request_id, answer.calls)]
    events = []
    for text, tool_call in held:
        events.append(_sse(chunk_object(parsed.endpoint, call.request_id, model=model, created=call.created,
                                        text=text, tool_call=tool_call, is_first=is_first)))
        is_first = False
    finish_reason = "tool_calls" if answer.calls else result.finish_reason or "stop"
    events.append(_sse(chunk_object(parsed.endpoint, call.request_id, model=model, created=call.created,
                                    finish_reason=finish_reason, is_first=is_first)))
    if parsed.include_usage:
        events.append(_sse(usage_chunk(parsed.endpoint, result, model=model, created=call.created)))
    return events


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
