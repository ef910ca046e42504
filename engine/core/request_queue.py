"""The scheduler's request bookkeeping: waiting / running / swapped queues kept consistent
with each request's status, the running requests kept in urgency order and the waiting and swapped ones in admission
order. Standard library only."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from tokenmill.engine.core.kept_order import KeptOrder
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kv.block_manager import BlockManager


class RequestQueues:
    """Every unfinished request, in exactly the queue its status names.

    The lists' order carries no meaning: the queues keep the running requests in urgency order beside them
    (:meth:`running_in_order`) and the waiting and swapped ones in admission order (:meth:`in_admission_order`), as
    requests come and go. Moves go through :meth:`move` so status and queue never disagree.

    Args:
        admission_key: the key of the scheduler's admission order: the queues keep the waiting and swapped
            requests sorted by it as they come and go (:meth:`in_admission_order`), so a step with thousands waiting
            does not compute and sort thousands of keys. A request's key is made when it is first read and kept
            while it waits or is swapped; :meth:`rekey` makes them all anew (an order by predicted length, when a
            prediction may have moved).
        is_key_fixed: whether a request's key never changes while it waits or is swapped (first come, first
            served): :meth:`check_invariants` then holds each kept key to a fresh one.
        running_key: the key of the order running requests are scheduled in (most urgent first), fixed while a
            request runs (``scheduler_policy.running_order_key``): the queues keep them sorted by it
            (:meth:`running_in_order`). None: kept in arrival order.
    """

    def __init__(self, admission_key: Callable[[Request], Any], is_key_fixed: bool = True,
                 running_key: Callable[[Request], Any] | None = None) -> None:
        self.requests: dict[str, Request] = {}  # request_id -> unfinished request
        self.waiting: list[Request] = []  # no KV anywhere (new, or preempted by recompute)
        self.running: list[Request] = []  # owns device blocks
        self.swapped: list[Request] = []  # owns host blocks
        self._by_status = {RequestStatus.WAITING: self.waiting, RequestStatus.RUNNING: self.running,
                           RequestStatus.SWAPPED: self.swapped}
        self._admission_key = admission_key
        self._is_key_fixed = is_key_fixed
        # the length groups of the waiting requests, with how many of each (none at 0)
        self.waiting_groups: Counter[str | None] = Counter()
        # the waiting and swapped requests in admission order, and those that came since the last read, whose keys
        # are made then (a preempted request's aging restarts after its move)
        self._admission_order = KeptOrder()
        self._arrived: list[Request] = []
        # the running requests, by running_key
        self._running_key = running_key or (lambda _: 0)
        self._running_order = KeptOrder()
        self.request_to_admitted_step: dict[str, int] = {}  # running request -> step it (re)started
        # running slots (max_num_seqs) the running queue takes: kept as requests come and go (a request's seats never
        # change: a forked parent leaves, its samples come), so the admission checks do not sum the queue each time
        self.num_running_seats = 0

    def _queue(self, status: RequestStatus) -> list[Request]:
        return self._by_status[status]

    def in_admission_order(self) -> Iterator[Request]:
        """The waiting and swapped requests in admission order, read lazily: admitting or finishing the one just read
        is fine while iterating; one that starts waiting meanwhile (preempted) is not among them (it comes in the next
        call's)."""
        if self._arrived:
            arrived, self._arrived = self._arrived, []
            self._admission_order.add([(self._admission_key(request), request) for request in arrived])
        return self._admission_order.read()

    def running_in_order(self) -> list[Request]:
        """The running requests, most urgent first (by ``running_key``); a new list."""
        return self._running_order.requests()

    def least_urgent_running_key(self) -> Any | None:
        """The ``running_key`` of the last running request in order (the least urgent); None when none runs."""
        return self._running_order.last_key()

    def rekey(self) -> None:
        """Make every kept key anew at the next read (the order's inputs moved)."""
        self._arrived += self._admission_order.take_all()

    def _enter(self, request: Request) -> None:
        """The request starts waiting or is swapped."""
        self._arrived.append(request)
        if request.status is RequestStatus.WAITING:
            self.waiting_groups[request.length_state.group] += 1

    def _leave(self, request: Request) -> None:
        """The request stops waiting or being swapped."""
        if request.status is RequestStatus.WAITING:
            group = request.length_state.group
            self.waiting_groups[group] -= 1
            if not self.waiting_groups[group]:
                del self.waiting_groups[group]
        if request in self._admission_order:
            self._admission_order.remove(request)
        else:
            self._arrived.remove(request)

    def add(self, request: Request) -> None:
        """Start tracking a request as WAITING.

        Raises:
            ValueError: a request with this id is already tracked.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._enter(request)

    def add_running(self, request: Request, step_index: int) -> None:
        """Start tracking a request that already holds device blocks (a forked sample).

        Raises:
            ValueError: a request with this id is already tracked.
        """
        self.add(request)
        self.move(request, RequestStatus.RUNNING, step_index)

    def move(self, request: Request, status: RequestStatus, step_index: int = 0) -> None:
        """Move a tracked request to the queue of ``status`` (RUNNING records ``step_index``)."""
        self._queue(request.status).remove(request)
        self.request_to_admitted_step.pop(request.request_id, None)
        if request.status is RequestStatus.RUNNING:
            self.num_running_seats -= request.num_seats
            self._running_order.remove(request)
        else:
            self._leave(request)
        request.status = status
        self._queue(status).append(request)
        if status is RequestStatus.RUNNING:
            self.request_to_admitted_step[request.request_id] = step_index
            self.num_running_seats += request.num_seats
            self._running_order.add([(self._running_key(request), request)])
        else:
            self._enter(request)

    def remove(self, request_id: str) -> Request | None:
        """Stop tracking a request (None if unknown); its status is left to the caller."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._queue(request.status).remove(request)
            self.request_to_admitted_step.pop(request_id, None)
            if request.status is RequestStatus.RUNNING:
                self.num_running_seats -= request.num_seats
                self._running_order.remove(request)
            else:
                self._leave(request)
        return request

    def check_invariants(self, block_manager: BlockManager, max_num_seqs: int) -> None:
        """Raise InvariantError unless queues, statuses and block ownership agree."""
        statuses = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED)
        if sum(len(self._queue(status)) for status in statuses) != len(self.requests):
            raise InvariantError("queue lengths do not add up to the tracked requests")
        for status in statuses:
            for request in self._queue(status):
                if request.status is not status or self.requests.get(request.request_id) is not request:
                    raise InvariantError(f"{request.request_id} is {request.status!r} in the {status.name} queue")
                _check_blocks(request, block_manager)
        num_seats = sum(r.num_seats for r in self.running)
        if num_seats != self.num_running_seats:
            raise InvariantError(f"{num_seats} running seats counted as {self.num_running_seats}")
        if num_seats > max_num_seqs:
            raise InvariantError(f"{num_seats} running seats > max_num_seqs {max_num_seqs}")
        if self.request_to_admitted_step.keys() != {r.request_id for r in self.running}:
            raise InvariantError("admission records do not match the running queue")
        self._check_orders(self._admission_key)
        num_used = block_manager.num_gpu_blocks - block_manager.num_free_gpu_blocks
        if num_used != len({b for r in self.running for b in block_manager.get_block_ids(r.request_id)}):
            raise InvariantError("device blocks are owned by requests that are not running")
        num_used = block_manager.num_cpu_blocks - block_manager.num_free_cpu_blocks
        if num_used != sum(len(block_manager.get_host_block_ids(r.request_id)) for r in self.swapped):
            raise InvariantError("host blocks are owned by requests that are not swapped")

    def _check_orders(self, admission_key: Callable[[Request], Any]) -> None:
        """The admission order's sorted and arrived requests are exactly the waiting and swapped ones, each sorted one
        under its kept key (the key it has now, where keys are fixed), in order; the waiting groups are counted right;
        the running order holds exactly the running requests, under their keys, in order."""
        members = self._admission_order.check(admission_key if self._is_key_fixed else None) + self._arrived
        if sorted(map(id, members)) != sorted(map(id, self.waiting + self.swapped)):
            raise InvariantError("the admission order does not hold exactly the waiting and swapped requests")
        if self.waiting_groups != Counter(request.length_state.group for request in self.waiting):
            raise InvariantError("the waiting requests' length groups are miscounted")
        if sorted(map(id, self._running_order.check(self._running_key))) != sorted(map(id, self.running)):
            raise InvariantError("the running order does not hold exactly the running requests")


def _check_blocks(request: Request, block_manager: BlockManager) -> None:
    """A request's blocks must match its status and cover its computed tokens."""
    device = block_manager.get_block_ids(request.request_id)
    host = block_manager.get_host_block_ids(request.request_id)
    num_tokens = request.num_computed_tokens
    if request.status is RequestStatus.WAITING:
        is_ok = not device and not host and num_tokens == 0
    elif request.status is RequestStatus.RUNNING:
        is_ok = not host and len(device) * block_manager.block_size >= num_tokens
    else:
        # NOTE: a victim preempted after its chunk was planned may carry one uncomputed block.
        is_ok = not device and len(host) >= block_manager.num_blocks_for(num_tokens)
    if not is_ok:
        raise InvariantError(
            f"{request.request_id} ({request.status.name}, {num_tokens} computed) owns device {device}, host {host}"
        )
