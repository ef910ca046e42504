"""Intake under hostile requests: small-request latency on a SmolLM2 worker, idle vs while a
pathological regex (seconds to compile, killed at the limit), a 3.5 MB alternation regex (over the
size limit: refused before it is compiled) and a 3.9 MB prompt are in preparation.

Each phase submits the same small requests one after another (lane 0) and reports their latency;
the ratio loaded / idle is the figure of merit (issue 24 asks for <= 2x). Both phases run in the
same process, one after the other, on the same worker.

    python ops/bench/intake.py [--redis-url redis://127.0.0.1:6379/0] [--small 20]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from pathlib import Path

import msgpack

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import current_rss_bytes, mib, percentile, print_table
from tokenmill.producer.client import Producer
from tokenmill.protocol.schema import GenerationRequest, encode_request
from tokenmill.worker.config import Settings
from tokenmill.worker.runtime import Worker

SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 300)) + ")"  # ~27 s to compile over SmolLM2
HUGE_REGEX = "|".join(f"word{i}" for i in range(300_000))  # 3.5 MB: refused by the size limit
HUGE_PROMPT = "lorem ipsum dolor sit amet " * 145_000  # 3.9 MB


def small_latencies(producer: Producer, count: int) -> list[float]:
    latencies = []
    for i in range(count):
        started = time.monotonic()
        request_id = producer.submit(prompt=f"Say the number {i}.", max_tokens=8, priority=0)
        result = producer.result(request_id, timeout=120)
        assert result.ok, result.error
        latencies.append(time.monotonic() - started)
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--small", type=int, default=20, help="small requests per phase")
    args = parser.parse_args(argv)
    prefix = f"bench-intake-{uuid.uuid4().hex[:6]}"
    settings = Settings.load(None, {"queue": {"prefix": prefix}, "redis": {"url": args.redis_url},
                                    "worker": {"name": "bench-intake", "max_request_bytes": 8 << 20},
                                    "engine": {"model": {"name": "smollm2-135m", "device": "cpu"}}})
    worker = Worker(settings, handle_signals=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    with Producer(args.redis_url, prefix=prefix) as producer:
        small_latencies(producer, 3)  # warm-up
        idle = small_latencies(producer, args.small)
        rss_before = current_rss_bytes()
        hostile = [producer.submit(prompt="Write x.", max_tokens=4, priority=2,
                                   response_format={"type": "regex", "regex": SLOW_REGEX}),
                   producer.submit(prompt=HUGE_PROMPT, max_tokens=4, priority=2)]
        raw = GenerationRequest(prompt="x", params={"response_format": {"type": "grammar", "grammar": "root ::= x"}})
        data = raw.model_dump(mode="json")
        data["params"]["response_format"] = {"type": "regex", "regex": HUGE_REGEX}  # what no producer would send
        fields = encode_request(raw)
        fields["d"] = msgpack.packb(data, use_bin_type=True)
        producer.client.xadd(settings.queue.keys.lane(2, raw.model), fields)  # type: ignore[arg-type]
        hostile.append(raw.id)
        time.sleep(0.5)  # let them reach preparation
        loaded = small_latencies(producer, args.small)
        answers = [producer.result(request_id, timeout=300) for request_id in hostile]
        rss_after = current_rss_bytes()
    worker.stop()
    thread.join(timeout=30)
    p50_idle, p50_loaded = percentile(idle, 50), percentile(loaded, 50)
    print_table("small-request latency (s)", ["phase", "p50", "p90", "max"], [
        ["idle", f"{p50_idle:.3f}", f"{percentile(idle, 90):.3f}", f"{max(idle):.3f}"],
        ["hostile in preparation", f"{p50_loaded:.3f}", f"{percentile(loaded, 90):.3f}", f"{max(loaded):.3f}"],
    ])
    print(f"ratio p50 loaded / idle: {p50_loaded / p50_idle:.2f}x   "
          f"(p90 {percentile(loaded, 90) / percentile(idle, 90):.2f}x)")
    for name, answer in zip(["slow regex", "3.9 MB prompt", "3.5 MB regex (raw)"], answers):
        error = answer.error.code + ": " + answer.error.message[:100] if answer.error else ""
        print(f"{name}: {answer.status} {error}")
    print(f"worker process RSS: {mib(rss_before)} before the hostile requests, {mib(rss_after)} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
