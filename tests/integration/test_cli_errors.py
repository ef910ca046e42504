"""The failures users hit first, through the real ``tokenmill`` command (a subprocess): each is one
line on stderr and exit code 1, never a traceback. Warnings that let a command go on
(no live worker) are one line too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from tests.processes import free_port
from tests.worker_helpers import ROOT, make_settings, running_worker
from tokenmill.producer import Producer
from tokenmill.protocol.heartbeat import STALE_AFTER_S
from tokenmill.protocol.schema import GenerationResult, encode_result

DOWN_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def tokenmill(*args: str, env: dict[str, str] | None = None, stdin: str = "",
              timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``python -m tokenmill.cli ARGS`` with Redis connects tried once (no retry lines), in the repo root."""
    full_env = {**os.environ, "TOKENMILL_REDIS__CONNECT_RETRIES": "0", "COLUMNS": "200", **(env or {})}
    full_env.pop("REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], cwd=ROOT, env=full_env, input=stdin,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def assert_one_line_error(outcome: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1, exactly one line on stderr, no traceback; returns that line."""
    lines = outcome.stderr.splitlines()
    assert outcome.returncode == 1, (outcome.returncode, outcome.stderr)
    assert len(lines) == 1, outcome.stderr
    assert "Traceback" not in outcome.stderr + outcome.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_worker_with_redis_down() -> None:
    line = assert_one_line_error(tokenmill("--redis-url", DOWN_URL, "worker", "--model", "echo"),
                                 "could not reach Redis at redis://127.0.0.1:1/0")
    assert line.startswith("error: ")


def test_serve_with_redis_down_is_one_line_and_exit_code_2() -> None:
    """Issue 44: uvicorn printed three tracebacks (~100 lines) and exited 3."""
    outcome = tokenmill("--redis-url", DOWN_URL, "serve", "--port", str(free_port()))
    assert outcome.returncode == 2, (outcome.returncode, outcome.stderr)
    assert len(outcome.stderr.splitlines()) == 1 and outcome.stdout == "", outcome.stderr
    line = outcome.stderr.strip()
    for needle in ("error: could not reach Redis at redis://127.0.0.1:1/0", "is Redis running", "REDIS_URL",
                   "--redis-url"):
        assert needle in line, line


@pytest.mark.parametrize("command", [["status"], ["submit", "hi", "--no-wait"], ["cancel", "some-id"]])
def test_client_commands_with_redis_down(command: list[str]) -> None:
    assert_one_line_error(tokenmill("--redis-url", DOWN_URL, *command), "could not reach Redis")


def test_worker_with_a_missing_model(redis_url: str, key_prefix: str) -> None:
    outcome = tokenmill("--redis-url", redis_url, "--prefix", key_prefix, "worker", "--model", "/no/such/model",
                        "--log-level", "warning")
    assert_one_line_error(outcome, "model file or directory not found: /no/such/model")


def test_worker_with_an_unloadable_model(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    outcome = tokenmill("--redis-url", redis_url, "--prefix", key_prefix, "worker", "--model", str(model_dir),
                        "--log-level", "WARNING")
    assert_one_line_error(outcome, f"cannot load model '{model_dir}'", "model_type")


def test_worker_with_an_uncached_hub_id(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """Read from the local cache only: no download retries, one line that says what to do."""
    outcome = tokenmill("--redis-url", redis_url, "--prefix", key_prefix, "worker", "--model", "someorg/no-such-model",
                        "--log-level", "WARNING", env={"HF_HOME": str(tmp_path / "hf")})
    assert_one_line_error(outcome, "'someorg/no-such-model'", "hf download someorg/no-such-model")


def test_typo_in_a_config_file_suggests_the_nearest_key(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('[worker]\nmax_wating = 3\n')
    outcome = tokenmill("--config", str(path), "--redis-url", DOWN_URL, "worker", "--model", "echo")
    assert_one_line_error(outcome, "worker.max_wating", "did you mean 'worker.max_waiting'?")
    path.write_text('[queue]\nnmae = "q"\n')
    assert_one_line_error(tokenmill("--config", str(path), "--redis-url", DOWN_URL, "status"),
                          "queue.nmae", "did you mean 'queue.name'?")
    path.write_text('[queu]\nname = "q"\n')  # a misspelt section: clients read only [queue] and [redis], yet say so
    assert_one_line_error(tokenmill("--config", str(path), "--redis-url", DOWN_URL, "submit", "x"),
                          "did you mean 'queue'?")


def test_typo_in_an_env_name_suggests_the_nearest_key() -> None:
    outcome = tokenmill("--redis-url", DOWN_URL, "worker", "--model", "echo",
                        env={"TOKENMILL_ENGINE__SCHEDULER__MAX_NUM_SEQ": "4"})
    assert_one_line_error(outcome, "did you mean 'engine.scheduler.max_num_seqs'?")


def test_bad_log_level(redis_url: str) -> None:
    outcome = tokenmill("--redis-url", redis_url, "worker", "--model", "echo", "--log-level", "loud")
    assert_one_line_error(outcome, "worker.log_level")


def test_cancel_of_an_unknown_id_says_so(redis_url: str, key_prefix: str, producer: Producer) -> None:
    queued = producer.submit(prompt="waits", request_id="queued-one")
    outcome = tokenmill("--redis-url", redis_url, "--prefix", key_prefix, "cancel", "no-such-id")
    assert_one_line_error(outcome, "no request no-such-id in queue", "never submitted")
    producer.client.set(producer.keys.result("done-one"), encode_result(GenerationResult(id="done-one", status="ok")))
    outcome = tokenmill("--redis-url", redis_url, "--prefix", key_prefix, "cancel", queued, "done-one")
    assert outcome.returncode == 0, outcome
    assert outcome.stdout.splitlines() == [f"cancel requested: {queued}",
                                           "already finished: done-one (its result stays; nothing to cancel)"]
    assert producer.client.zscore(producer.keys.cancel, queued) is not None
    assert producer.client.zscore(producer.keys.cancel, "done-one") is None


def test_submit_and_bulk_warn_when_no_live_worker_serves_the_queue(redis_url: str, key_prefix: str,
                                                                   tmp_path: Path) -> None:
    common = ["--redis-url", redis_url, "--prefix", key_prefix]
    outcome = tokenmill(*common, "submit", "nobody listens", "--no-wait", "--queue", "lonely")
    assert outcome.returncode == 0 and outcome.stdout.strip(), outcome
    assert outcome.stderr.splitlines() == [
        f"warning: no live worker serves queue {key_prefix}:lonely; requests wait until one starts (tokenmill worker)"]
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "x", "params": {"max_tokens": 0}}) + "\n")  # invalid: no wait
    outcome = tokenmill(*common, "bulk", str(source), str(tmp_path / "out.jsonl"), "--queue", "lonely",
                        "--no-progress", "--json")
    assert outcome.returncode == 3 and json.loads(outcome.stdout)["invalid"] == 1, outcome
    assert outcome.stderr.splitlines() == [
        f"warning: no live worker serves queue {key_prefix}:lonely; requests wait until one starts (tokenmill worker)"]


def test_no_warning_with_a_live_worker(redis_url: str, key_prefix: str) -> None:
    with running_worker(make_settings(redis_url, key_prefix, stale_after_s=5.0)):
        outcome = tokenmill("--redis-url", redis_url, "--prefix", key_prefix, "submit", "hello", "--timeout", "30")
    assert outcome.returncode == 0 and outcome.stdout.strip() == "hello", outcome
    assert outcome.stderr == ""


def test_status_judges_staleness_as_the_workers_do(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """One constant: the worker's default stale_after_s is status's default; a file's [worker] value is both's."""
    from tokenmill.worker.config import WorkerConfig

    assert WorkerConfig().stale_after_s == STALE_AFTER_S
    with Producer(redis_url, prefix=key_prefix) as producer:
        producer.client.hset(producer.keys.workers, "w-old",
                             msgpack.packb({"ts": time.time() - 20, "state": "running"}))
    common = ["--redis-url", redis_url, "--prefix", key_prefix]
    assert json.loads(tokenmill(*common, "status", "--json").stdout)["num_live_workers"] == 0  # 20 s > 15 s
    path = tmp_path / "deploy.toml"
    path.write_text("[worker]\nstale_after_s = 60.0\n")
    assert json.loads(tokenmill("--config", str(path), *common, "status", "--json").stdout)["num_live_workers"] == 1
    assert json.loads(tokenmill(*common, "status", "--json", "--stale-after", "30").stdout)["num_live_workers"] == 1
