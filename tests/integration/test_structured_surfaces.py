"""Structured output and logprobs from every client surface, through a worker running the real
engine on a tiny random model: the CLI (``submit --json-schema FILE --logprobs N``, ``--regex``),
bulk JSONL records and OpenAI Batch bodies. The Producer's own is in
tests/e2e/test_queue_e2e.py, Celery's in tests/integration/test_celery.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.integration.bulk_helpers import read_jsonl
from tests.worker_helpers import make_settings, running_worker
from tokenmill.cli.app import app
from tokenmill.producer import Producer, bulk
from tokenmill.protocol.schema import GenerationResult

pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")

runner = CliRunner()
# The schema of tests/e2e/test_sampling_tiny.py: typed fields and an enum; the tiny model closes it in 40 tokens.
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["mood", "n", "ok"],
    "properties": {"mood": {"enum": ["happy", "sad", "neutral"]}, "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
STRUCTURED = {"type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("structured") / "tiny")


@pytest.fixture
def tiny_worker(redis_url: str, key_prefix: str, tiny_dir: Path) -> Iterator[None]:
    settings = make_settings(redis_url, key_prefix, model=str(tiny_dir), engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "16MiB", "swap_space": 0}})
    with running_worker(settings):
        yield


def test_cli_json_schema_file_and_logprobs(redis_url: str, key_prefix: str, tiny_worker: None,
                                           tmp_path: Path) -> None:
    schema_file = tmp_path / "mood.json"
    schema_file.write_text(json.dumps(SCHEMA))
    cli = ["--redis-url", redis_url, "--prefix", key_prefix]
    outcome = runner.invoke(app, [*cli, "submit", "How do you feel?", "--json-schema", str(schema_file),
                                  "--max-tokens", "40", "--logprobs", "2", "--timeout", "60"])
    assert outcome.exit_code == 0, outcome.output
    result = GenerationResult.model_validate_json(outcome.stdout)  # --logprobs prints the result as JSON
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.token_logprobs is not None and len(result.token_logprobs) == len(result.token_ids)
    for token_id, entry in zip(result.token_ids, result.token_logprobs):
        assert entry.token_id == token_id and entry.logprob <= 0 and len(entry.top_logprobs) == 2
    outcome = runner.invoke(app, [*cli, "submit", "Answer:", "--regex", "(yes|no), [0-9]{2}", "--max-tokens", "20",
                                  "--timeout", "60"])
    assert outcome.exit_code == 0, outcome.output
    answer, number = outcome.stdout.strip().split(", ")
    assert answer in ("yes", "no") and len(number) == 2 and number.isdigit()
    outcome = runner.invoke(app, [*cli, "submit", "x", "--response-format", '{"type": "regex", "regex": "a("}',
                                  "--timeout", "60"])
    assert outcome.exit_code == 1 and "validation" in outcome.output and "parenthesis" in outcome.output


def test_bulk_records_and_openai_bodies_carry_response_format_and_logprobs(tmp_path: Path, tiny_worker: None,
                                                                           producer: Producer) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"person {i}", "max_tokens": 40, "logprobs": 1,
                                           "params": {"response_format": STRUCTURED}}) for i in range(3)) + "\n")
    summary = bulk.run(plain, tmp_path / "plain.out.jsonl", producer=producer)
    assert summary.is_complete and summary.num_ok == 3
    for line in read_jsonl(tmp_path / "plain.out.jsonl"):
        jsonschema.validate(json.loads(line["text"]), SCHEMA)
        assert len(line["token_logprobs"]) == line["usage"]["completion_tokens"]
        assert {"token", "bytes", "logprob", "top_logprobs"} <= set(line["token_logprobs"][0])
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps({
        "custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": f"person {i}"}], "max_tokens": 40,
                 "response_format": STRUCTURED, "logprobs": True, "top_logprobs": 2}}) for i in range(3)) + "\n")
    summary = bulk.run(batch, tmp_path / "batch.out.jsonl", producer=producer)
    assert summary.is_complete and summary.num_ok == 3
    for line in read_jsonl(tmp_path / "batch.out.jsonl"):
        choice = line["response"]["body"]["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        content = choice["logprobs"]["content"]  # OpenAI's shape: token, logprob, bytes, top_logprobs
        assert content and all(len(t["top_logprobs"]) == 2 and isinstance(t["bytes"], list) for t in content)
