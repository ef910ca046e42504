"""The ``tokenmill`` commands in-process (CliRunner) against a real Redis and an echo worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from tests.integration.bulk_helpers import read_jsonl, write_input
from tests.worker_helpers import add_dead_letter, make_settings, running_worker, wait_result
from tokenmill.cli.app import app
from tokenmill.producer import Producer
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationResult, decode_request

runner = CliRunner()


@pytest.fixture
def cli(redis_url: str, key_prefix: str) -> Iterator[list[str]]:
    """Global options that point the CLI at the test's prefix."""
    yield ["--redis-url", redis_url, "--prefix", key_prefix]


@pytest.fixture
def echo_worker(redis_url: str, key_prefix: str) -> Iterator[None]:
    with running_worker(make_settings(redis_url, key_prefix)):
        yield


def test_submit_prints_the_completion(cli: list[str], echo_worker: None) -> None:
    outcome = runner.invoke(app, [*cli, "submit", "hello there", "--max-tokens", "5", "--timeout", "10"])
    assert outcome.exit_code == 0, outcome.output
    assert outcome.stdout.strip() == "hello"


def test_submit_messages_stream_and_json(cli: list[str], echo_worker: None) -> None:
    messages = json.dumps([{"role": "user", "content": "streamed"}])
    outcome = runner.invoke(app, [*cli, "submit", "--messages", messages, "--stream", "--timeout", "10"])
    assert outcome.exit_code == 0, outcome.output
    assert outcome.stdout.strip() == "streamed"
    outcome = runner.invoke(app, [*cli, "submit", "-", "--json", "--id", "my-id"], input="from stdin")
    result = GenerationResult.model_validate_json(outcome.stdout)
    assert result.id == "my-id" and result.text == "from stdin"


def test_a_plain_prompt_is_a_user_message_unless_raw(cli: list[str], redis_client: redis.Redis,
                                                     key_prefix: str) -> None:
    sent = {}
    for flags in ([], ["--system", "Be brief."], ["--raw"]):
        outcome = runner.invoke(app, [*cli, "submit", "Hi", "--no-wait", *flags])
        assert outcome.exit_code == 0, outcome.output
        sent[" ".join(flags)] = outcome.stdout.strip()
    keys = Keys(prefix=key_prefix)
    requests = {r.id: r for r in (decode_request(f) for _, f in redis_client.xrange(keys.lane(1)))}
    assert [m.model_dump() for m in requests[sent[""]].messages or []] == [{"role": "user", "content": "Hi"}]
    assert [m.role for m in requests[sent["--system Be brief."]].messages or []] == ["system", "user"]
    assert requests[sent["--raw"]].prompt == "Hi" and requests[sent["--raw"]].messages is None
    refused = runner.invoke(app, [*cli, "submit", "Hi", "--no-wait", "--raw", "--system", "x"])
    assert refused.exit_code == 1 and "invalid request: system: goes with a plain prompt" in refused.output


def test_submit_invalid_params_exit_1(cli: list[str]) -> None:
    outcome = runner.invoke(app, [*cli, "submit", "x", "--temperature", "-1", "--no-wait"])
    assert outcome.exit_code == 1 and "temperature" in outcome.output


def test_no_wait_then_result(cli: list[str], echo_worker: None) -> None:
    outcome = runner.invoke(app, [*cli, "submit", "later", "--no-wait"])
    request_id = outcome.stdout.strip()
    assert outcome.exit_code == 0 and request_id
    outcome = runner.invoke(app, [*cli, "result", request_id, "--timeout", "10", "--json"])
    assert outcome.exit_code == 0, outcome.output
    assert json.loads(outcome.stdout)["text"] == "later"


def test_result_not_landed_exits_2(cli: list[str]) -> None:
    assert runner.invoke(app, [*cli, "result", "nope"]).exit_code == 2
    assert runner.invoke(app, [*cli, "result", "nope", "--timeout", "0.2"]).exit_code == 2


def test_cancel_before_a_worker_runs_it(cli: list[str], redis_url: str, key_prefix: str,
                                        redis_client: redis.Redis) -> None:
    request_id = runner.invoke(app, [*cli, "submit", "never", "--no-wait"]).stdout.strip()
    outcome = runner.invoke(app, [*cli, "cancel", request_id])
    assert outcome.exit_code == 0 and request_id in outcome.stdout
    with running_worker(make_settings(redis_url, key_prefix)):
        assert wait_result(redis_client, Keys(key_prefix), request_id).status == "cancelled"
    outcome = runner.invoke(app, [*cli, "result", request_id])
    assert outcome.exit_code == 1 and "cancelled" in outcome.output


def test_status_table_and_json(cli: list[str], echo_worker: None, producer: Producer) -> None:
    producer.result(producer.submit(prompt="warm up"), timeout=10)
    outcome = runner.invoke(app, [*cli, "status", "--json"])
    assert outcome.exit_code == 0, outcome.output
    stats = json.loads(outcome.stdout)
    assert stats["num_live_workers"] == 1 and stats["models"] == ["echo"]
    assert [(lane["lane"], lane["model"]) for lane in stats["lanes"]] == [(k, model) for k in range(3)
                                                                          for model in (None, "echo")]
    outcome = runner.invoke(app, [*cli, "status"], env={"COLUMNS": "200"})
    assert outcome.exit_code == 0
    assert "dead letters: 0" in outcome.stdout and "echo" in outcome.stdout and "tok/s" in outcome.stdout


def test_dead_lists_and_requeues(cli: list[str], redis_url: str, key_prefix: str,
                                 redis_client: redis.Redis) -> None:
    keys = Keys(key_prefix)
    for request_id in ("dead-a", "dead-b", "dead-c"):
        add_dead_letter(redis_client, keys, request_id)
    outcome = runner.invoke(app, [*cli, "dead", "--json"])
    listed = json.loads(outcome.stdout)
    assert [d["request_id"] for d in listed] == ["dead-a", "dead-b", "dead-c"]
    assert listed[0]["reason"].startswith("max_deliveries") and listed[0]["stream"] == keys.lane(1)
    assert "dead-b" in runner.invoke(app, [*cli, "dead"], env={"COLUMNS": "200"}).stdout
    outcome = runner.invoke(app, [*cli, "dead", "--requeue", "dead-a", listed[1]["dead_id"]])
    assert outcome.exit_code == 0, outcome.output
    assert redis_client.xlen(keys.dead) == 1 and redis_client.xlen(keys.lane(1)) == 2
    assert runner.invoke(app, [*cli, "dead", "--requeue", "--all"]).exit_code == 0
    assert redis_client.xlen(keys.dead) == 0
    with running_worker(make_settings(redis_url, key_prefix)):
        for request_id in ("dead-a", "dead-b", "dead-c"):
            result = wait_result(redis_client, keys, request_id)
            assert result.ok and result.text == "revived"
    outcome = runner.invoke(app, [*cli, "dead", "--requeue", "unknown-id"])
    assert outcome.exit_code == 1 and "unknown-id" in outcome.output


def test_bulk_command(cli: list[str], tmp_path: Path, echo_worker: None) -> None:
    source = write_input(tmp_path / "in.csv", "csv", num_items=20)
    out = tmp_path / "out.jsonl"
    outcome = runner.invoke(app, [*cli, "bulk", str(source), str(out), "--max-tokens", "2", "--no-progress",
                                  "--json"])
    assert outcome.exit_code == 0, outcome.output
    summary = json.loads(outcome.stdout)
    assert summary["ok"] == 20 and summary["complete"]
    assert len(read_jsonl(out)) == 20
    outcome = runner.invoke(app, [*cli, "bulk", str(source), str(out)])
    assert outcome.exit_code == 0 and "bulk summary" in outcome.stdout


def test_bulk_reports_bad_options_and_inputs(cli: list[str], tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=2)
    outcome = runner.invoke(app, [*cli, "bulk", str(source), str(tmp_path / "o.jsonl"), "--max-in-flight", "0"])
    assert outcome.exit_code == 1 and "max_in_flight" in outcome.output
    outcome = runner.invoke(app, [*cli, "bulk", str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl")])
    assert outcome.exit_code == 1 and "does not exist" in outcome.output


def test_redis_status_of_a_dir_without_a_server(tmp_path: Path) -> None:
    outcome = runner.invoke(app, ["redis", "status", "--dir", str(tmp_path)])
    assert outcome.exit_code == 1 and "not running" in outcome.stdout
    outcome = runner.invoke(app, ["redis", "stop", "--dir", str(tmp_path)])
    assert outcome.exit_code == 0 and "was not running" in outcome.stdout


def test_demo_with_the_echo_model(cli: list[str], redis_client: redis.Redis, key_prefix: str) -> None:
    outcome = runner.invoke(app, [*cli, "demo", "--model", "echo", "--num-prompts", "3", "--max-tokens", "8"],
                            env={"CI": "true"})
    assert outcome.exit_code == 0, outcome.output
    assert "3 requests (3 ok)" in outcome.stdout and "tokens/s" in outcome.stdout
    assert "worker stopped" in outcome.stdout
    assert len(list(redis_client.scan_iter(match=Keys(key_prefix, "demo").result("*")))) == 3  # went through the queue
