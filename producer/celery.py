"""Celery tasks that enqueue generations on tokenmill and hand back plain-dict results.

Owns ``register_tasks`` / ``make_app``. Imports celery (the ``celery`` extra) and the producer
client; never torch, the engine or the worker. JSON (or msgpack) serialisation only.

NOTE: the default mode is the re-check: a task run submits the request once (the request id
is derived from the Celery task id, and a SET NX marker makes the submit idempotent across
retries and redeliveries), then ends with ``self.retry(countdown=...)`` until the result key
exists. No Celery worker slot is held while the LLM works, and because the task finally
*returns* (or raises), chains, groups and chords behave exactly as with any other task.
While it waits, ``AsyncResult.state`` reads ``RETRY``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

from celery import Celery

from tokenmill.producer import submit_options
from tokenmill.producer.client import Producer
from tokenmill.producer.config import ProducerConfig
from tokenmill.producer.errors import JobFailed, ResultTimeout
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.schema import GenerationResult

Mode = Literal["recheck", "blocking"]
TASK_NAME = "tokenmill.generate"
JSON_ONLY = {"task_serializer": "json", "result_serializer": "json", "accept_content": ["json", "msgpack"],
             "result_accept_content": ["json", "msgpack"]}
# NOTE: a worker that accepts pickle runs whatever code a message carries; tokenmill's tasks refuse such an app
_PICKLE_NAMES = frozenset({"pickle", "application/x-python-serialize"})
_SERIALIZER_SETTINGS = ("accept_content", "result_accept_content", "task_serializer", "result_serializer",
                        "event_serializer")
_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
# Keys of an input dict forwarded as submit options (task keyword arguments win over them).
_INPUT_OPTION_KEYS = frozenset({*_PROMPT_KEYS, "raw", "system", "metadata", "priority", "deadline", "model", "tools",
                                *SamplingParams.model_fields})



@dataclass(frozen=True)
class TaskOptions:
    """How ``generate`` waits.

    Attributes:
        mode: ``"recheck"`` (default: no worker slot held) or ``"blocking"`` (BLPOP in the task).
        poll_interval_s: first re-check delay; grows x1.5 per re-check up to ``max_poll_interval_s``.
        max_poll_interval_s: longest re-check delay.
        timeout_s: give up (cancel the request, fail the task with ``ResultTimeout``) after this
            many seconds since submission; None = wait as long as the result may live.
    """

    mode: Mode = "recheck"
    poll_interval_s: float = 0.5
    max_poll_interval_s: float = 5.0
    timeout_s: float | None = 3600.0

    def __post_init__(self) -> None:
        if self.mode not in ("recheck", "blocking"):
            raise ValueError(f"mode must be 'recheck' or 'blocking', got {self.mode!r}")
        if not 0 < self.poll_interval_s <= self.max_poll_interval_s:
            raise ValueError("need 0 < poll_interval_s <= max_poll_interval_s")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive or None")

    def countdown_s(self, num_retries: int) -> float:
        """Delay before re-check number ``num_retries + 1``."""
        return float(min(self.max_poll_interval_s, self.poll_interval_s * 1.5 ** min(num_retries, 30)))


def request_options(source: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Submit options from a task's input and its keyword arguments.

    A plain prompt is sent as a user message (after ``system``, when given), unless ``raw=True``.

    Args:
        source: a prompt string; a chat ``messages`` list; a dict with ``prompt`` / ``messages`` /
            ``prompt_token_ids`` (plus optional submit options); a previous ``generate`` result
            dict (its ``text`` becomes the prompt); or None when a prompt is given by keyword.
        options: the task's keyword arguments (sampling parameters, ``priority``, ``raw``,
            ``system``, ...).

    Raises:
        SchemaError: code ``validation`` when the input has no usable prompt.
    """
    given: dict[str, Any] = {}
    if isinstance(source, str):
        given["prompt"] = source
    elif isinstance(source, list):
        given["messages"] = source
    elif isinstance(source, dict):
        if "status" in source and "text" in source and not any(k in source for k in _PROMPT_KEYS):
            if source["status"] != "ok":
                raise JobFailed(source)
            given["prompt"] = source["text"]
        else:
            given = {k: v for k, v in source.items() if k in _INPUT_OPTION_KEYS}
    elif source is not None:
        raise SchemaError(ErrorCode.VALIDATION.value,
                          f"generate takes a str, a messages list or a dict, got {type(source).__name__}")
    if any(k in options for k in _PROMPT_KEYS):
        given = {k: v for k, v in given.items() if k not in _PROMPT_KEYS}
    # NOTE: raw / system travel on to the producer, which resolves them (producer.submit_options.as_request_prompt).
    return {**given, **options}


class _Generator:
    """The work behind one registered task: a lazily built producer and the wait policy."""

    def __init__(self, config: ProducerConfig, options: TaskOptions) -> None:
        self.config, self.options = config, options
        self._producer: Producer | None = None
        self._lock = threading.Lock()

    @property
    def producer(self) -> Producer:
        # NOTE: built on first use, so a prefork child connects after the fork.
        with self._lock:
            if self._producer is None:
                self._producer = Producer.from_config(self.config)
            return self._producer

    def submit_once(self, request_id: str, options: dict[str, Any]) -> tuple[str, float]:
        """Enqueue the task's request unless an earlier run did: its id (``request_id``, or on a sharded queue
        the first id derived from it on its prompt prefix's shard: the same on every retry) and the first
        submit's unix time."""
        producer = self.producer
        request = producer.layout.placed_from(submit_options.build_request(producer.keys, {**options,
                                                                                   "request_id": request_id}))
        return request.id, producer.submit_once([request])[0]

    def run(self, task: Any, source: Any, options: dict[str, Any]) -> dict[str, Any]:
        base_id = f"celery-{task.request.id}" if task.request.id else None
        submit = request_options(source, options)
        if base_id is None:  # called as a plain function: nothing to derive an id from
            return self._block(self.producer.submit(**submit))
        request_id, submitted_at = self.submit_once(base_id, submit)
        if self.options.mode == "blocking" or task.request.is_eager:
            return self._block(request_id, submitted_at)
        result = self.producer.get(request_id)
        if result is not None:
            return _as_dict(result)
        if self.options.timeout_s is not None and time.time() - submitted_at > self.options.timeout_s:
            self.producer.cancel(request_id)
            raise ResultTimeout(f"no result for request {request_id!r} within {self.options.timeout_s} s")
        countdown = self.options.countdown_s(int(task.request.retries or 0))
        raise task.retry(countdown=countdown, max_retries=None)

    def _block(self, request_id: str, submitted_at: float | None = None) -> dict[str, Any]:
        timeout_s = self.options.timeout_s
        if timeout_s is not None and submitted_at is not None:
            timeout_s = max(0.001, timeout_s - (time.time() - submitted_at))
        try:
            return _as_dict(self.producer.result(request_id, timeout_s))
        except ResultTimeout:
            self.producer.cancel(request_id)
            raise


def _as_dict(result: GenerationResult) -> dict[str, Any]:
    """The task's return value; non-ok results fail the task with the remote reason."""
    if not result.ok:
        raise JobFailed(result)
    return result.model_dump(mode="json")


def register_tasks(app: Celery, producer_config: ProducerConfig | None = None, *, name: str = TASK_NAME,
                   mode: Mode = "recheck", poll_interval_s: float = 0.5, max_poll_interval_s: float = 5.0,
                   timeout_s: float | None = 3600.0) -> Any:
    """Attach the ``generate`` task to ``app`` and return it.

    ``generate.s(max_tokens=8, ...)`` takes its input (see :func:`request_options`) as the first
    positional argument, so it links into chains, groups and chords; it returns
    ``GenerationResult.model_dump(mode="json")`` and fails with :class:`JobFailed` (code and
    reason of the remote error) when the result is not ``ok``.

    Args:
        app: the user's Celery app (use JSON or msgpack serialisation; see :data:`JSON_ONLY`).
        producer_config: the tokenmill queue to feed; None = :meth:`ProducerConfig.load` (``TOKENMILL_*``
            variables and ``REDIS_URL`` > the file ``$TOKENMILL_CONFIG`` names > defaults), loaded here.
        name: task name; register twice with different names for two queues or modes.
        mode, poll_interval_s, max_poll_interval_s, timeout_s: see :class:`TaskOptions`.

    Returns:
        The Celery task object.

    Raises:
        ValueError: ``app`` serialises with or accepts pickle.
    """
    _refuse_pickle(app)
    generator = _Generator(producer_config or ProducerConfig.load(),
                           TaskOptions(mode, poll_interval_s, max_poll_interval_s, timeout_s))

    def generate(self: Any, source: Any = None, **options: Any) -> dict[str, Any]:
        return generator.run(self, source, options)

    generate.__doc__ = "Generate with tokenmill; returns the GenerationResult as a dict."
    decorator = app.task(bind=True, name=name, max_retries=None, acks_late=True, typing=False, shared=False)
    return decorator(generate)


def _refuse_pickle(app: Celery) -> None:
    """Raise ValueError naming the settings of ``app`` that serialise with or accept pickle."""
    found = []
    for name in _SERIALIZER_SETTINGS:
        value = app.conf.get(name)
        values = [value] if isinstance(value, str) else list(value or ())
        if _PICKLE_NAMES.intersection(str(v).lower() for v in values):
            found.append(f"{name}={value!r}")
    if found:
        raise ValueError(f"this Celery app accepts pickle ({', '.join(found)}): a pickled message runs any code "
                         f"on the worker that reads it; use JSON or msgpack (producer.celery.JSON_ONLY)")


def make_app(broker_url: str, backend_url: str | None = None, producer_config: ProducerConfig | None = None,
             *, main: str = "tokenmill", **task_options: Any) -> Celery:
    """A Celery app with JSON-only serialisation and the ``generate`` task registered.

    Args:
        broker_url: e.g. ``redis://localhost:6379/1``.
        backend_url: result backend (chords need one); None = the broker URL.
        producer_config: the tokenmill queue to feed; None = :meth:`ProducerConfig.load`, as in :func:`register_tasks`.
        main: the app's name.
        **task_options: passed to :func:`register_tasks` (``mode``, ``poll_interval_s``, ...).
    """
    app = Celery(main, broker=broker_url, backend=backend_url or broker_url)
    app.conf.update(JSON_ONLY)
    register_tasks(app, producer_config, **task_options)
    return cast(Celery, app)
