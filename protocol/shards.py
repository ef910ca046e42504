"""One logical queue spread over shards: the keys of each shard, which shard a request lives on, and
which keys a blocking wait may watch in one command.

Why a request's shard is a function of its id (``crc32(id) % shards``): any process finds a result from
the id alone (``Producer.result``, Celery's re-check, ``tokenmill result``, serve), with no index to
write or read. Placement by prompt prefix is then a choice of id: for an id it generates, the producer
draws uuid4 hex ids until one hashes to the shard of the prompt's first :data:`PREFIX_CHARS` characters
(about ``shards`` draws, microseconds), so prompts sharing a prefix land on one shard, and its readers'
prefix caches. An id derived from the caller's own (a bulk row's attempt, a Celery task's) is placed too, as
the first of ``id``, ``id.1``, ``id.2``, ... on the prefix's shard (:meth:`QueueLayout.placed_from`): that is
deterministic, so deriving it again (a resumed bulk job, a retried task) finds the same request. An id the
caller chose and reads back itself (an idempotency key, serve's ``X-Request-Id``) is placed by that id.

Every key a Lua script touches together (a lane, its request's result, done list, token stream, dedupe
marker, the cancel set, the dead-letter stream) is the shard's, under one hash tag ``{prefix:queue:k}``:
one Redis Cluster slot per call. Queue-wide keys (the heartbeats, reply streams, files, batches) are the
queue's own (:attr:`QueueLayout.home`). A queue of one shard and no cluster keeps the unsharded names.

Imports only the standard library and producer (keys, schema); never redis, torch or the worker.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenmill.protocol.keys import Keys, Lane
from tokenmill.protocol.schema import GenerationRequest

Placement = Literal["prefix", "id"]
# Characters of a prompt that choose its shard: a shared prefix at least this long lands on one shard,
# shorter shared beginnings (a short system prompt) still spread by what follows them.
PREFIX_CHARS = 512
MAX_SHARDS = 256


def shard_of_id(request_id: str, num_shards: int) -> int:
    """The shard request ``request_id`` lives on (results, done list, lane entry, dedupe and cancel marks)."""
    return zlib.crc32(request_id.encode()) % num_shards if num_shards > 1 else 0


def prefix_text(request: GenerationRequest) -> str:
    """The first :data:`PREFIX_CHARS` characters of what the model reads first: the raw prompt, the chat
    messages in order (role and content), or the token ids. No tokenizer: the producer never loads one."""
    if request.prompt is not None:
        return request.prompt[:PREFIX_CHARS]
    if request.messages is not None:
        parts: list[str] = []
        size = 0
        for message in request.messages:
            part = f"{message.role}\0{message.content}\0"
            parts.append(part)
            size += len(part)
            if size >= PREFIX_CHARS:
                break
        return "".join(parts)[:PREFIX_CHARS]
    return ",".join(map(str, (request.prompt_token_ids or [])[:PREFIX_CHARS // 4]))


def shard_of_prefix(request: GenerationRequest, num_shards: int) -> int:
    """The shard prompt-prefix placement puts ``request`` on."""
    return zlib.crc32(prefix_text(request).encode(errors="surrogatepass")) % num_shards if num_shards > 1 else 0


def id_on_shard(shard: int, num_shards: int) -> str:
    """A fresh uuid4 hex id that lives on ``shard`` (rejection sampling: ``num_shards`` draws on average)."""
    while True:
        request_id = uuid.uuid4().hex
        if shard_of_id(request_id, num_shards) == shard:
            return request_id


def derived_id_on_shard(base_id: str, shard: int, num_shards: int) -> str:
    """The first of ``base_id``, ``base_id.1``, ``base_id.2``, ... that lives on ``shard`` (about ``num_shards``
    tries); ``base_id`` itself if none of the first ``64 * num_shards`` does (then it is placed by id)."""
    if shard_of_id(base_id, num_shards) == shard:
        return base_id
    for suffix in range(1, 64 * num_shards):
        request_id = f"{base_id}.{suffix}"
        if shard_of_id(request_id, num_shards) == shard:
            return request_id
    return base_id


@dataclass(frozen=True)
class QueueLayout:
    """The keys of one logical queue: its own (``home``) and those of each shard.

    Attributes:
        home: queue-wide keys: the workers hash, reply streams, files and batches; also the lanes and results
            of a queue of one shard (then ``shards == (home,)``).
        shards: shard ``k``'s keys at position ``k``.
        placement: ``prefix`` (by the prompt's first characters, for ids the producer generates) or ``id``.
        is_cluster: keys of different shards are on different cluster slots: a command (a BLPOP, an MGET, an
            XREADGROUP) may name keys of one shard only.
    """

    home: Keys
    shards: tuple[Keys, ...]
    placement: Placement = "prefix"
    is_cluster: bool = False

    @classmethod
    def build(cls, prefix: str, queue: str, num_lanes: int, *, num_shards: int = 1, hash_tag: bool = False,
              placement: Placement = "prefix", is_cluster: bool = False) -> QueueLayout:
        """The layout of queue ``prefix:queue``: braced (hash-tagged) names on a cluster or with more than one
        shard, today's plain names for one shard on one instance."""
        if not 1 <= num_shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1..{MAX_SHARDS}, got {num_shards}")
        home = Keys(prefix, queue, num_lanes, hash_tag or is_cluster or num_shards > 1)
        if num_shards == 1:
            return cls(home, (home,), placement, is_cluster)
        shards = tuple(Keys(prefix, queue, num_lanes, True, shard=k) for k in range(num_shards))
        return cls(home, shards, placement, is_cluster)

    @classmethod
    def single(cls, keys: Keys) -> QueueLayout:
        """The layout of a queue of one shard whose keys are ``keys`` (on one instance)."""
        return cls(keys, (keys,))

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def is_sharded(self) -> bool:
        return len(self.shards) > 1

    def shard_of(self, request_id: str) -> int:
        """The shard ``request_id`` lives on."""
        return shard_of_id(request_id, len(self.shards))

    def for_id(self, request_id: str) -> Keys:
        """The keys of the shard ``request_id`` lives on."""
        return self.shards[self.shard_of(request_id)]

    def shard_of_stream(self, stream: str) -> int | None:
        """The shard whose key ``stream`` is (a lane, the dead-letter stream ...); None when it is none of them."""
        if not self.is_sharded:
            return 0 if stream.startswith(self.home.base + ":") else None
        head, _, _ = stream.partition("}")
        shard = head.rpartition(":")[2]
        if not shard.isdigit() or int(shard) >= len(self.shards):
            return None
        return int(shard) if stream.startswith(self.shards[int(shard)].base + ":") else None

    def for_stream(self, stream: str) -> Keys:
        """The keys of the shard ``stream`` belongs to.

        Raises:
            ValueError: ``stream`` is no shard's key.
        """
        shard = self.shard_of_stream(stream)
        if shard is None:
            raise ValueError(f"{stream!r} is no key of queue {self.home.base}")
        return self.shards[shard]

    @property
    def places_by_prefix(self) -> bool:
        """Whether ids move to their prompt prefix's shard (:meth:`placed`, :meth:`placed_from`); else an id stays
        as it is and decides its shard itself."""
        return self.is_sharded and self.placement == "prefix"

    def placed(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` (whose id the producer generated) with an id on the shard its placement chooses."""
        if not self.places_by_prefix:
            return request
        shard = shard_of_prefix(request, len(self.shards))
        if self.shard_of(request.id) == shard:
            return request
        return request.model_copy(update={"id": id_on_shard(shard, len(self.shards))})

    def placed_from(self, request: GenerationRequest) -> GenerationRequest:
        """``request``, whose id the caller derived from its own and derives again to find it (a bulk row's
        attempt, a Celery task's), with the first id derived from that one on the shard its placement chooses
        (:func:`derived_id_on_shard`): the same request gives the same id every time."""
        if not self.places_by_prefix:
            return request
        request_id = derived_id_on_shard(request.id, shard_of_prefix(request, len(self.shards)), len(self.shards))
        return request if request_id == request.id else request.model_copy(update={"id": request_id})

    def lanes_for(self, models: Iterable[str], is_decode: bool = False) -> list[Lane]:
        """:meth:`Keys.lanes_for` of every shard, lane 0 of all shards first."""
        models = sorted(set(models))
        lanes = [lane for keys in self.shards for lane in keys.lanes_for(models, is_decode)]
        return sorted(lanes, key=lambda lane: lane.priority)

    def slot_groups(self, request_ids: Sequence[str]) -> list[list[str]]:
        """``request_ids`` in groups whose keys one command may name together: all of them on one instance,
        one group per shard on a cluster (in the order of first appearance)."""
        if not self.is_cluster or not self.is_sharded:
            return [list(request_ids)] if request_ids else []
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            groups.setdefault(self.shard_of(request_id), []).append(request_id)
        return list(groups.values())
