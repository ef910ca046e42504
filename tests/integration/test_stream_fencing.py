"""Token streams once per attempt: a worker paused mid-stream is reclaimed and
the request runs again elsewhere from its first token; readers (Producer.stream and
AsyncProducer.stream, which serve's SSE reads through) get the final text exactly once (they got
the paused run's part and then the whole new run: 10/10 streams ~2x the text)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import redis

from tests.worker_helpers import start_worker_process, wait_result
from tokenmill.producer import AsyncProducer, Producer
from tokenmill.protocol.keys import Keys

NUM_STREAMS = 10
MODEL = "echo:step_delay_s=0.02"
# NOTE: speculation off: echo's drafts are always kept, and with them a request could end before the
# first worker is paused mid-stream.
FAST = {"TOKENMILL_WORKER__HEARTBEAT_INTERVAL_S": "0.1", "TOKENMILL_WORKER__STALE_AFTER_S": "0.5",
        "TOKENMILL_ENGINE__SPECULATIVE__METHOD": "off"}


def test_a_reclaimed_request_streams_its_text_once(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    texts: dict[str, str] = {}
    with Producer(redis_url, prefix=key_prefix) as producer:
        ids = [producer.submit(prompt=f"stream {i:02d} " * 3, stream_tokens=True)
               for i in range(NUM_STREAMS)]

        def read_sync(request_id: str) -> None:
            texts[request_id] = "".join(producer.stream(request_id, timeout=60))

        async def read_async(request_ids: list[str]) -> None:
            async with AsyncProducer(redis_url, prefix=key_prefix) as aproducer:
                async def read(request_id: str) -> None:
                    texts[request_id] = "".join([t async for t in aproducer.stream(request_id, timeout=60)])

                await asyncio.gather(*(read(rid) for rid in request_ids))

        half = NUM_STREAMS // 2
        readers = [threading.Thread(target=read_sync, args=(rid,)) for rid in ids[:half]]
        readers.append(threading.Thread(target=lambda: asyncio.run(read_async(ids[half:]))))
        for reader in readers:
            reader.start()
        paused = start_worker_process(redis_url, key_prefix, "paused", model=MODEL, env=FAST)
        rescuer = None
        try:
            deadline = time.monotonic() + 30
            while not all(redis_client.xlen(keys.tokens(rid)) >= 3 for rid in ids):
                assert time.monotonic() < deadline, "the first worker never streamed"
                time.sleep(0.005)
            paused.send_signal(signal.SIGSTOP)
            rescuer = start_worker_process(redis_url, key_prefix, "rescuer", model=MODEL, env=FAST)
            results = {rid: wait_result(redis_client, keys, rid, timeout_s=60) for rid in ids}
            paused.send_signal(signal.SIGCONT)  # NOTE: it goes on writing its own run's deltas
            for reader in readers:
                reader.join(timeout=60)
        finally:
            paused.send_signal(signal.SIGCONT)
            for process in (paused, rescuer):
                if process is not None:
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=20)
    assert all(result.ok and result.worker == "rescuer" for result in results.values()), results
    assert {rid: texts.get(rid) for rid in ids} == {rid: results[rid].text for rid in ids}
