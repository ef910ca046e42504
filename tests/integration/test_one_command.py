"""``tokenmill serve --model echo`` and ``tokenmill bulk IN OUT --model echo`` alone, as processes, with no Redis
configured: each brings its worker and the embedded Redis, says where Redis runs, answers, and stops cleanly on
SIGTERM; a failing worker ends serve with one line. (The same with the real SmolLM2:
tests/e2e/test_one_command_smollm2.py.)"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.one_command_helpers import ROOT, cli, fresh_env, output, wait_serving
from tests.processes import free_port, scaled_s
from tokenmill.protocol import embedded_redis

EMBEDDED_LINE = "using the embedded Redis"


def test_serve_with_a_model_answers_alone_and_stops_on_sigterm(redis_dir: Path, tmp_path: Path) -> None:
    port, logs = free_port(), tmp_path / "serve"
    with cli(["serve", "--model", "echo", "--port", str(port)], fresh_env(redis_dir), logs) as process:
        wait_serving(process, port, "echo", 60, logs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="echo", max_tokens=3,
                                               messages=[{"role": "user", "content": "one two three four"}])
        text = reply.choices[0].message.content
        assert text and "one two three four".startswith(text)  # NOTE: the echo model repeats the prompt
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=scaled_s(30)) == 0, output(logs)[1]
    log = output(logs)[1]
    assert f"{EMBEDDED_LINE} (no --redis-url or REDIS_URL set" in log
    assert f"url={embedded_redis.status(redis_dir).url}" in log
    assert "draining" in log and "Traceback" not in log


def test_serve_ends_with_one_line_when_its_worker_fails(redis_dir: Path, tmp_path: Path) -> None:
    port, logs = free_port(), tmp_path / "serve"
    env = fresh_env(redis_dir, TOKENMILL_WORKER__REDIS_GIVE_UP_S="1", TOKENMILL_REDIS__CONNECT_RETRIES="0")
    with cli(["serve", "echo", "--port", str(port), "--log-level", "warning"], env, logs) as process:
        wait_serving(process, port, "echo", 60, logs)
        embedded_redis.stop(redis_dir)  # NOTE: the worker gives up on Redis after redis_give_up_s
        assert process.wait(timeout=scaled_s(60)) == 1
    last_line = output(logs)[1].strip().splitlines()[-1]
    assert last_line.startswith("error: the in-process worker stopped: ") and "tokenmill serve stopped" in last_line


def test_serve_with_a_model_refuses_a_busy_port_before_loading_it(redis_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", "echo", "--port", str(port)],
                              cwd=ROOT, env=fresh_env(redis_dir), capture_output=True, text=True, timeout=scaled_s(60))
    assert done.returncode == 1 and "loading the model" not in done.stderr
    assert not embedded_redis.status(redis_dir).is_running  # NOTE: checked before anything starts
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}: ")


def test_bulk_with_a_model_writes_every_row_and_exits_0(redis_dir: Path, tmp_path: Path) -> None:
    source, out, logs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "bulk"
    source.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"row {i} of five"}) + "\n" for i in range(5)))
    with cli(["bulk", str(source), str(out), "--model", "echo", "--max-tokens", "2", "--no-progress", "--json"],
             fresh_env(redis_dir), logs) as process:
        assert process.wait(timeout=scaled_s(60)) == 0, output(logs)[1]
    stdout, stderr = output(logs)
    assert json.loads(stdout)["ok"] == 5
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == [f"q{i}" for i in range(5)]
    assert all(row["status"] == "ok" and f"row {row_id[1]} of five".startswith(row["text"]) and row["text"]
               for row_id, row in rows.items())
    assert EMBEDDED_LINE in stderr and "claimed" not in stderr  # NOTE: its worker logs at WARNING
    assert not (tmp_path / "out.jsonl.errors.jsonl").read_text()


def test_bulk_with_a_model_answers_rows_naming_another_model_unsent(redis_dir: Path, tmp_path: Path) -> None:
    source, out, logs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "bulk"
    source.write_text(json.dumps({"id": "mine", "prompt": "a b", "model": "echo"}) + "\n"
                      + json.dumps({"id": "theirs", "prompt": "a b", "model": "gpt-4o"}) + "\n")
    with cli(["bulk", str(source), str(out), "--model", "echo", "--no-progress", "--json"], fresh_env(redis_dir),
             logs) as process:
        assert process.wait(timeout=scaled_s(60)) == 3, output(logs)[1]  # NOTE: the errors file holds a record
    [error] = map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())
    assert (error["id"], error["error"]["code"]) == ("theirs", "model_not_served")
    assert [row["id"] for row in map(json.loads, out.read_text().splitlines())] == ["mine"]


def test_bulk_with_a_model_stops_on_sigterm_and_a_rerun_finishes(redis_dir: Path, tmp_path: Path) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "word " * 30}) + "\n" for i in range(12)))
    # NOTE: 50 ms per step and 4 requests at once: the job takes seconds, the worker has requests started when stopped
    args = ["bulk", str(source), str(out), "--model", "echo:step_delay_s=0.05", "--max-num-seqs", "4",
            "--max-tokens", "20", "--no-progress", "--json"]
    with cli(args, fresh_env(redis_dir), tmp_path / "first") as process:
        deadline = time.monotonic() + scaled_s(60)
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert process.poll() is None and time.monotonic() < deadline, output(tmp_path / "first")[1]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=scaled_s(20)) == 130, output(tmp_path / "first")[1]
    first = json.loads(output(tmp_path / "first")[0])
    assert first["interrupted"] and first["ok"] < 12
    with cli(args, fresh_env(redis_dir), tmp_path / "second") as process:
        assert process.wait(timeout=scaled_s(60)) == 0, output(tmp_path / "second")[1]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == sorted(f"q{i}" for i in range(12))  # NOTE: each once
    assert all(row["status"] == "ok" for row in rows)
