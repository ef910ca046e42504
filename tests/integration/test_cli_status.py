"""``tokenmill status`` and ``tokenmill dead`` never cut a name: at an 80-column terminal a 120-character
worker name, a long model path, a long queue name and a long request id each show whole on one line;
rows that fit stay a table. Each worker's speculative decoding shows as acceptance and tokens kept per draft. The
queue's predicted backlog in completion tokens and its ETA show under the lanes, each worker's backlog in its row."""

from __future__ import annotations

import json
import re
import time

import msgpack
import redis
from typer.testing import CliRunner

from tests.worker_helpers import add_dead_letter, make_settings, running_worker
from tokenmill.cli.app import app
from tokenmill.producer import Producer
from tokenmill.protocol.heartbeat import Heartbeat, JobBacklog, encode_heartbeat
from tokenmill.protocol.keys import Keys

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


def _cell(stdout: str, name: str, column: str) -> str:
    """``name``'s cell in ``column`` of the workers table."""
    header = next(line for line in stdout.splitlines() if "┃ name " in line)
    columns = [cell.strip() for cell in header.strip("┃").split("┃")]
    return _row(stdout, name)[columns.index(column)]


def test_the_predicted_backlog_and_eta_show_for_the_queue_and_each_worker(
        redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    keys = Keys(key_prefix)
    for name, backlog, mean in (("w1", 1000.0, 100.0), ("w2", 500.0, 300.0)):
        beat = Heartbeat(name=name, ts=time.time(), tokens_per_s=250.0, running=2, backlog_tokens=backlog,
                         mean_length=mean, jobs={"job": JobBacklog(num_requests=2, backlog_tokens=backlog)})
        redis_client.hset(keys.workers, name, encode_heartbeat(beat))
    old = {"ts": time.time(), "state": "running", "model": "m"}  # an older release: predicts nothing, runs nothing
    redis_client.hset(keys.workers, "old-release", msgpack.packb(old, use_bin_type=True))
    for i in range(5):  # undelivered entries (no group yet): each at the fleet's mean length, (100 + 300) / 2
        redis_client.xadd(keys.lane(2), {"i": i})
    as_json = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status", "--json"])
    table = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status"], env={"COLUMNS": "200"})
    assert as_json.exit_code == 0 and table.exit_code == 0, as_json.output + table.output
    stats = json.loads(as_json.stdout)
    assert (stats["backlog_tokens"], stats["eta_s"]) == (1000 + 500 + 5 * 200, 2500 / 500)
    assert "backlog tok: 2500   ETA: 0:00:05" in _lines(table.stdout), table.stdout
    assert [_cell(table.stdout, name, "backlog tok") for name in ("w1", "w2", "old-release")] == ["1000", "500", "-"]
    assert _cell(table.stdout, "w1", "spec acc") == "-"


def test_an_echo_worker_reports_its_jobs_predicted_backlog(redis_url: str, key_prefix: str) -> None:
    """A real worker, one request at a time: what it still holds of a job is predicted and shown, with an ETA."""
    # NOTE: a result lands every ~0.17 s, so a beat's token rate (of its interval's results) is never 0 while it runs
    settings = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.01", heartbeat_interval_s=0.5,
                             stale_after_s=1.0,
                             engine={"scheduler": {"max_num_seqs": 1}, "speculative": {"method": "off"}})
    name = settings.worker.name
    with running_worker(settings), Producer(redis_url, prefix=key_prefix) as producer:
        job = producer.keys.reply("job-1")
        ids = [producer.submit(prompt=f"{i} echo me", max_tokens=16, ignore_eos=True, reply_to=job) for i in range(12)]
        deadline = time.monotonic() + 10
        while True:  # until a beat shows the job and a token rate (the first results landed)
            stats = producer.stats()
            beat = stats["workers"][name]
            if job in beat["jobs"] and stats["eta_s"] is not None:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
        table = runner.invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status"],
                              env={"COLUMNS": "250"})
        assert [r.status for r in producer.wait_all(ids, timeout=20)] == ["ok"] * 12
    held = beat["jobs"][job]
    assert 0 < held["num_requests"] <= 12 and 0 < held["backlog_tokens"] <= 16 * held["num_requests"]
    assert beat["backlog_tokens"] >= held["backlog_tokens"] and beat["mean_length"] is not None
    assert 0 < stats["backlog_tokens"] <= 16 * 12 and stats["eta_s"] > 0
    assert table.exit_code == 0, table.output
    # NOTE: once the worker generates at some rate, the ETA is known (0:00:00 once it is done)
    assert any(re.fullmatch(r"backlog tok: \d+   ETA: 0:00:\d\d", line) for line in _lines(table.stdout)), table.stdout
    assert _cell(table.stdout, name, "backlog tok").isdigit()
