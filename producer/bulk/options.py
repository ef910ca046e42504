"""Bulk job options and identities: ``BulkOptions``, the job id and the deterministic request ids.

Pydantic and the standard library only; never imports torch, the engine or the worker.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class BulkOptions(BaseModel):
    """Options of one bulk run; per-item params override the sampling defaults here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = Field("auto", description="auto, jsonl, openai, csv or parquet")
    prompt_column: str = Field("prompt", min_length=1, description="CSV/Parquet column holding the prompt")
    id_column: str = Field("id", min_length=1, description="CSV/Parquet column holding the item id (optional)")
    priority: str | int = Field("low", description="high, normal, low or a lane number")
    max_in_flight: int = Field(256, ge=1, le=100_000, description="most requests outstanding at once")
    retries: int = Field(2, ge=0, le=20, description="extra attempts for retryable failures (e.g. internal)")
    errors_path: Path | None = Field(None, description="failures file; default OUTPUT + '.errors.jsonl'")
    raw: bool = Field(False, description="send plain prompts as raw text, not as a user message (chat)")
    system: str | None = Field(None, description="a system message before each plain prompt")
    cancel_on_interrupt: bool = Field(False, description="on Ctrl-C, cancel the requests this run queued")
    retry_cancelled: bool = Field(True, description="run again the rows an earlier run's requests were cancelled "
                                  "for (--cancel-on-interrupt); False: they stay in the errors file as cancelled")
    endpoint: str | None = Field(None, description="OpenAI input: the url every line must name (a batch's endpoint)")
    served_models: frozenset[str] | None = Field(None, description="the models live workers serve: an item naming "
                                                 "another is answered model_not_served, not queued; None: items "
                                                 "wait in their model's lanes for a worker serving it")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None

    @model_validator(mode="after")
    def _check_system(self) -> BulkOptions:
        if self.raw and self.system is not None:
            raise ValueError("system goes before plain prompts sent as chat, not with raw")
        return self

    @property
    def sampling_defaults(self) -> dict[str, object]:
        """The sampling options given (items override them)."""
        given = self.model_dump(include={"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"})
        return {name: value for name, value in given.items() if value is not None}


def job_id_of(output_path: Path) -> str:
    """The job's identity: a hash of the absolute OUTPUT path (same OUTPUT = same job)."""
    return hashlib.sha256(str(output_path.resolve()).encode()).hexdigest()[:16]


def request_id_of(job_id: str, item_id: str, attempt: int) -> str:
    """Deterministic request id of one attempt of one item (no whitespace, <= 64 chars for 16-char job ids)."""
    item_hash = hashlib.sha256(item_id.encode()).hexdigest()[:24]
    return f"bulk-{job_id}-{item_hash}-{attempt}"
