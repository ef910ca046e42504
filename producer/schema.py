"""The wire contract (DESIGN.md): pydantic v2 models, msgpack-encoded, versioned.

A request is one stream entry with fields ``d`` (msgpack bytes) and ``v`` (schema version).
A result is msgpack bytes stored as a plain string value and XADDed to reply streams as
``d`` + ``v``. No pickle anywhere. Never imports torch or the engine.
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from producer.errors import SchemaError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
MAX_ID_LENGTH = 256


class ErrorCode(str, enum.Enum):
    """Machine-readable reasons in ``GenerationResult.error.code``."""

    UNDECODABLE = "undecodable"  # the entry is not msgpack of a mapping
    UNKNOWN_VERSION = "unknown_version"  # schema version this worker does not speak
    VALIDATION = "validation"  # fields missing or invalid (e.g. no prompt, bad params)
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) beyond the model's context or the KV cache
    MODEL_NOT_SERVED = "model_not_served"  # request names a model this worker does not run
    MAX_DELIVERIES = "max_deliveries"  # delivered too often (worker crashes); dead-lettered
    INTERNAL = "internal"  # the engine failed on this request


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Model):
    """How to generate. ``temperature == 0`` is greedy."""

    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    min_tokens: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self


class Message(BaseModel):
    """One chat message; extra keys (e.g. ``name``) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(..., min_length=1)
    content: str


def new_request_id() -> str:
    return uuid.uuid4().hex


class GenerationRequest(_Model):
    """One unit of work. ``id`` is the idempotency key: one id, one result."""

    id: str = Field(default_factory=new_request_id, min_length=1, max_length=MAX_ID_LENGTH)
    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=0, description="lane; lower = more urgent")
    deadline: float | None = Field(
        default=None, description="unix time; work not started by then is answered 'expired'"
    )
    reply_to: str | None = Field(default=None, min_length=1, description="stream that also receives the result")
    stream_tokens: bool = False
    model: str | None = Field(
        default=None, description="model the caller expects; a worker serving another answers an error"
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="echoed back in the result")
    submitted_at: float = Field(default_factory=time.time, description="unix time the producer enqueued it")

    @field_validator("id")
    @classmethod
    def _id_chars(cls, value: str) -> str:
        if any(ch.isspace() for ch in value):
            raise ValueError("id must not contain whitespace")
        return value

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> GenerationRequest:
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt / messages / prompt_token_ids is required, got {given or 'none'}")
        if self.prompt_token_ids is not None and (
            not self.prompt_token_ids or any(t < 0 for t in self.prompt_token_ids)
        ):
            raise ValueError("prompt_token_ids must be a non-empty list of non-negative ints")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
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
FinishReason = Literal["stop", "length", "abort"]


class GenerationResult(_Model):
    """The one answer to one request id."""

    id: str
    status: ResultStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    worker: str | None = None
    error: ErrorInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    logprobs: list[dict[int, float]] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def failure(
        cls,
        request_id: str,
        code: ErrorCode | str,
        message: str,
        *,
        status: ResultStatus = "error",
        worker: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> GenerationResult:
        """A result that carries no generation, only why."""
        code_text = code.value if isinstance(code, ErrorCode) else code
        return cls(
            id=request_id,
            status=status,
            finish_reason="abort" if status != "error" else None,
            worker=worker,
            error=ErrorInfo(code=code_text, message=message),
            metadata=metadata or {},
        )


def _pack(obj: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def encode_request(request: GenerationRequest) -> dict[str, bytes | int]:
    """Stream-entry fields (``d``, ``v``) for XADD."""
    return {"d": _pack(request.model_dump(mode="json", exclude_none=True)), "v": SCHEMA_VERSION}


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


def peek_request_id(fields: dict[Any, Any]) -> str | None:
    """Best-effort id of an entry that failed to decode, so its error result has an address."""
    try:
        data = msgpack.unpackb(_field(fields, "d"), raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any garbage: there is simply no id to recover
        return None
    rid = data.get("id") if isinstance(data, dict) else None
    if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LENGTH and not any(c.isspace() for c in rid):
        return rid
    return None


def encode_result(result: GenerationResult) -> bytes:
    """The msgpack bytes stored under the result key and sent as ``d`` to reply streams."""
    return _pack({**result.model_dump(mode="json"), "v": SCHEMA_VERSION})


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
    if obj.get("logprobs"):
        obj["logprobs"] = [{int(k): v for k, v in d.items()} for d in obj["logprobs"]]
    try:
        return GenerationResult.model_validate(obj)
    except ValidationError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, describe_validation_error(exc)) from None


def _field(fields: dict[Any, Any], name: str) -> Any:
    return fields.get(name, fields.get(name.encode()))


def _unpack_fields(fields: dict[Any, Any]) -> Any:
    raw_version = _field(fields, "v")
    try:
        version = int(raw_version) if raw_version is not None else None
    except (TypeError, ValueError):
        version = None
    if version not in SUPPORTED_VERSIONS:
        raise SchemaError(
            ErrorCode.UNKNOWN_VERSION.value,
            f"schema version {raw_version!r} is not supported (this worker speaks {sorted(SUPPORTED_VERSIONS)})",
        )
    payload = _field(fields, "d")
    if not isinstance(payload, (bytes, bytearray)):
        raise SchemaError(ErrorCode.UNDECODABLE.value, "entry has no 'd' field of msgpack bytes")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise SchemaError(ErrorCode.UNDECODABLE.value, f"'d' is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise SchemaError(ErrorCode.UNDECODABLE.value, f"'d' must decode to a mapping, got {type(data).__name__}")
    return data


def describe_validation_error(exc: ValidationError) -> str:
    """Field-by-field summary of a validation error, one clause per field."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
