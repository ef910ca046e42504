"""Every entry point speaks exactly the one request vocabulary (protocol/): each sampling field of
``SamplingParams`` can be set through ``Producer.submit``'s options, an OpenAI chat or completions
body, a Celery task's input and keywords, and ``tokenmill submit``, and arrives on the wire with the
value given; nothing accepts a sampling field the vocabulary does not define."""

from __future__ import annotations

import typing
from typing import Any

import pytest
import typer.main

from tokenmill.cli.app import app
from tokenmill.producer.celery import request_options
from tokenmill.producer.openai_compat import parse_body
from tokenmill.producer.submit_options import SubmitOptions, build_request
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.schema import GenerationRequest

# One non-default value per field; a structured response_format excludes min_tokens and ignore_eos, so
# it goes in a second request with the rest.
VALUES: dict[str, Any] = {
    "n": 2, "max_tokens": 7, "min_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
    "stop": ["END"], "stop_token_ids": [9], "ignore_eos": True, "logprobs": 2, "presence_penalty": 0.5,
    "frequency_penalty": 0.25, "repetition_penalty": 1.1, "speculative": False,
}
STRUCTURED: dict[str, Any] = {
    **{name: value for name, value in VALUES.items() if name not in ("min_tokens", "ignore_eos")},
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
}
BOTH = pytest.mark.parametrize("values", [VALUES, STRUCTURED], ids=["plain", "structured"])


def _chat_body(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as OpenAI names them in chat: max_completion_tokens, logprobs as a flag + a count."""
    return {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": values["max_tokens"],
            "logprobs": True, "top_logprobs": values["logprobs"],
            **{name: value for name, value in values.items() if name not in ("max_tokens", "logprobs")}}


def _sent(request: GenerationRequest, names: typing.Iterable[str]) -> dict[str, Any]:
    return {name: request.params.model_dump(mode="json", exclude_none=True)[name] for name in names}


def test_values_cover_the_vocabulary() -> None:
    assert set(VALUES) | set(STRUCTURED) == set(SamplingParams.model_fields)


@BOTH
def test_submit_options_name_every_field(values: dict[str, Any]) -> None:
    assert set(SamplingParams.model_fields) <= set(typing.get_type_hints(SubmitOptions))
    assert _sent(build_request(Keys(), {"prompt": "Hi", **values}), values) == values


@BOTH
def test_openai_chat_bodies_carry_every_field(values: dict[str, Any]) -> None:
    chat = build_request(Keys(), parse_body({"model": "m", **_chat_body(values)}, "chat").options)
    assert _sent(chat, values) == values


def test_openai_completions_bodies_carry_every_field_by_name() -> None:
    # NOTE: OpenAI's completions endpoint has no response_format; every other field keeps its name.
    completions = build_request(Keys(), parse_body({"model": "m", "prompt": "Hi", **VALUES}, "completions").options)
    assert _sent(completions, VALUES) == VALUES


def test_openai_bodies_refuse_what_the_vocabulary_lacks() -> None:
    with pytest.raises(ValueError, match="mirostat"):
        parse_body({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "mirostat": 1}, "chat")


@BOTH
@pytest.mark.parametrize("placement", ["keywords", "input"])
def test_celery_tasks_carry_every_field(values: dict[str, Any], placement: str) -> None:
    options = (request_options("Hi", dict(values)) if placement == "keywords"
               else request_options({"prompt": "Hi", **values}, {}))
    assert _sent(build_request(Keys(), options), values) == values


def test_the_cli_submit_command_has_an_option_per_field() -> None:
    command = typer.main.get_command(app).commands["submit"]  # type: ignore[attr-defined]
    names = {param.name for param in command.params}
    # NOTE: response_format also comes as --json-schema / --regex; stop_token_ids is repeatable --stop-token-id.
    spelled = {"stop_token_ids": "stop_token_id"}
    missing = {field for field in SamplingParams.model_fields if spelled.get(field, field) not in names}
    assert not missing
