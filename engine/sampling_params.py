"""Per-request sampling parameters of the engine (pydantic only, no torch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.response_format import ResponseFormat


MAX_SAMPLES = 16


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible per request,
    independently of whatever else shares the batch; sample ``i`` of an ``n > 1`` request uses
    ``seed + i``, so it draws what a separate request with that seed draws.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="samples per request; they share the prompt's KV blocks")
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
    # Penalties (engine/penalties.py): OpenAI's over the output so far, Hugging Face's over prompt + output.
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once from every generated token")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted per time a token was generated")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                                      description="divides positive (multiplies negative) logits of seen tokens")
    response_format: ResponseFormat | None = Field(None, description="structured output: JSON, regex or grammar")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.is_structured and (self.min_tokens or self.ignore_eos):
            # NOTE: a complete structured output can only end: holding EOS back would leave no token to pick.
            raise ValueError("min_tokens and ignore_eos cannot be combined with a structured response_format")
        return self

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n > 1`` request: one sample, seed + index."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return self.model_copy(update={"n": 1, "seed": seed})

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_structured(self) -> bool:
        """Whether a grammar constrains the output (a response_format other than text)."""
        return self.response_format is not None and self.response_format.is_structured
