"""What a caller may say of a request (:class:`SubmitOptions`, the keyword arguments of ``submit``) and the
:class:`GenerationRequest` it becomes: validated, its plain prompt resolved into chat or raw text, checked against
the queue (its lane and reply stream exist), placed on the queue's shards. Every entry point that takes options
(the producers, the CLI, bulk, Celery, serve) builds its requests here. No I/O. Never imports torch, the engine or
the worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from pydantic import ValidationError

from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.sampling import ResponseFormat, SamplingParams
from tokenmill.protocol.schema import (
    GenerationRequest,
    Message,
    ToolSpec,
    check_reply_to,
    describe_validation_error,
)
from tokenmill.protocol.shards import QueueLayout

_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
# A request's own fields a caller may set (id is request_id, priority a name or lane; the rest are the producer's).
_REQUEST_FIELDS = frozenset(GenerationRequest.model_fields) - {"id", "params", "priority", "submitted_at"}
# How a plain prompt reaches the model: resolved into the request's prompt or messages (as_request_prompt).
_PROMPT_STYLE_OPTIONS = frozenset({"raw", "system"})
# Options given as any Sequence / Mapping from Python; the strict wire models take lists and dicts.
_SEQUENCE_FIELDS = frozenset({"messages", "prompt_token_ids", "stop_token_ids", "stop", "tools"})


class SubmitOptions(TypedDict, total=False):
    """Keyword arguments of ``submit``; dict items of ``submit_many`` use the same keys."""

    n: int

    prompt: str
    raw: bool
    system: str | None
    messages: Sequence[Message | Mapping[str, Any]]
    prompt_token_ids: Sequence[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_tokens: int
    seed: int | None
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    response_format: ResponseFormat | Mapping[str, Any] | None
    speculative: bool
    priority: Literal["high", "normal", "low"] | int
    request_id: str | None
    deadline: float | None
    reply_to: str | None
    stream_tokens: bool
    metadata: Mapping[str, Any] | None
    model: str | None
    tools: Sequence[ToolSpec | Mapping[str, Any]] | None


def build_request(keys: Keys, options: Mapping[str, Any]) -> GenerationRequest:
    """Validate ``submit`` options into a request, before anything is sent.

    ``None`` values mean "default"; ``priority`` defaults to ``"normal"``; a plain ``prompt`` is
    the user's message unless ``raw`` (see :func:`as_request_prompt`).

    Raises:
        SchemaError: code ``validation``, one clause per bad field.
    """
    unknown = set(options) - _SAMPLING_FIELDS - _REQUEST_FIELDS - _PROMPT_STYLE_OPTIONS - {"priority", "request_id"}
    if unknown:
        raise SchemaError(ErrorCode.VALIDATION.value, f"unknown submit option(s): {', '.join(sorted(unknown))}")
    given = {name: _as_plain(name, value) for name, value in as_request_prompt(options).items() if value is not None}
    data: dict[str, Any] = {name: value for name, value in given.items() if name in _REQUEST_FIELDS}
    data["params"] = {name: value for name, value in given.items() if name in _SAMPLING_FIELDS}
    if "request_id" in given:
        data["id"] = given["request_id"]
    try:
        data["priority"] = keys.lane_of(given.get("priority", "normal"))
        request = GenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, describe_validation_error(exc)) from None
    except ValueError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, f"priority: {exc}") from None
    _check_for_queue(keys, request)
    return request


def _as_plain(name: str, value: Any) -> Any:
    """A Python-side convenience: tuples (any non-str sequence) as lists, mappings as dicts."""
    if name in _SEQUENCE_FIELDS and isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [dict(item) if isinstance(item, Mapping) else item for item in value]
    if name in ("metadata", "response_format") and isinstance(value, Mapping):
        return dict(value)
    return value


def coerce_request(keys: Keys, item: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    """A ``submit_many`` item as a request whose lane and reply stream exist on this queue.

    Raises:
        SchemaError: code ``validation``.
    """
    if not isinstance(item, GenerationRequest):
        return build_request(keys, item)
    if item.priority >= keys.num_lanes:
        raise SchemaError(ErrorCode.VALIDATION.value, f"priority: lane {item.priority} >= num_lanes {keys.num_lanes}")
    _check_for_queue(keys, item)
    return item


def build_placed(layout: QueueLayout, options: Mapping[str, Any]) -> GenerationRequest:
    """:func:`build_request` on the queue's shards: without a ``request_id`` the id is chosen on the shard of the
    queue's placement (protocol/shards.py); a given id decides its shard itself.

    Raises:
        SchemaError: code ``validation``.
    """
    request = build_request(layout.home, options)
    return request if options.get("request_id") is not None else layout.placed(request)


def coerce_placed(layout: QueueLayout, item: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    """:func:`coerce_request` on the queue's shards: a dict item without ``request_id`` is placed
    (:func:`build_placed`); a ``GenerationRequest`` keeps its id (the caller may know it already).

    Raises:
        SchemaError: code ``validation``.
    """
    if isinstance(item, GenerationRequest):
        return coerce_request(layout.home, item)
    return build_placed(layout, item)


def _check_for_queue(keys: Keys, request: GenerationRequest) -> None:
    reason = check_reply_to(request, keys)
    if reason is not None:
        raise SchemaError(ErrorCode.VALIDATION.value, reason)


def as_request_prompt(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without ``raw`` and ``system``, its plain ``prompt`` as the request carries it:
    the user's message after ``system`` (:func:`as_chat`), or with ``raw=True`` the text as it is
    (no chat template). Every entry point that takes a plain prompt (``Producer.submit``, the CLI,
    bulk, Celery) resolves it here.

    Raises:
        SchemaError: code ``validation``: ``raw`` is not a bool, ``system`` not a string, or
            ``system`` given where it would be dropped (``raw``, ``messages``, token ids).
    """
    is_raw, system = options.get("raw") or False, options.get("system")
    rest = {name: value for name, value in options.items() if name not in _PROMPT_STYLE_OPTIONS}
    if not isinstance(is_raw, bool):
        raise SchemaError(ErrorCode.VALIDATION.value, f"raw: must be true or false, got {is_raw!r}")
    if system is not None and not isinstance(system, str):
        raise SchemaError(ErrorCode.VALIDATION.value, f"system: must be a string, got {type(system).__name__}")
    if system is not None and (is_raw or rest.get("prompt") is None):
        raise SchemaError(ErrorCode.VALIDATION.value, "system: goes with a plain prompt sent as chat (not raw; "
                          "put it in messages otherwise)")
    return rest if is_raw else as_chat(rest, system)


def as_chat(options: Mapping[str, Any], system: str | None = None) -> dict[str, Any]:
    """``options`` with a plain ``prompt`` turned into chat messages: an optional system message,
    then the prompt as the user's. Messages and token ids stay as given.

    NOTE: chat is the default for plain prompts (the producers, CLI, Celery, bulk), because the models people serve
    are instruct models that ramble on raw text; a worker whose model has no chat template reads a
    lone user message as raw text (docs/design.md).
    """
    if options.get("prompt") is None or options.get("messages") is not None:
        return dict(options)  # NOTE: prompt + messages stays invalid, for validation to say so
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": options["prompt"]})
    return {**{k: v for k, v in options.items() if k != "prompt"}, "messages": messages}
