"""What a request's output must look like: the ``response_format`` of SamplingParams. Pydantic
only, no torch; engine/grammar.py turns one into a token mask.

    {"type": "text"}                                   free text (the default)
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}
    {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}    text that fully matches the regular expression
    {"type": "grammar", "grammar": "root ::= ..."}     text of an EBNF grammar (GBNF dialect, rule root)
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ResponseFormatType = Literal["text", "json_object", "json_schema", "regex", "grammar"]
SPEC_TYPES = ("json_schema", "regex", "grammar")  # each carries its spec in the field of its own name (OpenAI's shape)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``json_schema`` object. The output always follows ``schema`` strictly (properties
    the schema does not declare are never generated), whatever ``strict`` says."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # a JSON Schema; {} = any JSON
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """One of the shapes in this module's docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: ResponseFormatType = "text"
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        given = [name for name in SPEC_TYPES if getattr(self, name) is not None]
        if given != [name for name in SPEC_TYPES if name == self.type]:
            raise ValueError(f"response_format of type {self.type!r} needs exactly its own spec field, got {given}")
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
