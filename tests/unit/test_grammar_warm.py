"""The grammar compiler warmed before any structured request: ``warm()`` starts the compile
child at once (a second warm-up starts no other, and the first compile is served by that child), and the
engine's warm-up never raises: a failure is logged and the first structured request tries again."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from typing import Any

import pytest

from tests.tiny_models import build_tokenizer
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.errors import GrammarError
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.grammar_process import CompileLimits
from tokenmill.protocol.sampling import ResponseFormat


def _grammar_children() -> set[Any]:
    return {child for child in multiprocessing.active_children() if child.name == "tm-grammar"}


def test_warm_starts_the_compile_child_before_any_structured_request() -> None:
    tokenizer = build_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}),
                               limits=CompileLimits(timeout_s=30.0, memory_bytes=1 << 30))
    before = _grammar_children()
    try:
        compiler.warm()
        started = _grammar_children() - before
        assert len(started) == 1 and all(child.is_alive() for child in started), "the child runs before a request"
        compiler.warm()
        compiler.compile(ResponseFormat.model_validate({"type": "regex", "regex": "[0-9]{3}"}))
        assert _grammar_children() - before == started, "the warm child serves the first compile; no other starts"
    finally:
        compiler.close()
    assert not any(child.is_alive() for child in started)


def test_closing_stops_a_warm_up_still_starting_the_child() -> None:
    """The child's start imports xgrammar and torch: seconds, tens of them under load. A worker shutting down while
    its warm-up is in that start must not wait for it: close() stops the start, and the warm-up ends quietly."""
    tokenizer = build_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}),
                               limits=CompileLimits(timeout_s=30.0, memory_bytes=1 << 30))
    before = _grammar_children()
    errors: list[BaseException] = []

    def warm() -> None:
        try:
            compiler.warm()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=warm)
    thread.start()
    deadline = time.monotonic() + 30
    while not _grammar_children() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    started = _grammar_children() - before
    assert started, "the warm-up started no child"
    closed_at = time.monotonic()
    compiler.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and time.monotonic() - closed_at < 5
    assert errors == []
    assert not any(child.is_alive() for child in started)
    # a later compile starts a child anew
    compiler.compile(ResponseFormat.model_validate({"type": "regex", "regex": "[0-9]{3}"}))
    compiler.close()


def test_warm_without_limits_prepares_in_thread_and_starts_no_child() -> None:
    tokenizer = build_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    before = _grammar_children()
    compiler.warm()
    assert _grammar_children() - before == set()
    compiler.compile(ResponseFormat.model_validate({"type": "json_object"}))


class _FailingGrammars:
    def __init__(self) -> None:
        self.num_warms = 0

    def compile(self, response_format: ResponseFormat) -> None:
        raise GrammarError("structured output needs the xgrammar package")

    def warm(self) -> None:
        self.num_warms += 1
        raise GrammarError("the grammar compiler process did not start")


def _echo_engine(grammars: Any = None) -> Engine:
    engine = Engine.from_config(EngineConfig(model="echo"))
    if grammars is not None:
        engine.grammars = grammars
    return engine


def test_a_failed_warm_up_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    grammars = _FailingGrammars()
    engine = _echo_engine(grammars)
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.engine"):
        engine.warm_grammars()
    assert grammars.num_warms == 1
    assert [getattr(record, "event", None) for record in caplog.records] == ["grammar_warm_failed"]


def test_grammars_without_a_warm_up_are_left_alone() -> None:
    _echo_engine().warm_grammars()  # the echo model's grammars: nothing to start, nothing raised
