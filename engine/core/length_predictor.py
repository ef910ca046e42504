"""Predicts each request's output length from finished requests like it (no second model).

Standard library only. What predicts a length, most specific first (the first key with ``min_samples``
finished requests longer than what the request already generated answers; its running ones refine it):

* a prefix of its prompt (the template: prefixes of several lengths, the longest that has history wins),
  within its length group (the job it belongs to: a bulk job, a batch; the worker names it), then across
  groups;
* its group alone;
* every request of the same kind (structured output or not).

With no history at all the prediction is the whole ``max_tokens`` (as a reservation would plan), so a cold
engine starts cautious and learns from the first short answers. ``max_tokens``, stop settings and the rest
act through the recorded lengths themselves (capped at each request's own ``max_tokens``).

NOTE: a model-side predictor (a probe on the last prompt token's hidden state, TRAIL-style) was not built:
the history keys need no model access and answer in microseconds; docs/design.md says what it would add.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import statistics
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from typing import NamedTuple

from tokenmill.engine.config import LengthConfig
from tokenmill.engine.core.length_history import KeyHistory, LengthEstimate, LengthSamples
from tokenmill.engine.core.request import Request

# Prompt prefixes (tokens) that may name a template, longest first.
PREFIX_LENGTHS = (192, 128, 96, 64, 48, 40, 32, 24, 16, 8)
_PREFIX_LENGTHS_UP = PREFIX_LENGTHS[::-1]
_PREFIX_SLICES = tuple(slice(length) for length in PREFIX_LENGTHS)
_NUM_RECORDS = 10_000


class LengthRecord(NamedTuple):
    """One finished request: what was predicted when it was admitted, its cap, and what it generated.

    NOTE: a tuple, its errors computed when read: one is made per finished request, and only the stats' ``errors``
    (a few times a second, over the last 200) reads them; a frozen dataclass with both logs cost 80 opcodes a finish.
    """

    predicted: float  # median_total of the estimate it was admitted with
    max_tokens: int
    actual: int

    @property
    def log_error(self) -> float:
        """The absolute log-length error of the prediction (``errors`` takes the median)."""
        return abs(_log(self.predicted) - _log(self.actual))

    @property
    def max_tokens_log_error(self) -> float:
        """... and of planning with ``max_tokens`` (the baseline)."""
        return abs(_log(self.max_tokens) - _log(self.actual))


class LengthPredictor:
    """Output-length history keyed by what predicts a length, and the estimates it gives.

    NOTE: each key's history (engine/core/length_history.py ``KeyHistory``: its lengths, its live and started
    requests, its memo) is one object, which the requests under it hold: a request's admission, start, estimates
    and finish touch its keys' objects directly. Kept in dictionaries keyed by the key tuples (of lengths, of live
    requests, of started ones, a memo: each hashing a request's dozen or more keys again), the predictor's own time
    was 33 us a worker's 16-token echo request, a fifth of the engine's; now 22 (ops/bench/README.md).
    """

    def __init__(self, config: LengthConfig) -> None:
        self.config = config
        self._histories: dict[Hashable, KeyHistory] = {}  # every key with lengths or live requests
        # ... of them, those holding lengths, least recently observed first (at most config.max_keys); keyed by the
        # history object itself, whose hash is its identity (no key tuple hashed)
        self._with_samples: OrderedDict[KeyHistory, None] = OrderedDict()
        self.records: deque[LengthRecord] = deque(maxlen=_NUM_RECORDS)
        self.num_observed = 0  # finished requests learnt from
        self.num_estimates = 0
        self.num_outlived = 0  # estimates redone because the request generated past the last one's median or mean
        # NOTE: the engine's stats (read after every worker step) ask for these; they change only with the history.
        self._errors: tuple[tuple[int, int], tuple[float | None, float | None]] = ((-1, 0), (None, None))
        self._group_means: dict[tuple[str | None, bool], tuple[int, float | None]] = {}

    def current(self, request: Request) -> LengthEstimate:
        """The request's estimate, redone when it is stale: none yet; for one that generated nothing yet (it
        waits: the order of admission reads it), made before the history grew by a sixteenth (every finish while
        it is young); else outlived (the request generated as many tokens as its median or mean), or made when the
        history held less than half of what it holds now (so a running request is re-estimated O(log n) times,
        and early cautious estimates do not last).

        NOTE: requests that generated nothing are estimated from keys shared by many of them (their template,
        their job), through a per-key memo kept until the next request finishes, so redoing a waiting request's
        estimate costs a dictionary lookup per key, not a pass over the history; the sixteenth bounds how often
        a backlog of thousands is redone (O(16 log n) times each)."""
        estimate = request.length_state.estimate
        if estimate is None or self.num_observed >= self.stable_until(request):
            return self.estimate(request)
        num_generated = request.num_output_tokens
        if num_generated and num_generated >= min(estimate.median_total, estimate.mean_total):
            self.num_outlived += 1
            return self.estimate(request)
        return estimate

    def stable_until(self, request: Request) -> int:
        """The history size (``num_observed``) from which :meth:`current` redoes the request's estimate for the
        history's growth (0: it has none yet); until then it keeps it, unless the request outlives it (only a running
        request's age grows). The scheduler keeps an admission order by predicted length while no waiting request's
        is due."""
        state = request.length_state
        if state.estimate is None:
            return 0
        size = state.history_size
        until = 2 * size + self.config.min_samples
        if request.num_output_tokens == 0:
            until = min(until, size + size // 16 + 1)
        return until

    def estimate(self, request: Request) -> LengthEstimate:
        """Estimate ``request``'s final length given what it generated so far; keeps it on the request."""
        state = request.length_state
        if not state.is_tracked or not state.keys:
            self._track(request)
        histories = state.keys
        num_generated = request.num_output_tokens
        known_past = num_generated  # what the request, or the running ones of a key that cannot answer, outlived
        max_tokens = request.max_tokens
        num_observed = self.num_observed
        estimate = None
        answer_index = len(histories)  # the key that answered (none: as many as there are)
        for index, history in enumerate(histories):
            if history.samples is None and not history.started:
                continue  # NOTE: says nothing (a row's own prefix, new): _key_answer's (None, known_past)
            if num_generated == 0:
                if history.memo_observed != num_observed:
                    history.memo.clear()
                    history.memo_observed = num_observed
                answer = history.memo.get((known_past, max_tokens))
                if answer is None:
                    answer = history.memo[known_past, max_tokens] = self._key_answer(history, known_past, max_tokens)
            else:
                answer = self._key_answer(history, known_past, max_tokens)
            estimate, known_past = answer
            if estimate is not None:
                answer_index = index
                break
        if estimate is None:
            estimate = (LengthEstimate.outlived(known_past, max_tokens) if known_past
                        else LengthEstimate.prior(max_tokens))
        template = self._unknown_template(histories, answer_index)
        state.correlation = template.key if template is not None else None
        state.exploring = template is not None and self._num_started(template) < self.config.min_samples
        state.estimate = estimate
        state.history_size = num_observed
        self.num_estimates += 1
        return estimate

    def _track(self, request: Request) -> None:
        """Count a request live under its keys (at its first estimate)."""
        state = request.length_state
        histories = self._keys_of(request)
        _put_all(map(_LIVE, histories), request.request_id, request)
        state.is_tracked = True
        if request.first_scheduled_time_s is not None or request.num_output_tokens:
            self.started(request)

    def _keys_of(self, request: Request) -> tuple[KeyHistory, ...]:
        """The request's key histories (``state.keys``), looked up first where it has none, or one the predictor
        dropped since (a sample of a request forgotten at its fork)."""
        state = request.length_state
        if not state.keys or not all(history.is_attached for history in state.keys):
            state.keys = self._histories_of(request)
        return state.keys

    def _histories_of(self, request: Request) -> tuple[KeyHistory, ...]:
        """The histories of the request's keys (``history_keys``), made where new.

        NOTE: looked up with ``map`` (in C): a dozen keys, every request; only missing ones take a Python pass."""
        histories = self._histories
        keys = history_keys(request)
        found = list(map(histories.get, keys))
        if None in found:
            for index, key in enumerate(keys):
                if found[index] is None:
                    found[index] = histories[key] = KeyHistory(key, _source_of(key), _prefix_length(key))
        return tuple(found)  # type: ignore[arg-type]  # NOTE: no None is left

    def _key_answer(self, history: KeyHistory, known_past: int, max_tokens: int,
                    ) -> tuple[LengthEstimate | None, int]:
        """What one history key says of a request known to run past ``known_past`` tokens: its estimate (None: too
        little history), and what the next, coarser key should take the request to outlive.

        A key that cannot answer, yet has ``min_samples`` requests running past ``known_past`` (the first essays
        of a job, while its short answers have finished), says its lengths are longer than the coarser keys'
        typical one: those then predict it from their lengths past the age ``min_samples`` of them reached."""
        min_samples = self.config.min_samples
        # NOTE: a request never scheduled has generated nothing: its age would pass neither test below
        live_ages = [r.num_output_tokens for r in history.started.values()] if history.started else []
        samples = history.samples
        if samples is not None and len(samples) >= min_samples:
            estimate = samples.estimate(known_past, max_tokens, min_samples=min_samples,
                                        quantile=self.config.tail_quantile, source=history.source,
                                        live_ages=live_ages)
            if estimate is not None:
                return estimate, known_past
        older = sorted(age for age in live_ages if age > known_past)
        return None, (older[-min_samples] if len(older) >= min_samples else known_past)

    @staticmethod
    def _unknown_template(histories: tuple[KeyHistory, ...], answer_index: int) -> KeyHistory | None:
        """The request's template (the most specific history key it shares with another live request: a bulk job's
        rows share the template's prefix, not the row's own words) when its own history did not answer the estimate
        (the key at ``answer_index`` is coarser: the job's or everyone's); None when it did, or it has none."""
        template_index = next((index for index, history in enumerate(histories) if len(history.live) >= 2),
                              len(histories))
        if answer_index <= template_index:
            return None
        template = histories[template_index]
        # NOTE: the same prompt prefix across groups is the template's own history too (a new job, a known template)
        if answer_index < len(histories) and histories[answer_index].prefix_length >= template.prefix_length > 0:
            return None
        return template

    def _num_started(self, history: KeyHistory) -> int:
        """Requests under the key that finished (in its window) or generated a token; kept until the next finish."""
        if history.started_observed != self.num_observed:
            samples = history.samples
            num_running = sum(1 for r in history.started.values() if r.num_output_tokens > 0)
            history.num_started = (len(samples) if samples is not None else 0) + num_running
            history.started_observed = self.num_observed
        return history.num_started

    def started(self, request: Request) -> None:
        """A live request was scheduled for the first time (the scheduler's admission; a sample of a running request
        starts so): from now on its age counts in its keys' estimates. Nothing for one not estimated yet (its first
        estimate counts it)."""
        state = request.length_state
        if state.is_tracked:
            _put_all(map(_STARTED, state.keys), request.request_id, request)

    def forget(self, request: Request) -> None:
        """A request that ended without a length to learn from (aborted, failed, or forked into samples)."""
        state = request.length_state
        if not state.is_tracked:
            return
        self._untrack(request)
        if not all(map(len, map(_LIVE, state.keys))):
            for history in state.keys:
                if not history.live and history.samples is None:
                    self._drop(history)

    def _untrack(self, request: Request) -> None:
        """Count a tracked request no longer live (nor started) under its keys."""
        request.length_state.is_tracked = False
        keys = request.length_state.keys
        _pop_all(map(_LIVE, keys), request.request_id)
        _pop_all(map(_STARTED, keys), request.request_id)

    def observe(self, request: Request) -> None:
        """Learn from a request that finished on its own (a stop or its length limit; not an abort or error)."""
        state = request.length_state
        if state.is_tracked:
            self._untrack(request)  # NOTE: not forget: every key of it gets its length (none is left to drop)
        else:
            self._keys_of(request)  # NOTE: never estimated: its keys, without counting it live
        length = request.num_output_tokens
        self.num_observed += 1
        with_samples = self._with_samples
        keys = state.keys
        # NOTE: every key is in the index: a tracked request is live under its keys, which keeps them there, and
        # _keys_of looked up an untracked one's anew where one had left
        if None in map(_SAMPLES, keys):
            for history in keys:
                if history.samples is None:
                    history.samples = LengthSamples(self.config.samples_per_key)
                    with_samples[history] = None
        # NOTE: in C, over the request's dozen keys: each goes last in the least recently observed order, and gets
        # the length
        deque(map(with_samples.move_to_end, keys), maxlen=0)
        deque(map(LengthSamples.add, map(_SAMPLES, keys), itertools.repeat(length)), maxlen=0)
        while len(with_samples) > self.config.max_keys:
            self._forget_samples(with_samples.popitem(last=False)[0])
        admitted = state.admitted_estimate
        if admitted is not None:
            self.records.append(LengthRecord(admitted.median_total, request.max_tokens, length))

    def _forget_samples(self, history: KeyHistory) -> None:
        """Forget a key's lengths (the least recently observed key, past ``max_keys``); a key with live requests keeps
        its entry (they hold it) without them."""
        history.samples = None
        history.memo.clear()
        history.started_observed = -1
        if not history.live:
            self._drop(history)

    def _drop(self, history: KeyHistory) -> None:
        """Take a key with neither lengths nor live requests out of the index."""
        history.is_attached = False
        if self._histories.get(history.key) is history:
            del self._histories[history.key]

    def group_mean_length(self, group: str | None, is_structured: bool = False) -> float | None:
        """Predicted mean output length of a new request of ``group``: from the group's history, else from every
        request's of the same kind (None: no history at all yet)."""
        num_observed, mean = self._group_means.get((group, is_structured), (-1, None))
        if num_observed != self.num_observed:
            mean = self._group_mean_length(group, is_structured)
            self._group_means[group, is_structured] = (self.num_observed, mean)
        return mean

    def _group_mean_length(self, group: str | None, is_structured: bool) -> float | None:
        for key in ((group, is_structured), (None, is_structured)):
            history = self._histories.get(key)
            samples = history.samples if history is not None else None
            if samples is not None and len(samples) >= self.config.min_samples:
                mean = samples.mean_longer_than(0)
                if mean is not None:
                    return mean
        return None

    def errors(self, last: int = 200) -> tuple[float | None, float | None]:
        """Median absolute error of log-length over the last ``last`` finished requests: of the predictions
        they were admitted with, and of planning with ``max_tokens`` (the baseline); (None, None) before any."""
        if self._errors[0] == (self.num_observed, last):
            return self._errors[1]
        # NOTE: the stats ask after every finish on a busy worker: the last `last` only, not a copy of every record
        recent = list(itertools.islice(reversed(self.records), last))
        errors: tuple[float | None, float | None] = (None, None)
        if recent:
            errors = (statistics.median([r.log_error for r in recent]),
                      statistics.median([r.max_tokens_log_error for r in recent]))
        self._errors = ((self.num_observed, last), errors)
        return errors


def build_length_predictor(config: LengthConfig) -> LengthPredictor | None:
    """The engine's predictor, or None with ``predict`` off."""
    return LengthPredictor(config) if config.estimate else None


def history_keys(request: Request) -> list[Hashable]:
    """The request's history keys, most specific first: for each prompt prefix shorter than the prompt (longest
    first), ``(group, kind, length, digest)`` when it has a group, then ``(None, kind, length, digest)``; then
    ``(group, kind)`` when it has a group, and ``(None, kind)`` (``kind``: structured output or not).

    NOTE: the prefixes are sliced, hashed and paired with ``map`` and ``zip`` (in C): per request, a Python pass over
    them and their keys cost 300 opcodes."""
    prompt = request.prompt_token_ids
    kind = request.sampling_params.is_structured
    group = request.length_state.group
    first = len(PREFIX_LENGTHS) - bisect.bisect_left(_PREFIX_LENGTHS_UP, len(prompt))
    lengths = PREFIX_LENGTHS[first:]
    digests = list(map(hash, map(tuple, map(prompt.__getitem__, _PREFIX_SLICES[first:]))))
    prefix_keys: list[Hashable] = list(zip(itertools.repeat(None), itertools.repeat(kind), lengths, digests))
    if group is None:
        prefix_keys.append((None, kind))
        return prefix_keys
    keys: list[Hashable] = [None] * (2 * len(prefix_keys))
    keys[0::2] = zip(itertools.repeat(group), itertools.repeat(kind), lengths, digests)  # NOTE: a longer template
    keys[1::2] = prefix_keys  # match says more than membership of the job
    keys += ((group, kind), (None, kind))
    return keys


_LIVE = operator.attrgetter("live")
_STARTED = operator.attrgetter("started")
_SAMPLES = operator.attrgetter("samples")


def _put_all(dicts: Iterable[dict[str, Request]], key: str, value: Request) -> None:
    """``d[key] = value`` in each of ``dicts``, in C (a request's keys' live or started requests: a Python loop per
    request cost as much as the rest of its admission's bookkeeping)."""
    deque(map(operator.setitem, dicts, itertools.repeat(key), itertools.repeat(value)), maxlen=0)


def _pop_all(dicts: Iterable[dict[str, Request]], key: str) -> None:
    """``d.pop(key, None)`` in each of ``dicts``, in C."""
    deque(map(dict.pop, dicts, itertools.repeat(key), itertools.repeat(None)), maxlen=0)


def _source_of(key: Hashable) -> str:
    """The name of a history key's kind (an estimate's ``source``)."""
    assert isinstance(key, tuple)
    if len(key) == 4:
        return "prefix" if key[0] is None else "group+prefix"
    return "all" if key[0] is None else "group"


def _prefix_length(key: Hashable) -> int:
    """The prompt-prefix length a history key (``history_keys``) names; 0 for a group's or everyone's key."""
    return key[2] if isinstance(key, tuple) and len(key) == 4 else 0


def _log(num_tokens: float) -> float:
    return math.log(max(1.0, num_tokens))
