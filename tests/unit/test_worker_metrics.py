"""The worker's Prometheus registry without Redis or a model: the engine's stats (speculative decoding,
output-length prediction and the fleet prefix cache included) as exported at scrape time, and the Grafana
dashboard asking only for series the worker exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.core.fleet_cache import Fallback, FleetCacheStats
from tokenmill.engine.core.stats import EngineStats, GroupBacklog, LengthStats, SpeculationCounters
from tokenmill.protocol.keys import Keys
from tokenmill.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]


def _metrics() -> WorkerMetrics:
    keys = Keys("tm-unit")
    return WorkerMetrics("w-unit", "echo", keys, keys.lanes_for(["echo"]), lambda: True)


def _samples(metrics: WorkerMetrics) -> dict[str, float]:
    """``name{label=value,...}`` -> value of every sample in the registry."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _assert_samples(samples: dict[str, float], expected: dict[str, float]) -> None:
    """Each sample named in ``expected`` is there with that value (floats approximately)."""
    assert {name: samples.get(name) for name in expected} == pytest.approx(expected)


def _speculation(scale: int) -> SpeculationCounters:
    """Counters after ``scale`` rounds of: 10 drafts of 3 tokens (40 (request, step) pairs, 30 undrafted)."""
    return SpeculationCounters(
        num_drafts=10 * scale, num_draft_tokens=30 * scale, num_accepted_tokens=24 * scale,
        drafts_by_length=[0, 0, 0, 10 * scale, 0],  # by position: 10, 10, 10, 0
        drafts_by_num_kept=[0, 2 * scale, 2 * scale, 6 * scale, 0],  # by position: 10, 8, 6, 0
        draft_length_counts={0: 30 * scale, 3: 10 * scale}, step_fixed_s=0.012, step_per_token_s=0.0004,
        draft_tokens_by_proposer={"ngram": 24 * scale, "ngram-1": 6 * scale},
        accepted_tokens_by_proposer={"ngram": 22 * scale, "ngram-1": 2 * scale})


def test_speculation_counters_are_exported_with_positions_lengths_and_the_cost_model() -> None:
    metrics = _metrics()
    samples = _samples(metrics)
    for name in ("drafts", "draft_tokens", "accepted_tokens"):  # speculation off (or not yet run): zero, present
        assert samples[f"tokenmill_spec_{name}_total"] == 0
    assert samples["tokenmill_spec_acceptance_ratio"] == 0

    metrics.observe_engine(EngineStats(speculation=_speculation(1)))
    samples = _samples(metrics)
    _assert_samples(samples, {"tokenmill_spec_drafts_total": 10, "tokenmill_spec_draft_tokens_total": 30,
                              "tokenmill_spec_accepted_tokens_total": 24})
    assert [samples[f"tokenmill_spec_drafted_by_position_total{{position={p}}}"] for p in (1, 2, 3, 4)] == \
        [10, 10, 10, 0]
    assert [samples[f"tokenmill_spec_accepted_by_position_total{{position={p}}}"] for p in (1, 2, 3, 4)] == \
        [10, 8, 6, 0]
    assert "tokenmill_spec_accepted_by_position_total{position=0}" not in samples  # positions count from 1
    _assert_samples(samples, {
        "tokenmill_spec_draft_length_choices_total{length=0}": 30,
        "tokenmill_spec_draft_length_choices_total{length=3}": 10,
        "tokenmill_spec_draft_tokens_by_proposer_total{proposer=ngram}": 24,
        "tokenmill_spec_accepted_tokens_by_proposer_total{proposer=ngram-1}": 2,
        "tokenmill_spec_acceptance_ratio": 0.8, "tokenmill_spec_mean_accepted_length": 2.4,
        "tokenmill_spec_step_fixed_seconds": 0.012, "tokenmill_spec_step_per_token_seconds": 0.0004})

    # The counters follow the engine's cumulative totals: a later snapshot moves them by the difference.
    metrics.observe_engine(EngineStats(speculation=_speculation(3)))
    samples = _samples(metrics)
    _assert_samples(samples, {
        "tokenmill_spec_draft_tokens_total": 90, "tokenmill_spec_accepted_by_position_total{position=2}": 24,
        "tokenmill_spec_draft_length_choices_total{length=3}": 30,
        "tokenmill_spec_draft_tokens_by_proposer_total{proposer=ngram-1}": 18, "tokenmill_spec_acceptance_ratio": 0.8})


def _fleet(scale: int) -> FleetCacheStats:
    """Counters after ``scale`` rounds of: 10 lookups, 6 hits loading 40 blocks of 1 KiB (2 of them fetched once
    for two requests), 12 blocks published, 1 failed put, 4 fallbacks (2 timeouts, 1 cost, 1 rejected block) over
    11 blocks."""
    fallbacks = {reason.value: 0 for reason in Fallback}
    fallbacks.update(timeout=2 * scale, cost=scale, rejected=scale)
    return FleetCacheStats(
        is_on=True, num_lookups=10 * scale, num_hits=6 * scale, num_hit_blocks=40 * scale,
        num_fetched_blocks=38 * scale, num_fetched_bytes=38 * 1024 * scale, fetch_seconds=0.25 * scale,
        num_published_blocks=12 * scale, num_published_bytes=12 * 1024 * scale, num_publish_errors=scale,
        num_rejected_blocks=scale, fallbacks=fallbacks, fallback_blocks=11 * scale)


def test_fleet_cache_counters_are_exported_with_every_fallback_reason() -> None:
    metrics = _metrics()
    samples = _samples(metrics)  # fleet cache off (or not yet used): every series present, at zero
    names = ("lookups", "hits", "hit_blocks", "fetched_blocks", "fetched_bytes", "fetch_seconds", "published_blocks",
             "published_bytes", "publish_errors", "fallback_blocks", "rejected_blocks")
    for name in names:
        assert samples[f"tokenmill_fleet_cache_{name}_total"] == 0
    reasons = {"error", "timeout", "no_room", "evicted", "cost", "rejected"}
    assert {reason.value for reason in Fallback} == reasons
    for reason in reasons:
        assert samples[f"tokenmill_fleet_cache_fallbacks_total{{reason={reason}}}"] == 0

    metrics.observe_engine(EngineStats(fleet=_fleet(1)))
    samples = _samples(metrics)
    assert [samples[f"tokenmill_fleet_cache_{name}_total"] for name in names] == \
        [10, 6, 40, 38, 38 * 1024, pytest.approx(0.25), 12, 12 * 1024, 1, 11, 1]
    assert {reason: samples[f"tokenmill_fleet_cache_fallbacks_total{{reason={reason}}}"]
            for reason in ("timeout", "cost", "rejected", "no_room")} == {"timeout": 2, "cost": 1, "rejected": 1,
                                                                        "no_room": 0}

    # A later snapshot: the counters follow the engine's cumulative totals (no double counting across scrapes).
    metrics.observe_engine(EngineStats(fleet=_fleet(3)))
    _samples(metrics)
    samples = _samples(metrics)
    assert [samples[f"tokenmill_fleet_cache_{name}_total"] for name in names] == \
        [30, 18, 120, 114, 114 * 1024, pytest.approx(0.75), 36, 36 * 1024, 3, 33, 3]
    assert {reason: samples[f"tokenmill_fleet_cache_fallbacks_total{{reason={reason}}}"]
            for reason in ("timeout", "cost", "error")} == {"timeout": 6, "cost": 3, "error": 0}
    assert sum(samples[f"tokenmill_fleet_cache_fallbacks_total{{reason={r}}}"] for r in reasons) == \
        _fleet(3).num_fallbacks


# What an engine predicting lengths reports after some work: two jobs in it, errors measured.
LENGTH = LengthStats(is_on=True, num_observed=40, num_estimates=90, num_outlived=7, num_deferred_admissions=3,
                     backlog_tokens=1500.0, group_backlog={"job-a": GroupBacklog(4, 1000.0, 300.0)},
                     log_error=0.4, max_tokens_log_error=2.1)


def test_output_length_prediction_is_exported_and_absent_with_prediction_off() -> None:
    metrics = _metrics()
    samples = _samples(metrics)  # prediction off (or no request yet): the counters are zero, the rest absent
    assert samples["tokenmill_length_estimates_total"] == 0
    assert not {"tokenmill_predicted_backlog_tokens{queue=default}", "tokenmill_length_log_error",
                "tokenmill_length_max_tokens_log_error"} & set(samples)

    metrics.observe_engine(EngineStats(length=LENGTH))
    samples = _samples(metrics)
    _assert_samples(samples, {
        "tokenmill_predicted_backlog_tokens{queue=default}": 1500, "tokenmill_length_estimates_total": 90,
        "tokenmill_length_outlived_total": 7, "tokenmill_length_deferred_admissions_total": 3,
        "tokenmill_length_log_error": 0.4, "tokenmill_length_max_tokens_log_error": 2.1})


def test_the_dashboard_asks_only_for_series_the_worker_exports() -> None:
    dashboard = json.loads((ROOT / "ops" / "grafana" / "tokenmill.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    metrics = _metrics()
    metrics.observe_engine(EngineStats(speculation=_speculation(1), length=LENGTH, fleet=_fleet(1)))
    metrics.lane_length.labels("default", "request", "0", "").set(0)  # labelled series show once sampled
    for gauge in (metrics.lane_pending, metrics.lane_lag, metrics.lane_backlog_tokens):
        gauge.labels("default", "request", "0", "").set(0)
    metrics.dead_letters.labels("default").set(0)
    metrics.requests.labels("ok").inc()
    exported = {name.split("{")[0] for name in _samples(metrics)}
    asked = {name for expr in exprs for name in re.findall(r"\btokenmill_[a-z0-9_]+", expr)}
    assert {"tokenmill_spec_accepted_tokens_total", "tokenmill_spec_draft_tokens_total"} <= asked
    assert {"tokenmill_fleet_cache_fetched_bytes_total", "tokenmill_fleet_cache_published_bytes_total",
            "tokenmill_fleet_cache_hit_blocks_total", "tokenmill_fleet_cache_fallbacks_total"} <= asked
    assert asked - exported == set()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
