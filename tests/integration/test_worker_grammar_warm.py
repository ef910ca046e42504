"""A worker warms its engine's grammar compiler when it starts, on a thread of its own: plain
requests are served while the warm-up is still running, a failed warm-up is logged and the worker serves on,
and ``[engine.structured_output] warm_at_start = false`` leaves the compiler to the first structured request."""

from __future__ import annotations

import threading

import redis

from tests.worker_helpers import make_settings, running_worker
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.errors import GrammarError
from tokenmill.producer.client import Producer
from tokenmill.protocol.sampling import ResponseFormat


class _SlowGrammars:
    """Grammars whose warm-up blocks until released (a compile child starting under load)."""

    def __init__(self, *, fails: bool = False) -> None:
        self.warming, self.release, self.fails = threading.Event(), threading.Event(), fails
        self.thread_name = ""

    def compile(self, response_format: ResponseFormat) -> None:
        """Nothing to compile (the echo model enforces no grammar)."""

    def warm(self) -> None:
        self.thread_name = threading.current_thread().name
        self.warming.set()
        self.release.wait(10)
        if self.fails:
            raise GrammarError("the grammar compiler process did not start")


def _engine(grammars: _SlowGrammars, config: EngineConfig) -> Engine:
    engine = Engine.from_config(config)
    engine.grammars = grammars
    return engine


def test_the_worker_warms_grammars_at_start_without_holding_up_plain_requests(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    grammars = _SlowGrammars()
    with running_worker(settings, engine=_engine(grammars, settings.engine)), \
            Producer(client=redis_client, prefix=key_prefix) as producer:
        assert grammars.warming.wait(10), "the worker never warmed its grammar compiler"
        assert grammars.thread_name == "tm-grammar-warm", "warmed off the engine thread"
        result = producer.result(producer.submit(prompt="plain", raw=True), timeout=10)
        assert result.status == "ok" and result.text == "plain", "served while the warm-up still runs"
        grammars.release.set()


def test_a_failed_warm_up_leaves_the_worker_serving(redis_url: str, redis_client: redis.Redis,
                                                    key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    grammars = _SlowGrammars(fails=True)
    grammars.release.set()
    with running_worker(settings, engine=_engine(grammars, settings.engine)), \
            Producer(client=redis_client, prefix=key_prefix) as producer:
        assert grammars.warming.wait(10)
        schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
        request_ids = [producer.submit(prompt="{}", raw=True), producer.submit(prompt="{}", response_format=schema)]
        results = [producer.result(request_id, timeout=10) for request_id in request_ids]
    assert [result.status for result in results] == ["ok", "ok"]


def test_warm_at_start_off_leaves_the_compiler_to_the_first_structured_request(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, engine={"structured_output": {"warm_at_start": False}})
    grammars = _SlowGrammars()
    grammars.release.set()
    with running_worker(settings, engine=_engine(grammars, settings.engine)), \
            Producer(client=redis_client, prefix=key_prefix) as producer:
        assert producer.result(producer.submit(prompt="plain", raw=True), timeout=10).status == "ok"
    assert not grammars.warming.is_set()
