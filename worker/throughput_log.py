"""The worker's throughput line: what it answered since the last one, logged at info every ``throughput_log_s``.

A worker answers thousands of short requests a second; two lines per request at info (claimed and finished)
were a quarter of its CPU (232-238 us per 16-token echo result against 172-181 at warning: ops/bench/README.md,
2026-12-07, third session) and flooded log pipelines.
So an answered request is logged at debug, one that did not end ``ok`` (an error, an abort, a dead letter) or
was written twice still at info, and this line tells the rest: results per minute by status and completion
tokens per minute, as ``tokenmill serve``'s throughput line does for HTTP (serve/logs.py). Standard library only;
touched by the writer thread only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger(__name__)


class ThroughputLog:
    """Counts the results the writer stored and logs their rates every ``interval_s`` (0: never), when any.

    Args:
        interval_s: seconds between lines.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._since_s = time.monotonic()
        self._status_to_num: Counter[str] = Counter()
        self._completion_tokens = 0

    def add(self, status: str, completion_tokens: int) -> None:
        """One result stored (``dead`` for a dead letter without one)."""
        self._status_to_num[status] += 1
        self._completion_tokens += completion_tokens

    def report_if_due(self, now_s: float | None = None, *, final: bool = False) -> None:
        """Log the rates since the last line once ``interval_s`` passed (``final``: now, the worker stops), if
        anything was stored; start anew."""
        now_s = time.monotonic() if now_s is None else now_s
        elapsed_s = now_s - self._since_s
        if self.interval_s <= 0 or (elapsed_s < self.interval_s and not final) or elapsed_s <= 0:
            return
        self._since_s = now_s
        if self._status_to_num:
            per_min = 60.0 / elapsed_s
            log.info("throughput", extra={
                "event": "throughput", "results": self._status_to_num.total(),
                "results_per_min": round(self._status_to_num.total() * per_min, 1),
                **{f"{status}_per_min": round(num * per_min, 1) for status, num in sorted(self._status_to_num.items())},
                "completion_tokens_per_min": round(self._completion_tokens * per_min, 1),
                "window_s": round(elapsed_s, 1)})
        self._status_to_num.clear()
        self._completion_tokens = 0
