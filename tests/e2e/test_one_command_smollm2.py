"""One command each, with the real SmolLM2, as a fresh clone's user types them: ``tokenmill serve --model
smollm2-135m`` alone answers the openai SDK's chat call, and ``tokenmill bulk in.jsonl out.jsonl --model
smollm2-135m`` alone writes every row and exits 0. No Redis configured (the embedded one, a private data dir),
no settings from this machine's environment."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import openai
import pytest

from tests.one_command_helpers import cli, fresh_env, output, wait_serving
from tests.processes import free_port, scaled_s

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m"
LOAD_S = 240  # loading SmolLM2 (and, on a first start, building the CPU kernels) on 2 shared cores


def test_serve_with_the_model_alone_answers_the_openai_sdk(redis_dir: Path, tmp_path: Path) -> None:
    port, logs = free_port(), tmp_path / "serve"
    with cli(["serve", "--model", MODEL, "--port", str(port)], fresh_env(redis_dir), logs) as process:
        wait_serving(process, port, MODEL, LOAD_S, logs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.0, messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (reply.choices[0].message.content or ""), reply
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=scaled_s(60)) == 0, output(logs)[1]


def test_bulk_with_the_model_alone_writes_every_row_and_exits_0(redis_dir: Path, tmp_path: Path) -> None:
    source, out, logs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "bulk"
    prompts = ["Name a primary color.", "What is 2 + 2?", "Name a planet."]
    source.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    with cli(["bulk", str(source), str(out), "--model", MODEL, "--max-tokens", "8", "--no-progress", "--json"],
             fresh_env(redis_dir), logs) as process:
        assert process.wait(timeout=scaled_s(LOAD_S)) == 0, output(logs)[1]
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["q0", "q1", "q2"]
    assert all(row["status"] == "ok" and row["text"] and row["model"] == MODEL for row in rows.values()), rows
    assert json.loads(output(logs)[0])["complete"]
