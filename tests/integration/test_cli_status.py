"""``tokenmill status`` and ``tokenmill dead`` never cut a name: at an 80-column terminal a 120-character
worker name, a long model path, a long queue name and a long request id each show whole on one line;
rows that fit stay a table."""

from __future__ import annotations

import time

import redis
from typer.testing import CliRunner

from tests.worker_helpers import add_dead_letter
from tokenmill.cli.app import app
from tokenmill.producer.keys import Keys
from tokenmill.protocol.heartbeat import Heartbeat, encode_heartbeat

runner = CliRunner()
LONG_WORKER = "worker-" + "".join(str(i % 10) for i in range(113))  # 120 characters
LONG_MODEL = "/models/" + "HuggingFaceTB-SmolLM2-135M-Instruct-" * 3  # 116 characters
LONG_QUEUE = "q" * 90


def _beat(client: redis.Redis, keys: Keys, name: str, model: str) -> None:
    beat = Heartbeat(name=name, ts=time.time(), model=model, running=3, waiting=10, tokens_per_s=1234.5,
                     num_finished=100_000, prefix_hit_ratio=0.5)
    client.hset(keys.workers, name, encode_heartbeat(beat))


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def test_long_names_show_whole_at_80_columns(redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    keys = Keys(key_prefix, LONG_QUEUE)
    _beat(redis_client, keys, LONG_WORKER, LONG_MODEL)
    _beat(redis_client, keys, "short", "echo")
    assert len(LONG_WORKER) == 120
    outcome = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status", "--queue", LONG_QUEUE],
                            env={"COLUMNS": "80"})
    assert outcome.exit_code == 0, outcome.output
    lines = _lines(outcome.stdout)
    assert LONG_WORKER in lines and "short" in lines, outcome.stdout
    details = next(line for line in lines if LONG_MODEL in line)
    assert details.startswith("state running (live)  model " + LONG_MODEL) and "tok/s 1234.5" in details
    assert f"queue {keys.base}" in lines
    assert "…" not in outcome.stdout
    assert "┃ lane ┃ model ┃ depth ┃ pending ┃ lag ┃" in outcome.stdout  # the lanes still fit: a table


def test_rows_that_fit_are_a_table(redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    keys = Keys(key_prefix)
    _beat(redis_client, keys, "host-1-abc", "smollm2-135m")
    outcome = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status"],
                            env={"COLUMNS": "200"})
    assert outcome.exit_code == 0, outcome.output
    row = next(line for line in outcome.stdout.splitlines() if "host-1-abc" in line)
    assert row.startswith("│ host-1-abc ") and "smollm2-135m" in row and "1234.5" in row, outcome.stdout


def test_dead_letters_show_long_request_ids_whole(redis_url: str, key_prefix: str,
                                                  redis_client: redis.Redis) -> None:
    long_id = "request-" + "x" * 150
    add_dead_letter(redis_client, Keys(key_prefix), long_id)
    outcome = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "dead"], env={"COLUMNS": "80"})
    assert outcome.exit_code == 0, outcome.output
    assert any(f"request id {long_id}  lane " in line for line in _lines(outcome.stdout)), outcome.stdout
    assert "…" not in outcome.stdout
