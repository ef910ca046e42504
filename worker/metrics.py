"""Prometheus metrics of one worker, on its own ``CollectorRegistry``: request outcomes and
latencies, token throughput, the engine's queues / KV / preemptions / swap / speculative decoding / output-length
prediction / fleet prefix cache, lane depth, and the predicted backlog in tokens (what autoscaling on work, not
entries, reads).

Imports prometheus_client lazily (it ships with the engine extra) and redis only for typing;
never the engine object. Every method is safe to call from the thread named in its docstring.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.engine.core.fleet_cache import Fallback
from tokenmill.engine.core.stats import EngineStats
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys, Lane
from tokenmill.protocol.schema import GenerationResult
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker import http_port
from tokenmill.worker.backlog import engine_backlog_tokens

if TYPE_CHECKING:
    import redis
    from prometheus_client.metrics_core import Metric

log = logging.getLogger("tokenmill.worker")

# Seconds from submission: queue wait, time to first token, end to end (long generations included).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Seconds per output token after the first.
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
# (metric name, help, value): engine counters that only grow, exported as *_total.
_ENGINE_COUNTERS: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("tokenmill_swap_out_bytes", "KV bytes copied device -> host (swap-out)", lambda s: s.swap_out_bytes),
    ("tokenmill_swap_in_bytes", "KV bytes copied host -> device (swap-in)", lambda s: s.swap_in_bytes),
    ("tokenmill_recomputed_tokens", "computed tokens whose KV was dropped by recompute preemption",
     lambda s: s.counters.num_recomputed_tokens),
    ("tokenmill_engine_steps", "engine scheduler steps", lambda s: s.counters.num_steps),
    ("tokenmill_prefix_query_tokens", "prompt tokens looked up in the prefix cache",
     lambda s: s.prefix.num_query_tokens),
    ("tokenmill_prefix_hit_tokens", "prompt tokens found in the prefix cache (not computed again)",
     lambda s: s.prefix.num_hit_tokens),
    ("tokenmill_spec_drafts", "speculative drafts verified ((request, step) pairs that ran draft tokens)",
     lambda s: s.speculation.num_drafts),
    ("tokenmill_spec_draft_tokens", "speculative draft tokens run through the model",
     lambda s: s.speculation.num_draft_tokens),
    ("tokenmill_spec_accepted_tokens", "speculative draft tokens kept (the model's own token after each draft "
     "not counted)", lambda s: s.speculation.num_accepted_tokens),
    ("tokenmill_length_estimates", "output-length estimates made (first ones and re-estimates)",
     lambda s: s.length.num_estimates),
    ("tokenmill_length_outlived", "re-estimates of requests that generated past their estimate",
     lambda s: s.length.num_outlived),
    ("tokenmill_length_deferred_admissions", "steps whose next admission the predicted-KV budget held back",
     lambda s: s.length.num_deferred_admissions),
    ("tokenmill_fleet_cache_lookups", "requests whose prompt blocks missing locally were looked up in the fleet's "
     "store", lambda s: s.fleet.num_lookups),
    ("tokenmill_fleet_cache_hits", "fleet-store lookups that loaded at least one block into the device pool",
     lambda s: s.fleet.num_hits),
    ("tokenmill_fleet_cache_hit_blocks", "prompt blocks fetched from the fleet's store and loaded into the device pool "
     "(not computed)", lambda s: s.fleet.num_hit_blocks),
    ("tokenmill_fleet_cache_fetched_blocks", "blocks fetched from the fleet's store (one fetch serves every request "
     "waiting for the same blocks)", lambda s: s.fleet.num_fetched_blocks),
    ("tokenmill_fleet_cache_fetched_bytes", "KV bytes fetched from the fleet's store",
     lambda s: s.fleet.num_fetched_bytes),
    ("tokenmill_fleet_cache_fetch_seconds", "wall time of the fleet-store lookups that fetched blocks (contains + get)",
     lambda s: s.fleet.fetch_seconds),
    ("tokenmill_fleet_cache_published_blocks", "computed prompt blocks put to the fleet's store",
     lambda s: s.fleet.num_published_blocks),
    ("tokenmill_fleet_cache_published_bytes", "KV bytes put to the fleet's store",
     lambda s: s.fleet.num_published_bytes),
    ("tokenmill_fleet_cache_publish_errors", "puts to the fleet's store that failed (their blocks stay local)",
     lambda s: s.fleet.num_publish_errors),
    ("tokenmill_fleet_cache_fallback_blocks", "blocks the fleet's store held that were computed again instead "
     "(all reasons)", lambda s: s.fleet.fallback_blocks),
    ("tokenmill_fleet_cache_rejected_blocks", "blocks fetched from the fleet's store that failed verification "
     "(another prompt's or namespace's, corrupted, implausible values): discarded from the store and computed",
     lambda s: s.fleet.num_rejected_blocks),
    ("tokenmill_fleet_cache_handoffs", "requests a prefill worker handed to this decode engine",
     lambda s: s.fleet.num_handoffs),
    ("tokenmill_fleet_cache_handoff_recomputed_blocks", "full prompt blocks of handed-off requests this engine "
     "computed itself (not found in the fleet's store)", lambda s: s.fleet.handoff_recomputed_blocks),
)
# (metric name, help, value): output-length prediction's errors, exported once known (never as a perfect 0).
_LENGTH_ERRORS: tuple[tuple[str, str, Callable[[EngineStats], float | None]], ...] = (
    ("tokenmill_length_log_error", "median |log predicted - log actual| output length of recent finished requests",
     lambda s: s.length.log_error),
    ("tokenmill_length_max_tokens_log_error", "the same for planning with max_tokens (the baseline)",
     lambda s: s.length.max_tokens_log_error),
)
# (metric name, help, value): engine state exported as gauges.
_ENGINE_GAUGES: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("tokenmill_requests_running", "requests generating in the engine", lambda s: s.num_running),
    ("tokenmill_requests_waiting", "requests waiting inside the engine", lambda s: s.num_waiting),
    ("tokenmill_requests_swapped", "requests swapped out to the host KV pool", lambda s: s.num_swapped),
    ("tokenmill_kv_device_usage_ratio", "used fraction of the device KV pool (0..1)", lambda s: s.gpu_usage),
    ("tokenmill_kv_host_usage_ratio", "used fraction of the host (swap) KV pool (0..1)", lambda s: s.cpu_usage),
    ("tokenmill_kv_device_blocks_used", "used device KV blocks", lambda s: s.num_used_gpu_blocks),
    ("tokenmill_kv_device_blocks", "device KV blocks in total", lambda s: s.num_gpu_blocks),
    ("tokenmill_kv_host_blocks_used", "used host KV blocks", lambda s: s.num_used_cpu_blocks),
    ("tokenmill_kv_host_blocks", "host KV blocks in total", lambda s: s.num_cpu_blocks),
    ("tokenmill_prefix_cached_blocks", "device KV blocks the prefix cache indexes", lambda s: s.num_cached_blocks),
    ("tokenmill_prefix_hit_ratio", "prompt tokens found in the prefix cache / looked up", lambda s: s.prefix.hit_ratio),
    ("tokenmill_spec_acceptance_ratio", "speculative draft tokens kept / run, since the worker started",
     lambda s: s.speculation.acceptance_rate),
    ("tokenmill_spec_mean_accepted_length", "speculative draft tokens kept per draft, since the worker started",
     lambda s: s.speculation.mean_accepted_length),
    ("tokenmill_spec_step_fixed_seconds", "the speculator's step cost model: seconds a step costs whatever its size",
     lambda s: s.speculation.step_fixed_s),
    ("tokenmill_spec_step_per_token_seconds", "the speculator's step cost model: seconds per token in a step",
     lambda s: s.speculation.step_per_token_s),
)


class _EngineCollector:
    """Reads the latest engine stats snapshot at scrape time."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415 - optional extra

        stats = self._metrics.engine_stats
        for name, text, gauge in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, text, value=float(gauge(stats)))
        preemptions = stats.counters.cause_to_num_preemptions
        yield _labelled_counter("tokenmill_preemptions", "preemptions by cause", "cause",
                                ((cause.value, count) for cause, count in preemptions.items()))
        # NOTE: every reason from the start (at 0), so rate() sees each series' first rise
        yield _labelled_counter("tokenmill_fleet_cache_fallbacks", "requests that computed prompt blocks the fleet's "
                                "store held (or may have held), by reason", "reason",
                                ((reason.value, stats.fleet.fallbacks.get(reason.value, 0)) for reason in Fallback))
        for name, text, counter in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, text, value=float(counter(stats)))
        spec = stats.speculation
        # NOTE: position 1 is a draft's first token; a position counts once per draft that reached it.
        yield _labelled_counter("tokenmill_spec_drafted_by_position", "speculative drafts with a token at this "
                                "position", "position", _by_position(spec.drafted_by_position))
        yield _labelled_counter("tokenmill_spec_accepted_by_position", "speculative drafts whose token at this "
                                "position was kept", "position", _by_position(spec.accepted_by_position))
        yield _labelled_counter("tokenmill_spec_draft_length_choices", "(request, step) pairs by the draft length "
                                "the speculator chose (0: no draft)", "length",
                                ((str(length), count) for length, count in sorted(spec.draft_length_counts.items())))
        yield _labelled_counter("tokenmill_spec_draft_tokens_by_proposer", "speculative draft tokens run, by the "
                                "proposer that drafted them (grammar, ngram, suffix, ngram-1 and suffix-1: single-"
                                "token matches, draft)", "proposer", sorted(spec.draft_tokens_by_proposer.items()))
        yield _labelled_counter("tokenmill_spec_accepted_tokens_by_proposer", "speculative draft tokens kept, by "
                                "proposer", "proposer", sorted(spec.accepted_tokens_by_proposer.items()))
        for name, text, error in _LENGTH_ERRORS:
            value = error(stats)
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        backlog = engine_backlog_tokens(stats.length)
        if backlog is not None:  # NOTE: absent with prediction off: a 0 would say the worker has nothing to do
            predicted = GaugeMetricFamily("tokenmill_predicted_backlog_tokens", "completion tokens this worker's "
                                          "engine is predicted to still generate for its live requests",
                                          labels=["queue"])
            predicted.add_metric([self._metrics.keys.queue], backlog)
            yield predicted


class WorkerMetrics:
    """All metrics of one worker and the HTTP endpoint that serves them.

    Args:
        worker: the worker's name (an info label; series carry no per-worker label, the
            scrape target's ``instance`` tells workers apart).
        model: the model as configured (info label; :meth:`name_model` names it as the engine does once built).
        keys: the served queue's shards (or, for a queue of one shard, its keys).
        lanes: the lanes the worker reads, of every shard (:meth:`QueueLayout.lanes_for`), sampled each beat; their
            series are labelled ``queue``, ``pool`` (request or decode), ``lane`` and ``model`` (empty for the shared
            lanes) and add up the shards (what autoscaling reads); ``tokenmill_shard_*`` have each shard's, summed
            over its lanes, labelled ``queue`` and ``shard``.
        is_redis_healthy: read at scrape time for ``tokenmill_redis_healthy`` (see worker/health.py).
    """

    def __init__(self, worker: str, model: str, keys: Keys | QueueLayout, lanes: Sequence[Lane],
                 is_redis_healthy: Callable[[], bool]) -> None:
        from prometheus_client import (  # noqa: PLC0415 - optional extra
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            Info,
        )

        self.layout = keys if isinstance(keys, QueueLayout) else QueueLayout.single(keys)
        self.keys = self.layout.home
        self.lanes = list(lanes)
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStats()  # latest engine.stats(); replaced whole, never mutated
        self._server: Any = None
        self._thread: threading.Thread | None = None
        reg = self.registry
        self._info = Info("tokenmill_worker", "the worker behind this endpoint", registry=reg)
        self._info_labels = {"worker": worker, "model": model, "queue": self.keys.queue, "prefix": self.keys.prefix}
        self._info.info(self._info_labels)
        self.requests = Counter("tokenmill_requests", "results written, by status (dead = dead-lettered, no id)",
                                ["status"], registry=reg)
        self.duplicates = Counter("tokenmill_duplicate_results", "results not stored: the id was already answered",
                                  registry=reg)
        self.handoffs = Counter("tokenmill_handoffs", "requests a prefill worker handed to the decode pool once their "
                                "prompt's KV was published (answered = the request had a result already: only acked)",
                                ["outcome"], registry=reg)
        self.queue_s = Histogram("tokenmill_request_queue_seconds", "submission to first scheduled",
                                 buckets=LATENCY_BUCKETS_S, registry=reg)
        self.ttft_s = Histogram("tokenmill_request_ttft_seconds", "submission to first token",
                                buckets=LATENCY_BUCKETS_S, registry=reg)
        self.tpot_s = Histogram("tokenmill_request_tpot_seconds", "mean time per output token after the first",
                                buckets=TPOT_BUCKETS_S, registry=reg)
        self.e2e_s = Histogram("tokenmill_request_e2e_seconds", "submission to finished",
                               buckets=LATENCY_BUCKETS_S, registry=reg)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "completion tokens generated", registry=reg)
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "prompt tokens of finished requests", registry=reg)
        self.tokens_per_s = Gauge("tokenmill_generation_tokens_per_second",
                                  "completion tokens per second over the last heartbeat interval", registry=reg)
        # NOTE: pool: "request" for the lanes producers write, "decode" for the decode pool's (prefill hand-offs)
        lane_labels = ["queue", "pool", "lane", "model"]
        self.lane_length = Gauge("tokenmill_lane_length", "XLEN of the lane stream (acked entries included "
                                 "until trimmed)", lane_labels, registry=reg)
        self.lane_pending = Gauge("tokenmill_lane_pending", "entries delivered to the group, not yet acked",
                                  lane_labels, registry=reg)
        self.lane_lag = Gauge("tokenmill_lane_lag", "entries not yet delivered to the group (Redis >= 7)",
                              lane_labels, registry=reg)
        self.lane_backlog_tokens = Gauge(
            "tokenmill_predicted_lane_backlog_tokens", "entries not yet delivered to the group times this worker's "
            "predicted mean completion length", lane_labels, registry=reg)
        self.dead_letters = Gauge("tokenmill_dead_letters", "entries in the dead-letter streams", ["queue"],
                                  registry=reg)
        shard_labels = ["queue", "shard"]
        self.shard_depth = Gauge("tokenmill_shard_length", "XLEN of the shard's lanes, summed", shard_labels,
                                 registry=reg)
        self.shard_pending = Gauge("tokenmill_shard_pending", "entries of the shard's lanes delivered, not yet acked",
                                   shard_labels, registry=reg)
        self.shard_lag = Gauge("tokenmill_shard_lag", "entries of the shard's lanes not yet delivered (Redis >= 7)",
                               shard_labels, registry=reg)
        Gauge("tokenmill_redis_healthy", "1 while the worker reaches Redis, 0 once a thread's calls failed "
              "several times in a row", registry=reg).set_function(lambda: float(is_redis_healthy()))
        reg.register(_EngineCollector(self))

    def observe_engine(self, stats: EngineStats) -> None:
        """Engine thread, after every step: keep ``engine.stats()`` for the next scrape."""
        self.engine_stats = stats

    def observe_handoff(self, is_moved: bool) -> None:
        """Writer thread, after a hand-off was written."""
        self.handoffs.labels("handed_off" if is_moved else "answered").inc()

    def observe_result(self, result: GenerationResult | None, is_stored: bool) -> None:
        """Writer thread, after a result (or a dead letter without one) was written."""
        if not is_stored and result is not None:
            self.duplicates.inc()
            return
        self.requests.labels("dead" if result is None else result.status).inc()
        if result is None:
            return
        self.generation_tokens.inc(result.usage.completion_tokens)
        self.prompt_tokens.inc(result.usage.prompt_tokens)
        timings = result.timings
        for histogram, value in ((self.queue_s, timings.queued), (self.ttft_s, timings.ttft),
                                 (self.tpot_s, timings.tpot), (self.e2e_s, timings.total)):
            if value is not None:
                histogram.observe(max(0.0, value))

    def observe_beat(self, client: redis.Redis, tokens_per_s: float, mean_length: float | None) -> None:
        """Writer thread, every heartbeat: the recent token rate, and lane depth sampled from Redis, its lag also
        in predicted tokens at ``mean_length`` (the heartbeat's; None: not predicted, not exported).

        Never raises for Redis errors: a missed sample must not stop the writer.
        """
        self.tokens_per_s.set(tokens_per_s)
        try:
            self._sample_lanes(client, mean_length)
        except Exception as exc:  # noqa: BLE001 - redis, decode or server-version surprises alike
            log.debug("lane sampling failed", extra={"event": "metrics_sample_failed", "error": str(exc)})

    def _sample_lanes(self, client: redis.Redis, mean_length: float | None) -> None:
        pipe = client.pipeline(transaction=False)
        for lane in self.lanes:
            pipe.xlen(lane.stream)
            pipe.xpending(lane.stream, CONSUMER_GROUP)
            pipe.xinfo_groups(lane.stream)
        for keys in self.layout.shards:
            pipe.xlen(keys.dead)
        replies = pipe.execute(raise_on_error=False)
        queue = self.keys.queue
        # labels -> length, pending, lag, summed over shards
        by_lane: dict[tuple[str, str, str, str], list[int | None]] = {}
        by_shard: dict[int, list[int | None]] = {}
        for position, lane in enumerate(self.lanes):
            length, pending, groups = replies[3 * position: 3 * position + 3]
            sample = [length if isinstance(length, int) else None,
                      int(pending.get("pending", 0)) if isinstance(pending, dict) else None, _group_lag(groups)]
            labels = (queue, "decode" if lane.is_decode else "request", str(lane.priority), lane.model or "")
            for sums in (by_lane.setdefault(labels, [0, 0, 0]), by_shard.setdefault(lane.shard, [0, 0, 0])):
                sums[:] = [_add(total, value) for total, value in zip(sums, sample)]
        for labels, (length, pending, lag) in by_lane.items():
            if length is not None:
                self.lane_length.labels(*labels).set(length)
            if pending is not None:
                self.lane_pending.labels(*labels).set(pending)
            if lag is not None:
                self.lane_lag.labels(*labels).set(lag)
                if mean_length is not None:
                    self.lane_backlog_tokens.labels(*labels).set(lag * mean_length)
        for shard, sums in by_shard.items():
            for gauge, value in zip((self.shard_depth, self.shard_pending, self.shard_lag), sums):
                if value is not None:
                    gauge.labels(queue, str(shard)).set(value)
        dead = replies[3 * len(self.lanes):]
        if all(isinstance(count, int) for count in dead):
            self.dead_letters.labels(queue).set(sum(dead))

    def name_model(self, model: str) -> None:
        """The model as the engine names it, once built (the endpoint is up before the model loads)."""
        self._info_labels["model"] = model
        self._info.info(self._info_labels)

    def serve(self, port: int, addr: str, *, alive: http_port.Check = http_port.fine,
              ready: http_port.Check = http_port.fine) -> None:
        """Serve ``/metrics``, and ``/health`` and ``/ready`` from the checks ``alive`` and ``ready``, on
        ``addr:port`` from a daemon thread (call once; worker/http_port.py)."""
        self._server, self._thread = http_port.start(port, addr, self.registry, alive=alive, ready=ready)

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the endpoint listens on; None when not serving."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop the HTTP endpoint, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _labelled_counter(name: str, text: str, label: str, counts: Iterable[tuple[str, float]]) -> Metric:
    """A counter family of one label: a series per ``(label value, count)``."""
    from prometheus_client.core import CounterMetricFamily  # noqa: PLC0415 - optional extra

    family = CounterMetricFamily(name, text, labels=[label])
    for value, count in counts:
        family.add_metric([value], float(count))
    return family


def _by_position(counts: Sequence[int]) -> Iterator[tuple[str, int]]:
    """Counts by draft position, the first position numbered 1."""
    return ((str(position), count) for position, count in enumerate(counts, start=1))


def _add(total: int | None, value: int | None) -> int | None:
    """A sum over lanes: unknown (None) once any part is."""
    return None if total is None or value is None else total + value


def _group_lag(groups: Any) -> int | None:
    """The ``lag`` of the ``workers`` group from an XINFO GROUPS reply (None: unknown or Redis < 7)."""
    if not isinstance(groups, list):
        return None
    for group in groups:
        if group.get("name") in (CONSUMER_GROUP, CONSUMER_GROUP.encode()):
            lag = group.get("lag")
            return int(lag) if lag is not None else None
    return None
