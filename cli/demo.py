"""The demo behind ``tokenmill demo`` (what ``make run`` calls): an embedded or given Redis, one
in-process worker on a demo queue, a handful of chat prompts through the Producer, completions as
they land. It composes the two sides, so it lives in the cli: the producer is imported here, the worker
(and through it the engine, for a real model) only inside :func:`run_demo`.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from rich.console import Console

from tokenmill.producer.client import Producer
from tokenmill.protocol.config import RedisConfig
from tokenmill.protocol.connection import resolve_url

DEMO_QUEUE = "demo"
DEMO_PROMPTS: tuple[str, ...] = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about a queue of messages waiting patiently.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 12 times 7? Show the result only.",
    "Name three planets of the solar system.",
    "Suggest a name for a friendly robot that bakes bread.",
)


@dataclass(frozen=True)
class DemoReport:
    """What the demo measured."""

    num_requests: int
    num_ok: int
    num_output_tokens: int
    wall_s: float  # from the first submit to the last result

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_demo(console: Console, *, redis_url: str | None, model: str, num_prompts: int, max_tokens: int,
             device: str = "auto", prefix: str = "tokenmill", timeout_s: float = 600.0) -> DemoReport:
    """Start a worker in a thread, submit ``num_prompts`` chat prompts, print results as they land.

    Raises:
        ProducerError: Redis cannot be reached, or results did not land within ``timeout_s``.
    """
    from tokenmill.worker.config import Settings  # noqa: PLC0415 - the cli loads the worker inside commands only
    from tokenmill.worker.runtime import Worker  # noqa: PLC0415 - as above: loads the engine

    url = resolve_url(RedisConfig(url=redis_url))  # NOTE: starts/reuses the embedded Redis when none is given
    console.print(f"[bold]tokenmill demo[/] redis={url} queue={DEMO_QUEUE} model={model}")
    settings = Settings.load(None, {"queue": {"name": DEMO_QUEUE, "prefix": prefix},
                                    "worker": {"drain_timeout_s": 10.0, "idle_wait_ms": 200},
                                    "redis": {"url": url}, "engine": {"model": {"name": model, "device": device}}})
    console.print("loading the model ...")
    worker = Worker(settings, handle_signals=False)
    thread = threading.Thread(target=worker.run, name="tm-demo-worker", daemon=True)
    thread.start()
    try:
        # NOTE: its own worker, which may not have beaten yet at the first submit: no warning about it
        with Producer(url, prefix=prefix, queue=DEMO_QUEUE, check_workers=False) as producer:
            return _submit_and_print(console, producer, num_prompts, max_tokens, timeout_s)
    finally:
        worker.stop()
        thread.join(timeout=30)
        console.print("worker stopped" if not thread.is_alive() else "[yellow]worker did not stop in 30 s[/]")


def _submit_and_print(console: Console, producer: Producer, num_prompts: int, max_tokens: int,
                      timeout_s: float) -> DemoReport:
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(num_prompts)]
    run_id = uuid.uuid4().hex[:8]
    start_s = time.monotonic()
    requests = [{"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens, "temperature": 0.0,
                 "request_id": f"demo-{run_id}-{i}", "metadata": {"n": i}} for i, p in enumerate(prompts)]
    ids = producer.submit_many(requests)
    console.print(f"submitted {len(ids)} requests; results as they complete:\n")
    num_ok = num_tokens = 0
    for result in producer.as_completed(ids, timeout=timeout_s):
        latency_s = time.monotonic() - start_s
        index = int(result.metadata.get("n", 0))
        tokens = result.usage.completion_tokens
        num_tokens += tokens
        num_ok += result.ok
        console.print(f"[bold cyan]#{index} {prompts[index]}[/]")
        if result.ok:
            console.print(result.text.strip(), markup=False)
        else:
            console.print(f"{result.status}: {result.error}", style="red", markup=False)
        console.print(f"[dim]  {tokens} tokens, {latency_s:.2f} s, finish={result.finish_reason}[/]\n")
    wall_s = time.monotonic() - start_s
    report = DemoReport(len(ids), num_ok, num_tokens, wall_s)
    console.print(f"[bold]{report.num_requests} requests ({report.num_ok} ok), {report.num_output_tokens} output "
                  f"tokens in {report.wall_s:.2f} s = {report.tokens_per_s:.1f} tokens/s[/]")
    return report

