"""How a request ended: finish reasons, error codes, abort reasons and token logprobs, as the engine and the
worker report them and the wire carries them. Pydantic only."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class FinishReason(str, enum.Enum):
    """Why a generation ended. A str enum: ``FinishReason.STOP == "stop"``, and it encodes as its value.

    ``error`` is the engine's: on the wire an error result has ``status = "error"`` and no finish
    reason (``GenerationResult.finish_reason`` admits only stop / length / abort).
    """

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled, expired, or handed back
    ERROR = "error"  # refused or failed: see the error code


class ErrorCode(str, enum.Enum):
    """Machine-readable reasons in an error result (``GenerationResult.error.code``)."""

    UNDECODABLE = "undecodable"  # the entry is not msgpack of a mapping
    UNKNOWN_VERSION = "unknown_version"  # schema version this worker does not speak
    VALIDATION = "validation"  # fields missing or invalid (e.g. no prompt, bad params, a grammar over its limits)
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) beyond the model's context or the KV cache
    MODEL_NOT_SERVED = "model_not_served"  # request names a model this worker does not run
    MAX_DELIVERIES = "max_deliveries"  # delivered too often (worker crashes); dead-lettered
    INTERNAL = "internal"  # the engine failed on this request (the worker lives on)


class AbortReason(str, enum.Enum):
    """Why a worker aborted a request it had taken, or answered one without running it. A str enum, like
    :class:`FinishReason`: ``AbortReason.EXPIRED == "expired"``.

    ``cancelled`` and ``expired`` are also the result's ``status`` and its error ``code``; a ``handover``
    is never answered: the entry stays pending for another worker.
    """

    CANCELLED = "cancelled"  # the request's id is in the queue's cancel set
    EXPIRED = "expired"  # its deadline passed before it started
    HANDOVER = "handover"  # the worker is shutting down and gives back work that has not started


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopLogprob(_Record):
    """One candidate token at one position (OpenAI's shape)."""

    token_id: int
    token: str  # its text (bytes that are not complete UTF-8 show as U+FFFD)
    bytes: list[int]  # its exact bytes: join them across tokens to rebuild split characters
    logprob: float  # natural log of its probability under the raw model distribution


class TokenLogprob(TopLogprob):
    """A generated token, with the ``top_logprobs`` alternatives asked for (most likely first)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)
