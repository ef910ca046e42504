"""Every Redis key and stream name tokenmill uses, built from one prefix and queue name.

This module is the protocol's key layout (docs/design.md); producer and worker both import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote

CONSUMER_GROUP = "workers"
DEFAULT_PREFIX = "tokenmill"
DEFAULT_QUEUE = "default"
DEFAULT_NUM_LANES = 3
# Seconds a done list lives: the worker sets it when it pushes; waiters that re-arm it reuse it.
DONE_TTL_S = 300

# Named priorities map onto lanes; lower lane = more urgent (as in vLLM and Celery).
PRIORITY_NAMES: dict[str, int] = {"high": 0, "normal": 1, "low": 2}


@dataclass(frozen=True)
class Lane:
    """One request stream of a queue: a priority lane, shared or one model's."""

    stream: str  # the stream's key
    priority: int  # its priority lane k (0 = most urgent)
    model: str | None  # the model its requests name; None for the shared lanes (requests naming none)
    is_decode: bool = False  # a decode pool's lane: requests a prefill worker computed the prompt of
    shard: int = 0  # the queue's shard it belongs to (protocol/shards.py); 0 for a queue of one shard


@dataclass(frozen=True)
class Keys:
    """Key names for one queue.

    Attributes:
        prefix: namespace shared by all queues of a deployment.
        queue: the queue name; workers serve exactly one queue.
        num_lanes: priority lanes 0..num_lanes-1, shared and of each model alike (:meth:`lane`).
        hash_tag: wrap ``prefix:queue`` in braces (``{prefix:queue}:lane:0`` ...) so every key
            of the queue hashes to one Redis Cluster slot (multi-key Lua and XREADGROUP need it).
        shard: the keys of shard ``k`` of a queue spread over several (protocol/shards.py): its lanes and
            what scripts touch with them (results, done lists, token streams, dedupe markers, the cancel set,
            dead letters, models) under ``{prefix:queue:k}``, one cluster slot per shard; the queue-wide keys
            (heartbeats, reply streams, files, batches) stay the queue's own (:attr:`home_base`).
    """

    prefix: str = DEFAULT_PREFIX
    queue: str = DEFAULT_QUEUE
    num_lanes: int = DEFAULT_NUM_LANES
    hash_tag: bool = False
    shard: int | None = None

    def __post_init__(self) -> None:
        if not self.prefix or not self.queue:
            raise ValueError("prefix and queue must be non-empty")
        if ":" in self.queue:
            raise ValueError("queue names must not contain ':'")
        if self.num_lanes < 1:
            raise ValueError("num_lanes must be >= 1")
        if self.shard is not None and self.shard < 0:
            raise ValueError("shard must be >= 0")
        if (self.hash_tag or self.shard is not None) and any(ch in self.prefix + self.queue for ch in "{}"):
            raise ValueError("with hash_tag or shards, prefix and queue must not contain '{' or '}'")

    @property
    def base(self) -> str:
        """``prefix:queue``; ``{prefix:queue}`` (one cluster slot) with ``hash_tag``; ``{prefix:queue:k}``
        for shard ``k``."""
        if self.shard is not None:
            return f"{{{self.prefix}:{self.queue}:{self.shard}}}"
        return f"{{{self.prefix}:{self.queue}}}" if self.hash_tag else f"{self.prefix}:{self.queue}"

    @property
    def home_base(self) -> str:
        """Base of the queue-wide keys: ``{prefix:queue}`` for a shard's keys, else :attr:`base`."""
        return f"{{{self.prefix}:{self.queue}}}" if self.shard is not None else self.base

    def lane(self, k: int, model: str | None = None, is_decode: bool = False) -> str:
        """Request stream of priority lane ``k`` (0 = most urgent): the shared one, which holds the
        requests naming no model, or the lane of ``model``, which holds those naming it. With ``is_decode``
        the decode pool's stream of that lane (``...:decode:lane:k``): prefill workers hand requests there
        once their prompt's KV blocks are in the fleet's store (docs/design.md, "Prefill and decode pools").

        NOTE: a model name may hold any character (``org/name``, ``a:b``, braces): it is percent-encoded
        (everything but letters, digits and ``_.-~``; ``:`` is ``%3A``), so one key names one model, the
        name part never holds a ``:``, and with ``hash_tag`` the braces of the base stay the first.
        """
        if not 0 <= k < self.num_lanes:
            raise ValueError(f"lane {k} out of range 0..{self.num_lanes - 1}")
        base = f"{self.base}:decode" if is_decode else self.base
        if model is None:
            return f"{base}:lane:{k}"
        return f"{base}:model:{quote(model, safe='')}:lane:{k}"

    @property
    def lanes(self) -> list[str]:
        """The shared request streams (requests naming no model), most urgent first."""
        return [self.lane(k) for k in range(self.num_lanes)]

    def lanes_for(self, models: Iterable[str], is_decode: bool = False) -> list[Lane]:
        """The shared lanes and the lanes of every one of ``models``, in the order a worker reads them:
        lane 0 of all of them before lane 1, the shared lane first within a lane, then models by name;
        with ``is_decode`` the decode pool's lanes of them."""
        names: list[str | None] = [None, *sorted(set(models))]
        return [Lane(self.lane(k, model, is_decode), k, model, is_decode, self.shard or 0)
                for k in range(self.num_lanes) for model in names]

    def decode_lane(self, lane: Lane) -> Lane:
        """The decode pool's lane a request of ``lane`` is handed to after its prefill."""
        return Lane(self.lane(lane.priority, lane.model, is_decode=True), lane.priority, lane.model, is_decode=True,
                    shard=lane.shard)

    def parse_lane(self, stream: str) -> Lane | None:
        """The lane of this queue that ``stream`` names (shared or a model's), or None when it names none."""
        head, is_lane, number = stream.rpartition(":lane:")
        is_decode = head.startswith(f"{self.base}:decode")
        base = f"{self.base}:decode" if is_decode else self.base
        model_prefix = f"{base}:model:"
        if not is_lane or (head != base and not head.startswith(model_prefix)):
            return None
        model = None if head == base else unquote(head[len(model_prefix):])
        try:
            lane = Lane(stream, int(number), model, is_decode, self.shard or 0)
            # NOTE: only the one spelling
            return lane if self.lane(lane.priority, model, is_decode) == stream else None
        except ValueError:  # not a number, or out of range
            return None

    @property
    def models(self) -> str:
        """Set of the model names requests were routed to (the producer adds a request's model with its
        XADD; a worker adds the names it serves), so stats find model lanes no live worker reads."""
        return f"{self.base}:models"

    def result(self, request_id: str) -> str:
        """String value holding the msgpack ``GenerationResult`` (with a TTL)."""
        return f"{self.base}:res:{request_id}"

    def done(self, request_id: str) -> str:
        """List pushed once when the result lands, for BLPOP waiters (short TTL)."""
        return f"{self.base}:done:{request_id}"

    def tokens(self, request_id: str) -> str:
        """Token stream of a ``stream_tokens`` request."""
        return f"{self.base}:tok:{request_id}"

    def submitted(self, request_id: str) -> str:
        """Submit-once marker (value: unix submit time) of a request enqueued by the Celery tasks."""
        return f"{self.base}:sub:{request_id}"

    def replied(self, request_id: str) -> str:
        """Marker that the result of ``request_id`` was added to its reply stream, on the reply streams' slot:
        written by the worker when the reply stream is on another cluster slot than the request's shard, so a
        re-run after a crash between the result and the reply sends it exactly once (worker/results.py)."""
        return f"{self.home_base}:replied:{request_id}"

    @property
    def reply_prefix(self) -> str:
        """Namespace of reply streams (queue-wide): a request's ``reply_to`` must start with it (docs/design.md)."""
        return f"{self.home_base}:reply:"

    def reply(self, name: str) -> str:
        """Reply stream ``name`` of this queue (results are XADDed to it as ``d`` + ``v``).

        Raises:
            ValueError: empty ``name``.
        """
        if not name:
            raise ValueError("reply stream name must be non-empty")
        return self.reply_prefix + name

    def is_reply_stream(self, key: str) -> bool:
        """Whether ``key`` may be named as a ``reply_to``: a non-empty name under :attr:`reply_prefix`.

        NOTE: this confinement is what keeps a request from writing to any other key (a result
        key, the cancel set, a lane); with ``hash_tag`` the prefix also carries the queue's slot.
        """
        return key.startswith(self.reply_prefix) and len(key) > len(self.reply_prefix)

    def bulk_replies(self, job_id: str) -> str:
        """Reply stream of one bulk job (its results arrive here; deleted when the job completes)."""
        return self.reply(f"bulk:{job_id}")

    def file(self, file_id: str) -> str:
        """Hash of one file of the OpenAI Files API (``tokenmill serve``): fields ``meta`` (JSON), ``account``
        (the owner's key hash), ``chunks`` and the content in 1 MiB fields ``chunk:0`` .. ``chunk:{chunks - 1}``."""
        return f"{self.home_base}:file:{file_id}"

    @property
    def files(self) -> str:
        """Sorted set of file ids by creation time (listing; ids whose hash expired are dropped lazily)."""
        return f"{self.home_base}:files"

    def batch(self, batch_id: str) -> str:
        """Hash of one OpenAI batch (``tokenmill serve``): its object's fields, JSON-encoded, plus ``account``
        (the owner's key hash), ``owner`` and ``owner_ts`` (the serve process running it, and when it last said so)."""
        return f"{self.home_base}:batch:{batch_id}"

    @property
    def batches(self) -> str:
        """Sorted set of batch ids by creation time."""
        return f"{self.home_base}:batches"

    def rates(self, minute: int) -> str:
        """Hash of one minute's counters of the queue (``minute``: unix seconds // 60 by the Redis server's clock),
        TTL :data:`protocol.rates.RATE_TTL_S`: ``o|{lane stream}`` results and ``t|{lane stream}`` completion
        tokens (workers' writers, HINCRBY), ``a|{lane stream}`` the lane's ``entries-added`` as first seen in
        that minute, ``{ms}:{count}`` (dashboards, HSETNX). protocol/rates.py."""
        return f"{self.home_base}:rate:{minute}"

    def worker_rates(self, minute: int) -> str:
        """Hash of one minute's counters per worker: ``o|{worker}`` results, ``t|{worker}`` completion tokens."""
        return f"{self.home_base}:wrate:{minute}"

    def job(self, job_id: str) -> str:
        """Hash of one bulk job's (or batch's) progress, written by the job as it runs (producer/bulk/record.py)."""
        return f"{self.home_base}:job:{job_id}"

    def job_failures(self, job_id: str) -> str:
        """List of one job's failed rows (JSON, newest first, capped), written by the job."""
        return f"{self.home_base}:job:{job_id}:failed"

    @property
    def jobs(self) -> str:
        """Sorted set of job ids by start time (the dashboard lists the newest)."""
        return f"{self.home_base}:jobs"

    def dashboard_session(self, digest: str) -> str:
        """One signed-in dashboard session: its token's SHA-256 -> JSON {account, csrf}; TTL the session's."""
        return f"{self.home_base}:dash:session:{digest}"

    @property
    def audit(self) -> str:
        """Stream of the dashboard's changes (replay, discard, cancel): who, what, when; capped."""
        return f"{self.home_base}:dash:audit"

    @property
    def dead(self) -> str:
        """Dead-letter stream."""
        return f"{self.base}:dead"

    @property
    def cancel(self) -> str:
        """Sorted set of cancelled request ids, scored by cancel time (trimmed periodically)."""
        return f"{self.base}:cancel"

    @property
    def workers(self) -> str:
        """Hash of worker heartbeats (queue-wide): field = worker name, value = msgpack stats with a timestamp."""
        return f"{self.home_base}:workers"

    def lane_of(self, priority: int | str) -> int:
        """Lane for a priority given as a lane number or one of ``PRIORITY_NAMES``.

        Raises:
            ValueError: unknown name, lane out of range, or neither a name nor an int.
        """
        if isinstance(priority, bool) or not isinstance(priority, (int, str)):
            raise ValueError(f"priority must be a lane number or one of {sorted(PRIORITY_NAMES)}, "
                             f"got {type(priority).__name__}")
        if isinstance(priority, str):
            if priority not in PRIORITY_NAMES:
                raise ValueError(f"unknown priority {priority!r}; use one of {sorted(PRIORITY_NAMES)} or a lane number")
            lane = min(PRIORITY_NAMES[priority], self.num_lanes - 1)
        else:
            lane = priority
        if not 0 <= lane < self.num_lanes:
            raise ValueError(f"priority lane {lane} out of range 0..{self.num_lanes - 1}")
        return lane
