"""Per-request sampling parameters of the engine (pydantic only, no torch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible per request,
    independently of whatever else shares the batch.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="most new tokens to generate")
    min_tokens: int = Field(0, ge=0, description="EOS and stop ids are suppressed before this many tokens")
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, description="stop strings, cut from the text")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs to return per token")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
