"""The scheduler's request bookkeeping: waiting / running / swapped queues kept consistent
with each request's status. Standard library only."""

from __future__ import annotations

from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kv.block_manager import BlockManager


class RequestQueues:
    """Every unfinished request, in exactly the queue its status names.

    Queue order carries no meaning (the scheduler sorts by urgency each step); moves go
    through :meth:`move` so status and queue never disagree.
    """

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # request_id -> unfinished request
        self.waiting: list[Request] = []  # no KV anywhere (new, or preempted by recompute)
        self.running: list[Request] = []  # owns device blocks
        self.swapped: list[Request] = []  # owns host blocks
        self.request_to_admitted_step: dict[str, int] = {}  # running request -> step it (re)started
        # running slots (max_num_seqs) the running queue takes: kept as requests come and go (a request's seats never
        # change: a forked parent leaves, its samples come), so the admission checks do not sum the queue each time
        self.num_running_seats = 0

    def _queue(self, status: RequestStatus) -> list[Request]:
        queues = {RequestStatus.WAITING: self.waiting, RequestStatus.RUNNING: self.running,
                  RequestStatus.SWAPPED: self.swapped}
        return queues[status]

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
        request.status = status
        self._queue(status).append(request)
        if status is RequestStatus.RUNNING:
            self.request_to_admitted_step[request.request_id] = step_index
            self.num_running_seats += request.num_seats

    def remove(self, request_id: str) -> Request | None:
        """Stop tracking a request (None if unknown); its status is left to the caller."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._queue(request.status).remove(request)
            self.request_to_admitted_step.pop(request_id, None)
            if request.status is RequestStatus.RUNNING:
                self.num_running_seats -= request.num_seats
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
        num_used = block_manager.num_gpu_blocks - block_manager.num_free_gpu_blocks
        if num_used != len({b for r in self.running for b in block_manager.get_block_ids(r.request_id)}):
            raise InvariantError("device blocks are owned by requests that are not running")
        num_used = block_manager.num_cpu_blocks - block_manager.num_free_cpu_blocks
        if num_used != sum(len(block_manager.get_host_block_ids(r.request_id)) for r in self.swapped):
            raise InvariantError("host blocks are owned by requests that are not swapped")


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
