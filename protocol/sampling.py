"""How to generate: the sampling parameters and response format every layer speaks (the wire,
the engine, the OpenAI mapping, Celery, the CLI). Pydantic only.

Each numeric field's range is what the sampler can honour exactly in float32 (docs/design.md,
"Numeric domains"): a value the schema accepts never gives the sampler an out-of-range index, an
infinity or a NaN.

The response formats::

    {"type": "text"}                                   free text (the default)
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}
    {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}    text that fully matches the regular expression
    {"type": "grammar", "grammar": "root ::= ..."}     text of an EBNF grammar (GBNF dialect, rule root)
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.protocol.values import check_metadata, require_utf8

INT32_END = 2**31  # token ids and counts stay below this
MAX_SAMPLES = 16  # most samples (n) of one request
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's limit)
# Below this a temperature means greedy: logits / 1e-5 stay finite in float32 for any logit under
# 3e33, while a smaller divisor turns large logits into infinities (NaN probabilities). vLLM uses
# the same floor.
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# Hugging Face's repetition penalty divides (multiplies) a seen token's logit: outside [1e-2, 1e2]
# it only turns logits into infinities or zeros, which pick token 0 instead of what was asked.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_SPEC_CHARS = 64 * 1024  # longest regex or grammar text; a schema is bounded like metadata (64 KiB)

# A string that can go on the wire: valid UTF-8.
Text = Annotated[str, AfterValidator(require_utf8)]
TokenId = Annotated[int, Field(ge=0, lt=INT32_END)]
# JSON-compatible, bounded: checked at the door so that the worker can always encode the result echoing it.
Metadata = Annotated[dict[str, Any], AfterValidator(check_metadata)]

ResponseFormatType = Literal["text", "json_object", "json_schema", "regex", "grammar"]
SPEC_TYPES = ("json_schema", "regex", "grammar")  # each carries its spec in the field of its own name


class WireModel(BaseModel):
    """Request-side models: strict types (no ``"10"`` -> 10, ``1`` -> True, bytes -> str), finite numbers,
    unknown fields refused, immutable.

    NOTE: requests come from any client in any language; lax coercion let malformed ones run with
    semantics nobody asked for (``ignore_eos="yes"``, a NaN deadline that never expires).
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class JsonSchemaSpec(WireModel):
    """OpenAI's ``json_schema`` object. The output always follows ``schema`` strictly (properties the
    schema does not declare are never generated), whatever ``strict`` says."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    name: Text = Field(default="response", min_length=1, max_length=64)
    description: Text | None = None
    schema_: Metadata = Field(default_factory=dict, alias="schema", description="a JSON Schema; {} = any JSON")
    strict: bool | None = None


class ResponseFormat(WireModel):
    """What the output must look like: one of the shapes in this module's docstring."""

    type: ResponseFormatType = "text"
    json_schema: JsonSchemaSpec | None = None
    regex: Text | None = Field(default=None, min_length=1, max_length=MAX_SPEC_CHARS)
    grammar: Text | None = Field(default=None, min_length=1, max_length=MAX_SPEC_CHARS)

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        given = [name for name in SPEC_TYPES if getattr(self, name) is not None]
        if given != [name for name in SPEC_TYPES if name == self.type]:
            raise ValueError(f"type {self.type!r} needs exactly its own spec field, got {given}")
        return self

    @property
    def is_structured(self) -> bool:
        """Whether the output is constrained at all (anything but ``text``)."""
        return self.type != "text"

    @property
    def cache_key(self) -> str:
        """Canonical text of what the grammar is compiled from (the name and description do not count)."""
        spec: Any = {"json_schema": self.json_schema.schema_ if self.json_schema else None,
                     "regex": self.regex, "grammar": self.grammar}.get(self.type)
        return json.dumps([self.type, spec], sort_keys=True, separators=(",", ":"))


class SamplingParams(WireModel):
    """How to pick tokens and when to stop. ``temperature`` below :data:`GREEDY_TEMPERATURE` (0 included)
    is greedy.

    ``seed`` makes sampling reproducible per request, independently of whatever else shares the
    batch; sample ``i`` of an ``n > 1`` request uses ``seed + i``, so it draws what a separate
    request with that seed draws.
    """

    n: int = Field(default=1, ge=1, le=MAX_SAMPLES,
                   description="samples per request, sharing the prompt's KV; sample i uses seed + i")
    max_tokens: int | None = Field(default=256, ge=1, lt=INT32_END,
                                   description="most new tokens to generate; None: the rest of the model's context "
                                               "(OpenAI's and vLLM's chat default)")
    min_tokens: int = Field(default=0, ge=0, lt=INT32_END,
                            description="EOS and stop ids are suppressed before this many tokens")
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE,
                               description=f"0 (or below {GREEDY_TEMPERATURE:g}) = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0,
                         description="nucleus mass; the most likely token is always kept")
    top_k: int = Field(default=0, ge=0, lt=INT32_END, description="0 disables top-k")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[Text] = Field(default_factory=list, description="stop strings, cut from the text")
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="alternatives per token to return with its logprob")
    # Penalties (engine/sample/penalties.py): OpenAI's over the output so far, Hugging Face's over prompt + output.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                    description="OpenAI's: subtracted once from every generated token")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                     description="OpenAI's: subtracted per time a token was generated")
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                      description="Hugging Face's: divides positive (multiplies negative) "
                                                  "logits of tokens in the prompt or output")
    response_format: ResponseFormat | None = Field(default=None,
                                                   description="structured output: JSON, regex or grammar")
    speculative: bool = Field(default=True, description="false: never draft tokens for this request (the "
                              "engine's [engine.speculative] decides otherwise); greedy float32 output is the "
                              "same either way")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})")
        if any(not s for s in self.stop):
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
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_structured(self) -> bool:
        """Whether a grammar constrains the output (a response_format other than text)."""
        return self.response_format is not None and self.response_format.is_structured


    def is_min_tokens_active(self, num_output_tokens: int) -> bool:
        """Whether EOS and stop ids are still suppressed for the token at index ``num_output_tokens``:
        the one rule both the sampler (masking) and the stop check follow."""
        return num_output_tokens < self.min_tokens
