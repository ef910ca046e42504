"""``tokenmill status`` and ``tokenmill dead`` never cut a name: at an 80-column terminal a 120-character
worker name, a long model path, a long queue name and a long request id each show whole on one line;
rows that fit stay a table. Each worker's speculative decoding shows as acceptance and tokens kept per draft."""

from __future__ import annotations

import json
import time

import msgpack
import redis
from typer.testing import CliRunner

from tests.worker_helpers import add_dead_letter, make_settings, running_worker
from tokenmill.cli.app import app
from tokenmill.producer import Producer
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


def _row(stdout: str, name: str) -> list[str]:
    """The cells of ``name``'s row of the workers table."""
    row = next(line for line in stdout.splitlines() if f"│ {name} " in line)
    return [cell.strip() for cell in row.strip("│").split("│")]


def test_speculation_column_shows_acceptance_and_mean_accepted_length(redis_url: str, key_prefix: str,
                                                                       redis_client: redis.Redis) -> None:
    keys = Keys(key_prefix)
    drafting = Heartbeat(name="drafting", ts=time.time(), model="m", spec_acceptance_rate=0.923,
                         spec_mean_accepted_length=3.14)
    redis_client.hset(keys.workers, "drafting", encode_heartbeat(drafting))
    redis_client.hset(keys.workers, "no-drafts", encode_heartbeat(Heartbeat(name="no-drafts", ts=time.time())))
    old = {"ts": time.time(), "state": "running", "model": "m", "running": 1}  # an older release: no spec_* keys
    redis_client.hset(keys.workers, "old-release", msgpack.packb(old, use_bin_type=True))
    outcome = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status"],
                            env={"COLUMNS": "200"})
    assert outcome.exit_code == 0, outcome.output
    assert "spec acc" in outcome.stdout, outcome.stdout
    assert _row(outcome.stdout, "drafting")[-1] == "0.92 x3.1"
    assert _row(outcome.stdout, "no-drafts")[-1] == "-"
    assert _row(outcome.stdout, "old-release")[-1] == "-"
    outcome = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status"],
                            env={"COLUMNS": "80"})  # too narrow for the table: one line of "column value" per worker
    assert outcome.exit_code == 0, outcome.output
    assert any(line.strip().endswith("spec acc 0.92 x3.1") for line in outcome.stdout.splitlines()), outcome.stdout


def test_an_echo_worker_reports_its_drafts(redis_url: str, key_prefix: str) -> None:
    """A real worker: the echo model repeats its prompt, so a repeated prompt drafts and its drafts are kept."""
    settings = make_settings(redis_url, key_prefix)
    name = settings.worker.name
    with running_worker(settings), Producer(redis_url, prefix=key_prefix) as producer:
        ids = [producer.submit(prompt=f"{i}: abcdefgh abcdefgh abcdefgh abcdefgh", max_tokens=64) for i in range(3)]
        assert [r.status for r in producer.wait_all(ids, timeout=20)] == ["ok"] * 3
        time.sleep(3 * settings.worker.heartbeat_interval_s)  # a beat after the last step
        as_json = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status", "--json"])
        table = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status"],
                              env={"COLUMNS": "250"})
    assert as_json.exit_code == 0 and table.exit_code == 0, as_json.output + table.output
    worker = json.loads(as_json.stdout)["workers"][name]
    rate, length = worker["spec_acceptance_rate"], worker["spec_mean_accepted_length"]
    assert 0.5 < rate <= 1.0 and length > 1.0, worker
    assert _row(table.stdout, name)[-1] == f"{rate:.2f} x{length:.1f}", table.stdout
