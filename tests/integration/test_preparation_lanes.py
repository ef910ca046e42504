"""Intake that cannot be blocked: while a large prompt or a grammar is still being
prepared, small requests are tokenized, run and answered; the heavy one follows when it is ready."""

from __future__ import annotations

import threading
from typing import Any

import redis

from tests.worker_helpers import enqueue, make_settings, running_worker, wait_result
from tokenmill.engine.engine import Engine
from tokenmill.engine.output.prompts import Prompt, TextPrompt
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.preparation import HEAVY_PROMPT_CHARS


class BlockingPreparation(Engine):
    """The echo model's engine, whose preparation of heavy requests waits until the test releases it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.heavy_started = threading.Event()

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TextPrompt) and len(prompt.text) > HEAVY_PROMPT_CHARS:
            self._hold()
        return super().tokenize(prompt)

    def compile_grammar(self, params: SamplingParams) -> None:
        if params.is_structured:
            self._hold()

    def _hold(self) -> None:
        self.heavy_started.set()
        assert self.release.wait(30), "the test never released the heavy preparation"


def test_small_requests_pass_a_large_prompt_and_a_grammar_in_preparation(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, engine={"model": {"max_model_len": 2 * HEAVY_PROMPT_CHARS}})
    keys = settings.queue.keys
    engine = BlockingPreparation.from_config(settings.engine)
    with running_worker(settings, engine=engine):
        large = enqueue(redis_client, keys, lane=0, prompt="x" * (HEAVY_PROMPT_CHARS + 1),
                        params={"max_tokens": 4})
        structured = enqueue(redis_client, keys, lane=0, prompt="{}",
                             params={"max_tokens": 4, "response_format": {"type": "json_object"}})
        assert engine.heavy_started.wait(10)
        small = [enqueue(redis_client, keys, lane=1, prompt=f"small {i}") for i in range(10)]
        texts = [wait_result(redis_client, keys, request_id).text for request_id in small]
        assert texts == [f"small {i}" for i in range(10)]
        assert redis_client.get(keys.result(large)) is None and redis_client.get(keys.result(structured)) is None
        engine.release.set()
        assert wait_result(redis_client, keys, large).text == "x" * 4
        assert wait_result(redis_client, keys, structured).status == "ok"
