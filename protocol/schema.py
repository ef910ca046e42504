"""The wire contract (docs/design.md): pydantic v2 models, msgpack-encoded, versioned.

A request is one stream entry with fields ``d`` (msgpack bytes) and ``v`` (schema version).
A result is msgpack bytes stored as a plain string value and XADDed to reply streams as
``d`` + ``v``. No pickle anywhere. Never imports torch or the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.outcomes import AbortReason, ErrorCode, FinishReason, TokenLogprob
from tokenmill.protocol.sampling import (
    INT32_END,
    Metadata,
    SamplingParams,
    Text,
    TokenId,
    WireModel,
)
from tokenmill.protocol.values import check_metadata, is_utf8, safe_text, version_of

if TYPE_CHECKING:
    from tokenmill.protocol.keys import Keys

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
MAX_ID_LENGTH = 256
MAX_REPLY_TO_LENGTH = 1024
MAX_TOOLS = 128  # function tools per request (OpenAI's limit)
_MAX_ERROR_CLAUSES = 10

__all__ = [
    "MAX_TOOLS", "SCHEMA_VERSION", "SUPPORTED_VERSIONS", "ErrorInfo", "FunctionSpec", "GenerationRequest",
    "GenerationResult", "Message", "ResultStatus", "Sample", "Timings", "ToolSpec", "Usage", "WireFinishReason",
    "check_reply_to", "decode_request", "decode_result", "describe_validation_error", "encode_request",
    "encode_result", "new_request_id", "peek_reply_to", "peek_request_id", "request_id_error",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(WireModel):
    """One chat message; extra keys (e.g. ``name``) pass through to the chat template.

    Extra keys follow the rules of ``metadata``: JSON-compatible, bounded depth and size.
    """

    model_config = ConfigDict(extra="allow")

    role: Text = Field(..., min_length=1)
    content: Text

    @model_validator(mode="after")
    def _check_extra(self) -> Message:
        if self.model_extra:
            check_metadata(self.model_extra)
        return self


class FunctionSpec(WireModel):
    """A function the model may call (OpenAI's ``function`` object): rendered into the prompt by the
    model's chat template (engine/output/prompts.py), which is all a worker does with it."""

    # NOTE: OpenAI's rule for names: they go into the prompt, into a JSON schema's enum and back to
    # the client as the call's name, so nothing that needs quoting or could read as markup.
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: Metadata | None = Field(default=None, description="JSON Schema of the arguments object")
    strict: bool | None = None


class ToolSpec(WireModel):
    """One tool of a chat request (OpenAI's ``{"type": "function", "function": {...}}``)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_error(value: str) -> str | None:
    """Why ``value`` cannot be a request id (1..MAX_ID_LENGTH chars, valid UTF-8, no whitespace), or None."""
    if not 0 < len(value) <= MAX_ID_LENGTH:
        return f"id must be 1 to {MAX_ID_LENGTH} characters long"
    if value.split() != [value]:  # NOTE: str.isspace's whitespace, tested in C (a worker checks every id it decodes)
        return "id must not contain whitespace"
    if not is_utf8(value):
        return "id must be valid UTF-8"
    return None


class GenerationRequest(WireModel):
    """One unit of work. ``id`` is the idempotency key: one id, one result."""

    id: str = Field(default_factory=new_request_id)
    prompt: Text | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[TokenId] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=0, lt=INT32_END, description="lane; lower = more urgent")
    deadline: float | None = Field(
        default=None, description="unix time; work not started by then is answered 'expired'"
    )
    reply_to: Text | None = Field(default=None, min_length=1, max_length=MAX_REPLY_TO_LENGTH,
                                  description="stream under Keys.reply_prefix that also receives the result")
    stream_tokens: bool = False
    model: Text | None = Field(
        default=None, description="model the caller expects; a worker serving another answers an error"
    )
    metadata: Metadata = Field(default_factory=dict, description="echoed back in the result")
    tools: list[ToolSpec] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS,
                                         description="functions the chat template tells the model of")
    submitted_at: float = Field(default_factory=time.time, description="unix time the producer enqueued it")

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        reason = request_id_error(value)
        if reason is not None:
            raise ValueError(reason)
        return value

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> GenerationRequest:
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt / messages / prompt_token_ids is required, got {given or 'none'}")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of non-negative ints")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> GenerationRequest:
        if self.tools is None:
            return self
        if self.messages is None:
            raise ValueError("tools need messages (the chat template renders them)")
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        return self


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Timings(_Model):
    """Seconds: queued (submit to first scheduled), ttft (submit to first token), tpot, total."""

    queued: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    total: float | None = None


class ErrorInfo(_Model):
    code: str
    message: str


ResultStatus = Literal["ok", "error", "cancelled", "expired"]
# NOTE: the engine's FinishReason.ERROR never goes on the wire: an error result has status "error"
# and no finish reason.
WireFinishReason = Literal[FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT]


class Sample(_Model):
    """One sample of an ``n > 1`` request."""

    index: int  # 0 .. n-1
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: WireFinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    token_logprobs: list[TokenLogprob] | None = None


class GenerationResult(_Model):
    """The one answer to one request id. With ``n > 1``, ``samples`` holds every sample and the
    top-level ``text`` / ``token_ids`` / ``finish_reason`` are sample 0's (old readers see one answer)."""

    id: str
    status: ResultStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: WireFinishReason | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    worker: str | None = None
    model: str | None = None  # the served model name of the worker that answered (stamped when written)
    error: ErrorInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    logprobs: list[dict[int, float]] | None = None  # raw, per token: {token_id: logprob}, the chosen one first
    token_logprobs: list[TokenLogprob] | None = None  # OpenAI's shape, when the request set params.logprobs
    samples: list[Sample] | None = None  # every sample of an n > 1 request, by index

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def failure(
        cls,
        request_id: str,
        code: ErrorCode | AbortReason | str,
        message: str,
        *,
        status: ResultStatus | AbortReason = "error",
        worker: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> GenerationResult:
        """A result that carries no generation, only why (``message`` made encodable: see :func:`safe_text`).
        An abort's ``status`` is its reason (``cancelled``, ``expired``); a hand-over is never answered."""
        code_text = code.value if isinstance(code, (ErrorCode, AbortReason)) else code
        status_text = status.value if isinstance(status, AbortReason) else status
        return cls(
            id=request_id,
            status=status_text,
            finish_reason="abort" if status_text != "error" else None,
            worker=worker,
            error=ErrorInfo(code=code_text, message=safe_text(message)),
            metadata=metadata or {},
        )


def _pack(obj: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# NOTE: fields added to version 1 after it shipped are left out of the encoding while unused (at these
# defaults, or None), so that what does not use them encodes exactly as before and older readers,
# which reject unknown fields, still take it.
_NEWER_PARAM_DEFAULTS: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                          "n": 1, "speculative": True}
_NEWER_RESULT_FIELDS = ("model", "token_logprobs", "samples")


def encode_request(request: GenerationRequest) -> dict[str, bytes | int]:
    """Stream-entry fields (``d``, ``v``) for XADD."""
    data = request.model_dump(mode="json", exclude_none=True)
    for name, default in _NEWER_PARAM_DEFAULTS.items():
        if data["params"].get(name) == default:
            del data["params"][name]
    if request.params.max_tokens is None:  # NOTE: None is a value here (the rest of the context), not "unset"
        data["params"]["max_tokens"] = None
    return {"d": _pack(data), "v": SCHEMA_VERSION}


def decode_request(fields: dict[Any, Any]) -> GenerationRequest:
    """Decode stream-entry fields into a request.

    Raises:
        SchemaError: with code ``undecodable``, ``unknown_version`` or ``validation``.
    """
    data = _unpack_fields(fields)
    try:
        return GenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, describe_validation_error(exc)) from None


def check_reply_to(request: GenerationRequest, keys: Keys) -> str | None:
    """Why ``request.reply_to`` may not be written by a worker of ``keys``' queue, or None when it may.

    A reply stream must live under ``keys.reply_prefix`` (docs/design.md), so a request can never name
    another key (a result, the cancel set, a lane). The schema alone cannot know the queue: the
    producer calls this before sending, the worker at triage (answering ``validation``).
    """
    if request.reply_to is None or keys.is_reply_stream(request.reply_to):
        return None
    return safe_text(f"reply_to must name a stream under {keys.reply_prefix!r}, got {request.reply_to!r}")


def peek_request_id(fields: dict[Any, Any]) -> str | None:
    """Best-effort id of an entry that failed to decode, so its error result has an address.

    Bad UTF-8 elsewhere in the payload (e.g. the prompt) does not hide the id; the id itself
    must pass :func:`request_id_error`.
    """
    request_id = _peek(fields, "id")
    return request_id if isinstance(request_id, str) and request_id_error(request_id) is None else None


def peek_reply_to(fields: dict[Any, Any]) -> str | None:
    """Best-effort ``reply_to`` of an entry that failed to decode, so that a bulk job still hears of
    its error. Unchecked: write to it only if ``Keys.is_reply_stream`` accepts it."""
    reply_to = _peek(fields, "reply_to")
    return reply_to if isinstance(reply_to, str) and reply_to and is_utf8(reply_to) else None


def _peek(fields: dict[Any, Any], name: str) -> Any:
    """The value of the first ``name`` key of the map in ``d``, or None.

    NOTE: only that value is decoded; the others are stepped over without recursion, so a request
    whose metadata nests 100,000 deep (past the 1,024 levels msgpack's unpacker allows) still has
    an id to answer it under.
    """
    payload = _field(fields, "d")
    if not isinstance(payload, (bytes, bytearray)) or not payload or payload[0] not in _MAP_TYPES:
        return None
    try:
        pos, num_items = _msgpack_header(payload, 0)
        for _ in range(num_items // 2):
            key_end = _msgpack_skip(payload, pos)
            value_end = _msgpack_skip(payload, key_end)
            if _unpack(payload[pos:key_end]) == name:
                return _unpack(payload[key_end:value_end])
            pos = value_end
    except Exception:  # noqa: BLE001 - any garbage: there is simply nothing to recover
        return None
    return None


_MAP_TYPES = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})
# msgpack type byte -> bytes after it before the payload, for types with a fixed payload
_FIXED_SIZES = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
                0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
# type byte -> (width of the length, bytes between the length and the payload): bin, ext, str
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
          0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}
# type byte -> (width of the count, elements per count): array16/32, map16/32
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _msgpack_header(data: bytes | bytearray, pos: int) -> tuple[int, int]:
    """Where the msgpack value at ``pos`` ends, its elements left out, and how many elements follow.

    Raises:
        ValueError: not msgpack (a byte no type starts with).
    """
    kind = data[pos]
    if kind <= 0x7F or kind >= 0xE0 or kind in (0xC0, 0xC2, 0xC3):
        return pos + 1, 0
    if kind <= 0x8F:
        return pos + 1, 2 * (kind & 0x0F)
    if kind <= 0x9F:
        return pos + 1, kind & 0x0F
    if kind <= 0xBF:
        return pos + 1 + (kind & 0x1F), 0
    if kind in _FIXED_SIZES:
        return pos + 1 + _FIXED_SIZES[kind], 0
    if kind in _SIZED:
        width, gap = _SIZED[kind]
        return pos + 1 + width + gap + int.from_bytes(data[pos + 1:pos + 1 + width], "big"), 0
    if kind in _CONTAINERS:
        width, per_count = _CONTAINERS[kind]
        return pos + 1 + width, per_count * int.from_bytes(data[pos + 1:pos + 1 + width], "big")
    raise ValueError(f"byte {kind:#x} at {pos} starts no msgpack value")


def _msgpack_skip(data: bytes | bytearray, pos: int) -> int:
    """Where the msgpack value at ``pos`` ends, its elements included, walked in a loop (each step
    moves on by a byte at least, so garbage ends it too).

    Raises:
        ValueError, IndexError: ``data`` ends inside the value or is not msgpack.
    """
    num_left = 1
    while num_left:
        pos, num_elements = _msgpack_header(data, pos)
        num_left += num_elements - 1
    if pos > len(data):
        raise ValueError("msgpack value runs past the end")
    return pos


def _unpack(payload: Any) -> Any:
    """msgpack with invalid UTF-8 in strings kept as lone surrogates (rejected by validation, with the
    request's id, instead of failing the whole entry as undecodable)."""
    return msgpack.unpackb(payload, raw=False, unicode_errors="surrogateescape", strict_map_key=False)


def encode_result(result: GenerationResult) -> bytes:
    """The msgpack bytes stored under the result key and sent as ``d`` to reply streams."""
    unused = {name for name in _NEWER_RESULT_FIELDS if getattr(result, name) is None}
    return _pack({**result.model_dump(mode="json", exclude=unused), "v": SCHEMA_VERSION})


def decode_result(data: bytes) -> GenerationResult:
    """Inverse of :func:`encode_result`.

    Raises:
        SchemaError: the bytes are not a result of a known version.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise SchemaError(ErrorCode.UNDECODABLE.value, f"result is not msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError(ErrorCode.UNDECODABLE.value, "result is not a mapping")
    version = obj.pop("v", SCHEMA_VERSION)
    if version not in SUPPORTED_VERSIONS:
        raise SchemaError(ErrorCode.UNKNOWN_VERSION.value, f"result schema version {version!r} is not supported")
    for item in [obj, *(obj.get("samples") or [])]:
        if isinstance(item, dict) and item.get("logprobs"):  # NOTE: JSON mode made the token-id keys strings
            item["logprobs"] = [{int(k): v for k, v in d.items()} for d in item["logprobs"]]
    try:
        return GenerationResult.model_validate(obj)
    except ValidationError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, describe_validation_error(exc)) from None


def _field(fields: dict[Any, Any], name: str) -> Any:
    return fields.get(name, fields.get(name.encode()))


def _unpack_fields(fields: dict[Any, Any]) -> Any:
    raw_version = _field(fields, "v")
    if version_of(raw_version) not in SUPPORTED_VERSIONS:
        raise SchemaError(
            ErrorCode.UNKNOWN_VERSION.value,
            safe_text(f"schema version {raw_version!r} is not supported "
                      f"(this worker speaks {sorted(SUPPORTED_VERSIONS)})"),
        )
    payload = _field(fields, "d")
    if not isinstance(payload, (bytes, bytearray)):
        raise SchemaError(ErrorCode.UNDECODABLE.value, "entry has no 'd' field of msgpack bytes")
    try:
        data = _unpack(payload)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise SchemaError(ErrorCode.UNDECODABLE.value,
                          f"'d' is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise SchemaError(ErrorCode.UNDECODABLE.value, f"'d' must decode to a mapping, got {type(data).__name__}")
    return data


def describe_validation_error(exc: ValidationError) -> str:
    """Field-by-field summary of a validation error, one clause per field (the first few).

    NOTE: field names come from the input (unknown keys): the text goes through :func:`safe_text`
    so that the error result carrying it can always be encoded.
    """
    errors = exc.errors(include_input=False, include_url=False)
    parts = [f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
             for err in errors[:_MAX_ERROR_CLAUSES]]
    if len(errors) > _MAX_ERROR_CLAUSES:
        parts.append(f"and {len(errors) - _MAX_ERROR_CLAUSES} more")
    return safe_text("; ".join(parts))
