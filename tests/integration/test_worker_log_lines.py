"""What a worker logs at info: no line per answered request, one per request that failed, and a throughput line."""

from __future__ import annotations

import json
from typing import Any

import redis

from tests.worker_helpers import enqueue, make_settings, running_worker, wait_result, wait_until, worker_logs


def test_at_info_a_worker_logs_failures_and_throughput_not_each_request(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, throughput_log_s=0.2)
    keys = settings.queue.keys
    with worker_logs(as_json=True) as logs:
        with running_worker(settings):
            ok_ids = [enqueue(redis_client, keys, prompt=f"hello {i}", params={"max_tokens": 4}) for i in range(20)]
            failed_id = enqueue(redis_client, keys, prompt=None, prompt_token_ids=[10**6], params={"max_tokens": 4})
            assert all(wait_result(redis_client, keys, request_id).ok for request_id in ok_ids)
            assert wait_result(redis_client, keys, failed_id).status == "error"

            def throughput_lines() -> list[dict[str, Any]]:
                lines = [json.loads(line) for line in logs.getvalue().splitlines()]
                return [line for line in lines if line.get("event") == "throughput"]

            wait_until(lambda: sum(line["results"] for line in throughput_lines()) >= 21, timeout_s=10)
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    assert not [line for line in lines if line.get("event") == "claimed"]
    finished = [line for line in lines if line.get("event") == "finished"]
    assert [(line["request_id"], line["status"], line["level"]) for line in finished] == [(failed_id, "error", "INFO")]
    counted = [line for line in lines if line.get("event") == "throughput"]
    assert sum(line["results"] for line in counted) == 21
    assert any(line.get("ok_per_min", 0) > 0 for line in counted) and any(line.get("error_per_min", 0) > 0
                                                                          for line in counted)
