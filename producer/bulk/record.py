"""A bulk job's progress in Redis, for the dashboard: one hash per job (``Keys.job``), a list of its failed rows
(``Keys.job_failures``, newest first, capped) and the job in the queue's ``jobs`` sorted set. The job writes them
as it runs, at most once a second (one pipelined round trip), so any dashboard replica shows the same progress and
a restart of the dashboard loses nothing.

Hash fields (text): ``kind`` (bulk or batch), ``input``, ``output``, ``state`` (running, done, interrupted),
``total``, ``ok``, ``failed`` (invalid rows included), ``skipped`` (finished by an earlier run), ``tokens``
(completion tokens of this run's results), ``backlog_tokens``, ``eta_s``, ``tokens_per_s`` and ``eta_error``
(:func:`prediction_error`; empty when unknown), ``started_at`` and ``updated_at`` (the Redis server's time).

Imports protocol.keys and producer.eta; never torch, the engine or the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.producer.eta import Eta
from tokenmill.protocol.keys import Keys

RECORD_TTL_S = 7 * 86_400  # a job's record outlives its run by a week
MAX_FAILURES = 1000  # failed rows kept per job (the newest)
MAX_HISTORY = 32  # (time, tokens so far, predicted backlog) snapshots kept for the ETA's error
FLUSH_INTERVAL_S = 1.0

# KEYS: the job hash, the jobs set. ARGV: ttl s, job id, then field / value pairs. Stamps updated_at (and
# started_at, the job's score, on the first write) with the server's TIME.
_WRITE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if redis.call('HSETNX', KEYS[1], 'started_at', tostring(now)) == 1 then
  redis.call('ZADD', KEYS[2], now, ARGV[2])
end
redis.call('HSET', KEYS[1], 'updated_at', tostring(now), unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def prediction_error(history: Sequence[tuple[float, int, float]], tokens_now: int, backlog_now: float) -> float | None:
    """How far off the job's predicted backlog has been so far, as a mean relative error (0.12 = 12 %).

    Each snapshot ``(t, tokens then, backlog predicted then)`` is checked against what followed: the tokens produced
    since plus what is predicted now (exact once the job is done and nothing is left). None before any snapshot with
    a backlog to check.
    """
    errors = []
    for _, tokens_then, backlog_then in history:
        realized = tokens_now - tokens_then + backlog_now
        if backlog_then <= 0 or realized <= 0:
            continue
        errors.append(abs(realized - backlog_then) / realized)
    return sum(errors) / len(errors) if errors else None


class JobRecord:
    """The progress record of one job run (see the module docstring).

    Args:
        client: a sync Redis client.
        keys: the queue's own keys.
        job_id: the job's identity (its bulk id or batch id).
        kind: ``bulk`` or ``batch``.
        input_name, output_name: what the job reads and writes (shown, never opened by the dashboard).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, client: Any, keys: Keys, job_id: str, *, kind: str, input_name: str, output_name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._keys, self.job_id, self._clock = client, keys, job_id, clock
        self._write = client.register_script(_WRITE_LUA)
        self._fields: dict[str, str] = {"kind": kind, "input": input_name, "output": output_name, "state": "running"}
        self._failures: list[str] = []
        self._history: list[tuple[float, int, float]] = []
        self._tokens = 0
        self._next_flush_s = 0.0

    def start(self, total: int, skipped: int) -> None:
        self._fields.update(total=str(total), skipped=str(skipped), ok="0", failed="0", tokens="0")
        self.flush(force=True)

    def counts(self, *, ok: int, failed: int, skipped: int, tokens: int) -> None:
        self._tokens = tokens
        self._fields.update(ok=str(ok), failed=str(failed), skipped=str(skipped), tokens=str(tokens))

    def failure(self, *, line: int, item_id: str | None, request_id: str | None, status: str, code: str,
                message: str) -> None:
        """One row that ended without a result (failed, cancelled, expired or invalid)."""
        self._failures.append(json.dumps({"line": line, "item_id": item_id, "request_id": request_id, "status": status,
                                          "code": code, "message": message[:300]}))

    def predict(self, eta: Eta) -> None:
        values = {"backlog_tokens": eta.backlog_tokens, "eta_s": eta.eta_s, "tokens_per_s": eta.tokens_per_s}
        self._fields.update({name: "" if value is None else f"{value:.6g}" for name, value in values.items()})
        if eta.backlog_tokens is None:
            return
        error = prediction_error(self._history, self._tokens, eta.backlog_tokens)
        self._fields["eta_error"] = "" if error is None else f"{error:.4f}"
        if eta.backlog_tokens > 0:
            self._history.append((self._clock(), self._tokens, eta.backlog_tokens))
            if len(self._history) > MAX_HISTORY:
                del self._history[1::2]  # NOTE: thinned, not cut: early predictions stay checked

    def finish(self, state: str) -> None:
        self._fields["state"] = state
        self.flush(force=True)

    def flush(self, *, force: bool = False) -> None:
        """Write what changed (at most once a second unless ``force``); a Redis error is the caller's (a bulk job
        meets it on its next command anyway)."""
        if not force and self._clock() < self._next_flush_s:
            return
        self._next_flush_s = self._clock() + FLUSH_INTERVAL_S
        failures, self._failures = self._failures, []
        pipe = self._client.pipeline(transaction=False)
        self._write(keys=[self._keys.job(self.job_id), self._keys.jobs],
                    args=[RECORD_TTL_S, self.job_id, *(x for pair in self._fields.items() for x in pair)], client=pipe)
        if failures:
            key = self._keys.job_failures(self.job_id)
            pipe.lpush(key, *failures)
            pipe.ltrim(key, 0, MAX_FAILURES - 1)
            pipe.expire(key, RECORD_TTL_S)
        pipe.execute()
