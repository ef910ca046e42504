"""``make run``'s demo end to end with the real SmolLM2, with wait slices shorter than the model's
load time, so results always land after several slices have expired."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tokenmill.cli.demo import run_demo
from tokenmill.producer import result_waits

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_answers_every_prompt_when_waits_expire_first(redis_url: str, key_prefix: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(result_waits, "WAIT_SLICE_S", 0.05)
    output = io.StringIO()
    report = run_demo(Console(file=output, width=120), redis_url=redis_url, model="smollm2-135m", num_prompts=8,
                      max_tokens=12, device="cpu", prefix=key_prefix, timeout_s=300)
    assert (report.num_requests, report.num_ok) == (8, 8), output.getvalue()
    assert report.num_output_tokens > 0
    assert "Paris" in output.getvalue()  # "What is the capital of France?" answered by a real model
