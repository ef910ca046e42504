"""The worker's HTTP port: a scrape during a run shows the work that was done; /health and /ready answer probes."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from tests.processes import free_port, scaled_s
from tests.worker_helpers import make_settings, running_worker
from tokenmill.engine.engine import Engine
from tokenmill.producer import Producer
from tokenmill.worker import runtime
from tokenmill.worker.config import Settings
from tokenmill.worker.runtime import build_engine

ROOT = Path(__file__).resolve().parents[2]


def scrape(port: int) -> dict[str, float]:
    """``name{label=value,...}`` -> value of every sample on the endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_scrape_during_a_run_shows_the_work(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    port = free_port()
    settings = make_settings(redis_url, key_prefix, metrics_port=port, engine={"model": {"max_model_len": 64}},
                             model="echo:step_delay_s=0.002")
    with running_worker(settings) as worker, Producer(redis_url, prefix=key_prefix) as producer:
        ok_ids = [producer.submit(prompt=f"hello {i}", max_tokens=8, priority="high") for i in range(10)]
        bad_id = producer.submit(prompt="x" * 200, max_tokens=4)
        results = producer.wait_all([*ok_ids, bad_id], timeout=20)
        time.sleep(3 * settings.worker.heartbeat_interval_s)  # one more beat samples rate and lanes
        samples = scrape(port)
        assert worker.metrics is not None
    assert [r.status for r in results] == ["ok"] * 10 + ["error"]
    assert samples["tokenmill_requests_total{status=ok}"] == 10
    assert samples["tokenmill_requests_total{status=error}"] == 1
    assert samples["tokenmill_generation_tokens_total"] == sum(len(r.token_ids) for r in results) > 0
    assert samples["tokenmill_prompt_tokens_total"] > 0
    for name, count in (("queue", 10), ("ttft", 10), ("e2e", 11)):  # the refused request took time too
        assert samples[f"tokenmill_request_{name}_seconds_count"] == count
        assert samples[f"tokenmill_request_{name}_seconds_sum"] > 0
    assert samples["tokenmill_request_tpot_seconds_count"] == 10
    for model in ("", "echo"):  # the shared lanes, and those of the model the worker serves
        # answered: deleted
        assert samples[f"tokenmill_lane_length{{lane=0,model={model},pool=request,queue=default}}"] == 0
        assert samples[f"tokenmill_lane_pending{{lane=0,model={model},pool=request,queue=default}}"] == 0
        assert samples[f"tokenmill_lane_lag{{lane=0,model={model},pool=request,queue=default}}"] == 0
    assert samples["tokenmill_dead_letters{queue=default}"] == 0
    for name in ("running", "waiting", "swapped"):
        assert f"tokenmill_requests_{name}" in samples
    for cause in ("memory", "priority", "starvation"):
        assert samples[f"tokenmill_preemptions_total{{cause={cause}}}"] == 0
    for name in ("tokenmill_kv_device_usage_ratio", "tokenmill_kv_host_usage_ratio",
                 "tokenmill_swap_out_bytes_total", "tokenmill_swap_in_bytes_total"):
        assert name in samples
    assert "tokenmill_generation_tokens_per_second" in samples
    assert samples[f"tokenmill_worker_info{{model=echo,prefix={key_prefix},queue=default,"
                   f"worker={settings.worker.name}}}"] == 1


def test_scrape_shows_speculative_decoding(redis_url: str, key_prefix: str) -> None:
    """The echo model's output repeats its prompt: a repeated prompt drafts (method auto), and the drafts are
    kept but where they guess the text goes on (the echo ends, with EOS)."""
    port = free_port()
    with running_worker(make_settings(redis_url, key_prefix, metrics_port=port)), \
            Producer(redis_url, prefix=key_prefix) as producer:
        ids = [producer.submit(prompt=f"{i} abcdefgh abcdefgh abcdefgh abcdefgh", max_tokens=64) for i in range(4)]
        results = producer.wait_all(ids, timeout=20)
        samples = scrape_when_up(port)
    assert [r.status for r in results] == ["ok"] * 4
    drafts, draft_tokens = samples["tokenmill_spec_drafts_total"], samples["tokenmill_spec_draft_tokens_total"]
    assert drafts > 0 and draft_tokens >= drafts
    accepted = samples["tokenmill_spec_accepted_tokens_total"]
    assert draft_tokens / 2 < accepted <= draft_tokens
    assert samples["tokenmill_spec_drafted_by_position_total{position=1}"] == drafts
    assert 0 < samples["tokenmill_spec_accepted_by_position_total{position=1}"] <= drafts
    by_position = sum(value for name, value in samples.items()
                      if name.startswith("tokenmill_spec_accepted_by_position_total{"))
    assert by_position == accepted  # a kept token counts at its position
    assert samples["tokenmill_spec_acceptance_ratio"] == pytest.approx(accepted / draft_tokens)
    assert samples["tokenmill_spec_mean_accepted_length"] == pytest.approx(accepted / drafts)
    assert samples["tokenmill_spec_mean_accepted_length"] > 1
    lengths = {name: value for name, value in samples.items() if name.startswith("tokenmill_spec_draft_length_")}
    drafted = sum(value for name, value in lengths.items() if not name.endswith("{length=0}"))
    assert drafted >= drafts, lengths  # every verified draft had a length chosen for it
    for name in ("tokenmill_spec_step_fixed_seconds", "tokenmill_spec_step_per_token_seconds"):
        assert samples[name] >= 0


def test_scrape_shows_the_predicted_backlog_and_the_predictors_accuracy(redis_url: str, key_prefix: str) -> None:
    """The echo model answers with its prompt, far shorter than max_tokens. A first round teaches the predictor
    those lengths; during the second (one request at a time) the engine's predicted backlog is positive and at most
    the waiting requests' max_tokens; once all are answered it is 0, the undelivered entries count 0 tokens, and the
    predictions made from history beat planning with max_tokens."""
    port = free_port()
    settings = make_settings(redis_url, key_prefix, metrics_port=port, model="echo:step_delay_s=0.002",
                             engine={"scheduler": {"max_num_seqs": 1}, "speculative": {"method": "off"}})
    backlog, max_tokens = "tokenmill_predicted_backlog_tokens{queue=default}", 512
    with running_worker(settings), Producer(redis_url, prefix=key_prefix) as producer:
        first = producer.wait_all([producer.submit(prompt=f"{i} echo me", max_tokens=max_tokens) for i in range(8)],
                                  timeout=20)
        ids = [producer.submit(prompt=f"{i} echo me", max_tokens=max_tokens) for i in range(8, 20)]
        deadline = time.monotonic() + 10
        while True:  # NOTE: the worker takes the requests within a few ms: this sees them in its engine
            during = scrape_when_up(port)
            if during.get(backlog, 0) > 0 or time.monotonic() > deadline:
                break
        results = producer.wait_all(ids, timeout=20)
        time.sleep(3 * settings.worker.heartbeat_interval_s)  # a beat after the last result samples the lanes
        after = scrape(port)
    assert [r.status for r in first + results] == ["ok"] * 20
    assert 0 < during[backlog] <= len(ids) * max_tokens
    assert after[backlog] == 0
    assert after["tokenmill_length_estimates_total"] >= 20
    assert after["tokenmill_length_outlived_total"] >= 0 and after["tokenmill_length_deferred_admissions_total"] >= 0
    assert 0 <= after["tokenmill_length_log_error"] < after["tokenmill_length_max_tokens_log_error"]
    for model in ("", "echo"):
        assert after[f"tokenmill_predicted_lane_backlog_tokens{{lane=0,model={model},pool=request,queue=default}}"] == 0


def scrape_when_up(port: int, timeout_s: float = 10.0) -> dict[str, float]:
    """Scrape once the worker's endpoint answers (it starts inside ``Worker.run``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return scrape(port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_two_workers_in_one_process_have_their_own_registries(redis_url: str, key_prefix: str) -> None:
    ports = [free_port(), free_port()]
    settings = [make_settings(redis_url, key_prefix, metrics_port=port) for port in ports]
    with running_worker(settings[0]) as first, running_worker(settings[1]) as second:
        assert first.metrics is not None and second.metrics is not None
        assert first.metrics.registry is not second.metrics.registry
        assert all("tokenmill_requests_running" in scrape_when_up(port) for port in ports)
    with pytest.raises(OSError):  # the endpoint stops with its worker
        scrape(ports[0])


def test_metrics_bind_the_configured_address_only(redis_url: str, key_prefix: str) -> None:
    """Metrics listen on 127.0.0.1 unless ``metrics_host`` says otherwise (they bound 0.0.0.0)."""
    port = free_port()
    with running_worker(make_settings(redis_url, key_prefix, metrics_port=port)) as worker:
        scrape_when_up(port)
        assert worker.metrics is not None and worker.metrics.bound_address == ("127.0.0.1", port)


def test_a_busy_metrics_port_fails_the_start_in_one_line_before_the_model_loads(redis_url: str,
                                                                                  key_prefix: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # NOTE: a real model: the start must fail before loading it (the README promises one line)
        done = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix", key_prefix, "worker",
             "--model", "smollm2-135m", "--device", "cpu", "--metrics-port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    *before, error = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert error.startswith(f"error: cannot serve metrics on 127.0.0.1:{port}"), done.stderr
    assert before == [line for line in before if "connected to Redis" in line], "the model never started loading"
    assert "Traceback" not in done.stderr + done.stdout


def _get(port: int, path: str) -> tuple[int, str, str]:
    """Status, content type and body of ``GET path`` on the worker's port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), str(response.headers["Content-Type"]), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc.headers["Content-Type"]), exc.read().decode()


def test_the_port_serves_metrics_health_and_ready_and_nothing_else(redis_url: str, key_prefix: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44: /health answers while the model loads, /ready only once the model is loaded and the lanes are
    read, and no other path is metrics (every path was)."""
    loaded = threading.Event()

    def slow_build(settings: Settings, client: redis.Redis | None = None) -> Engine:
        assert loaded.wait(scaled_s(30)), "never released"
        return build_engine(settings, client)

    monkeypatch.setattr(runtime, "build_engine", slow_build)
    port = free_port()
    settings = make_settings(redis_url, key_prefix, metrics_port=port)
    workers: list[runtime.Worker] = []

    def start() -> None:
        workers.append(runtime.Worker(settings, handle_signals=False))
        workers[0].run()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + scaled_s(10)
        while True:
            try:
                health = _get(port, "/health")
                break
            except OSError:  # the port is bound as the worker starts
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert health == (200, "text/plain; charset=utf-8", "ok")
        assert _get(port, "/ready") == (503, "text/plain; charset=utf-8", "loading the model")
        status, content_type, text = _get(port, "/metrics")
        assert status == 200 and content_type.startswith("text/plain; version=")
        assert "tokenmill_worker_info" in {family.name for family in text_string_to_metric_families(text)}
        for path in ("/nope", "/", "/metrics/x", "/healthz"):
            status, _, text = _get(port, path)
            assert status == 404 and "/metrics, /health and /ready" in text, (path, text)
        loaded.set()
        deadline = time.monotonic() + scaled_s(10)
        while _get(port, "/ready")[0] != 200:
            assert time.monotonic() < deadline, _get(port, "/ready")
            time.sleep(0.02)
        assert _get(port, "/ready") == (200, "text/plain; charset=utf-8", "ok")
        assert _get(port, "/health")[:2] == (200, "text/plain; charset=utf-8")
        workers[0].stop()
        thread.join(timeout=scaled_s(10))
        assert not thread.is_alive()
    finally:
        loaded.set()
        if workers:
            workers[0].stop(force=True)
        thread.join(timeout=10)
    with pytest.raises(OSError):  # the port closes with the worker
        _get(port, "/health")
