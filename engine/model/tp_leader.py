"""Rank 0's side of tensor parallelism: start the follower processes, meet them once each has loaded its
shard, send them every step (engine/model/tp_step.py), notice when one is gone, and stop them.

Followers are plain subprocesses (``python -m tokenmill.engine.model.tp_follower``), not forks: each loads
its own shard of the model, alone, from the same config (passed through the store). They never outlive rank 0:
they leave their loop on :meth:`TensorParallelLeader.close`, are terminated when the leader is collected or
the interpreter exits, and exit by themselves when rank 0's process is gone (a watchdog, and their broken
connections). A follower that fails is noticed before the next step (its exit status) or in the step
(its connections close, or the step times out): :class:`~engine.model.tp_group.TensorParallelLost`.

A step whose forward raises on some rank fails on every rank (engine/model/tp_group.py, "Steps that fail"): a
follower's failure reaches rank 0 as :class:`~engine.model.tp_group.TensorParallelStepFailed` (with the follower's
reason, which it leaves in the store), contained to the step's requests like any failed step; when rank 0's own
forward raised before its last all-reduce, the all-reduces it had left are made before the next message goes out
(the engine's retry of the step's halves, or the stop), so every rank's collectives stay paired.
Imports torch.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.step_io import SchedulerOutput
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.model import shm_all_reduce
from tokenmill.engine.model.model_runner import PreparedBatch
from tokenmill.engine.model.tensor_parallel import Shard
from tokenmill.engine.model.tp_group import (
    SETUP_TIMEOUT,
    ProcessGroups,
    TensorParallelLost,
    TensorParallelStepFailed,
)
from tokenmill.engine.model.tp_step import StepMessage, count_disagreeing, send_step, send_stop

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # a stopped follower exits by itself within this, else it is killed
_EXIT_NOTICE_S = 2.0  # after a failed collective, how long a follower that closed its connections may take to exit
_POLL_S = 0.05


class TensorParallelLeader:
    """Starts ``tensor_parallel_size - 1`` followers of ``config`` on construction.

    Args:
        config: the engine's settings; every follower loads ``config.model`` as this rank does.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.model.tensor_parallel_size
        self._cpu_all_reduce = config.model.tensor_parallel_cpu_all_reduce
        self.groups = ProcessGroups(0, self.world_size, explain=self._follower_states, check_peers=self._check_alive,
                                    step_failed=self._step_failure)
        self._store = TCPStore("127.0.0.1", 0, self.world_size, True, timeout=SETUP_TIMEOUT,
                                    wait_for_workers=False)
        self._store.set("config", config.model_dump_json())
        self._followers = [
            subprocess.Popen([sys.executable, "-m", "tokenmill.engine.model.tp_follower", "--rank", str(rank),
                              "--world-size", str(self.world_size), "--port", str(self._store.port),
                              "--parent-pid", str(os.getpid())])
            for rank in range(1, self.world_size)]
        self._end = weakref.finalize(self, _end_processes, self._followers)
        self._connected = False
        logger.info("tensor parallelism: %d ranks; followers started (pids %s)", self.world_size,
                    [p.pid for p in self._followers])

    @property
    def shard(self) -> Shard:
        """Rank 0's shard: what it loads of the model."""
        return Shard(0, self.world_size, self.groups.all_reduce, self.groups.expect_forward)

    @property
    def follower_pids(self) -> list[int]:
        return [process.pid for process in self._followers]

    def connect(self, device: torch.device) -> None:
        """Wait until every follower has loaded its shard, then meet them (:meth:`ProcessGroups.connect`).

        Raises:
            ModelLoadError: a follower failed to load (its reason), or exited.
        """
        segment = self._shared_memory_segment(device)
        self._store.set("shared_memory", str(segment) if segment is not None else "")
        try:
            if segment is not None:
                self.groups.use_shared_memory(segment)
            self._wait_until_loaded()
            self.groups.connect(self._store, device)
        finally:
            if segment is not None:
                shm_all_reduce.unlink_segment(segment)
        self._connected = True
        logger.info("tensor parallelism: the forward's all-reduces go through %s",
                    "shared memory" if self.groups.uses_shared_memory else "NCCL" if device.type == "cuda" else "gloo")

    def _wait_until_loaded(self) -> None:
        """Until every follower has loaded its shard (and mapped the all-reduce's segment, if any).

        Raises:
            ModelLoadError: a follower failed (its reason), exited, or took longer than the setup timeout.
        """
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + SETUP_TIMEOUT.total_seconds()
        while pending:
            for rank in sorted(pending):
                if self._store.check([f"error/{rank}"]):
                    raise ModelLoadError(f"tensor-parallel rank {rank}: {self._store.get(f'error/{rank}').decode()}")
                if self._store.check([f"ready/{rank}"]):
                    pending.discard(rank)
                elif self._followers[rank - 1].poll() is not None:
                    raise ModelLoadError(f"tensor-parallel rank {rank} exited while loading the model: "
                                         f"{_exit_status(self._followers[rank - 1])} (its log is above)")
            if pending:
                if time.monotonic() > deadline:
                    raise ModelLoadError(f"tensor-parallel ranks {sorted(pending)} did not load the model in "
                                         f"{SETUP_TIMEOUT.total_seconds():.0f} s")
                time.sleep(_POLL_S)

    def _shared_memory_segment(self, device: torch.device) -> Path | None:
        """The CPU all-reduce's segment, or None (CUDA, gloo asked for, or no room: gloo, logged)."""
        if device.type != "cpu" or self._cpu_all_reduce != "shared_memory":
            return None
        if not shm_all_reduce.available():
            logger.warning("tensor parallelism: no writable %s on an x86-64 CPU; the all-reduces go through gloo "
                           "(slower)", shm_all_reduce.SHM_DIR)
            return None
        try:
            return shm_all_reduce.create_segment(self.world_size)
        except OSError as exc:
            logger.warning("tensor parallelism: no shared-memory segment (%s); the all-reduces go through gloo "
                           "(slower)", exc)
            return None

    def share_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, backend_name: str) -> None:
        """Give the followers rank 0's KV pool sizes and attention backend: every rank runs the same ones."""
        self._store.set("kv_cache", f"{num_gpu_blocks},{num_cpu_blocks},{backend_name}")

    def send_step(self, scheduler_output: SchedulerOutput, batch: PreparedBatch | None) -> None:
        """Send the followers a step's block copies and (``batch``) forward inputs, before rank 0 runs it.

        Raises:
            TensorParallelLost: a follower is gone.
        """
        self._check_alive()
        self._settle_failed_step()
        message = StepMessage(scheduler_output.swap_out, scheduler_output.copy_blocks, scheduler_output.swap_in,
                              batch.inputs if batch is not None else None,
                              batch.attention.meta.num_decodes if batch is not None else 0)
        if message.inputs is not None or message.swap_out or message.copy_blocks or message.swap_in:
            send_step(self.groups, message)
        if batch is not None:
            self.groups.begin_step(batch.input_ids.shape[-1])

    def send_probe(self, batch: PreparedBatch, fused_mlp: bool) -> None:
        """Send the followers the native decoder stack's probe (engine/model/native_decoder): ``batch`` to run
        eagerly and through a stack built with ``fused_mlp``, then :meth:`count_disagreeing`.

        Raises:
            TensorParallelLost: a follower is gone.
        """
        self._check_alive()
        self._settle_failed_step()
        send_step(self.groups, StepMessage([], [], [], batch.inputs, batch.attention.meta.num_decodes,
                                           probe_fused_mlp=fused_mlp))

    def count_disagreeing(self, agrees: bool) -> int:
        """How many ranks' native stacks differed from their eager forward on the probe (this one's: ``agrees``);
        every rank learns the same count, so all take the same forward from then on."""
        return count_disagreeing(self.groups, agrees)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank, in place (what a shard's row-parallel layers do)."""
        self.groups.all_reduce(tensor)

    def _settle_failed_step(self) -> None:
        """The last step's forward raised here before its last all-reduce (the followers wait in the next one): make
        the ones left, and the verdict, before anything else goes to the followers."""
        if self.groups.in_step:
            self.groups.fail_step()

    def _step_failure(self, ranks: list[int]) -> TensorParallelStepFailed:
        """The error of a step other ranks failed: each one's reason, which it left in the store."""
        reasons = []
        for rank in ranks:
            key = f"step_failure/{rank}"
            reason = self._store.get(key).decode() if self._store.check([key]) else "no reason given"
            reasons.append(f"rank {rank}: {reason}")
        return TensorParallelStepFailed("the step failed on tensor-parallel " + "; ".join(reasons)
                                        + " (every rank failed it; the traceback is in that rank's log)")

    def close(self) -> None:
        """Stop the followers: ask them to leave their loop, then end any that did not."""
        if self._connected and self._end.alive and all(p.poll() is None for p in self._followers):
            try:
                self._settle_failed_step()
                send_stop(self.groups)
            except TensorParallelLost:
                logger.warning("tensor parallelism: a follower was gone before it was stopped")
            _wait_for_exit(self._followers, STOP_GRACE_S)
        self._connected = False
        self._end()

    def _check_alive(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self._followers, start=1) if p.poll() is not None]
        if dead:
            raise TensorParallelLost("tensor-parallel " + "; ".join(
                f"rank {rank} (pid {p.pid}) exited: {_exit_status(p)}" for rank, p in dead)
                + "; the engine cannot step without it")

    def _follower_states(self) -> str:
        """What became of the followers, for a failed collective's message."""
        _wait_for_exit(self._followers, _EXIT_NOTICE_S)
        return "; ".join(f"follower rank {rank} (pid {p.pid}) " +
                         (f"exited: {_exit_status(p)}" if p.poll() is not None else "is still running (stuck?)")
                         for rank, p in enumerate(self._followers, start=1))


def _exit_status(process: subprocess.Popen[bytes]) -> str:
    code = process.returncode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _wait_for_exit(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _end_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the followers still running and reap every one (the leader's finalizer: close, collection, exit)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    _wait_for_exit(processes, STOP_GRACE_S)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
