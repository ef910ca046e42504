"""A tensor-parallel follower rank (1 .. N - 1), a process rank 0 starts (engine/model/tp_leader.py):

    python -m tokenmill.engine.model.tp_follower --rank R --world-size N --port P --parent-pid PID

It reads the engine's config from rank 0's store, loads its shard of the model alone (as rank 0 does),
meets the other ranks, builds a KV pool of rank 0's size over its own KV heads, then runs each step rank 0
broadcasts (engine/model/tp_step.py): the block copies, then the decoder layers over the step's inputs,
whose all-reduces pair with the other ranks'. Rank 0 alone computes logits and samples, so a follower
stops at the final norm. The layers run eagerly, or through the native C++ decoder stack once a probe
(rank 0's, at load) found it bitwise the eager forward on every rank (engine/model/native_decoder). A step
whose forward raises here fails on every rank (engine/model/tp_group.py, "Steps that fail"): this rank makes
the all-reduces it had left, leaves its reason in the store for rank 0 and waits for the next step (rank 0
retries the requests in parts). It exits when told to stop, when a collective fails, when its block copies
fail (its pool would no longer be rank 0's), or when rank 0's process is gone. Imports torch.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.kernels.attention import AttentionBackend, select_backend
from tokenmill.engine.model.hf_attention import StepAttention
from tokenmill.engine.model.kv_cache import KVCache
from tokenmill.engine.model.model_loader import LoadedModel
from tokenmill.engine.model.model_runner import step_tensors
from tokenmill.engine.model.model_setup import kv_cache_spec, load_engine_model
from tokenmill.engine.model.native_decoder import NativeDecoder, follower_probe
from tokenmill.engine.model.tensor_parallel import Shard
from tokenmill.engine.model.tp_group import SETUP_TIMEOUT, ProcessGroups, TensorParallelLost
from tokenmill.engine.model.tp_step import count_disagreeing, receive_step

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5  # how often a follower checks that rank 0's process is still its parent


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format=f"tensor-parallel rank {args.rank}: %(levelname)s %(name)s: %(message)s")
    _exit_with_parent(args.parent_pid)
    store = TCPStore("127.0.0.1", args.port, args.world_size, False, timeout=SETUP_TIMEOUT)
    config = EngineConfig.model_validate_json(store.get("config"))
    groups = ProcessGroups(args.rank, args.world_size)
    try:
        loaded = _load(config, Shard(args.rank, args.world_size, groups.all_reduce, groups.expect_forward))
        shared_memory = store.get("shared_memory").decode()  # NOTE: set once rank 0 has loaded its own shard
        if shared_memory:
            groups.use_shared_memory(Path(shared_memory))
    except Exception as exc:  # reported to rank 0, which raises it
        logger.exception("loading the model failed")
        store.set(f"error/{args.rank}", f"{type(exc).__name__}: {exc}")
        return 1
    store.set(f"ready/{args.rank}", "1")
    groups.connect(store, loaded.device)
    num_gpu_blocks, num_cpu_blocks, backend_name = store.get("kv_cache").decode().split(",")
    spec = kv_cache_spec(loaded, config.cache.block_size)
    kv_cache = KVCache(spec, int(num_gpu_blocks), int(num_cpu_blocks), loaded.device)
    backend = select_backend(backend_name, loaded.device)  # type: ignore[arg-type]
    def report_failure(reason: str) -> None:
        store.set(f"step_failure/{args.rank}", reason)

    try:
        serve(groups, loaded.model, kv_cache, backend, loaded.device, report_failure)
    except TensorParallelLost as lost:
        logger.error("%s", lost)
        return 1
    return 0


@torch.inference_mode()
def serve(groups: ProcessGroups, model: Any, kv_cache: KVCache, backend: AttentionBackend,
          device: torch.device, report_failure: Callable[[str], None] = lambda reason: None) -> None:
    """Run rank 0's steps until it says stop: each step's block copies (in the runner's order), then the
    decoder layers (``model``'s base model, without its LM head) over its inputs; a probe switches them to
    the native stack when every rank agrees. A step whose forward raises fails on every rank (its reason goes
    to ``report_failure`` first, for rank 0's error).

    Raises:
        TensorParallelLost: rank 0 (or another follower) is gone.
    """
    base = model.get_decoder()
    native: NativeDecoder | None = None
    while (message := receive_step(groups)) is not None:
        kv_cache.swap_out(message.swap_out)
        kv_cache.copy_blocks(message.copy_blocks)
        kv_cache.swap_in(message.swap_in)
        if message.inputs is None:
            continue
        if message.probe_fused_mlp is not None:
            on_device, attention = step_tensors(message.inputs, message.num_decodes, kv_cache, backend, device)
            input_ids, positions = on_device["input_ids"].view(1, -1), on_device["positions"].view(1, -1)
            eager = functools.partial(_eager_hidden_states, base, input_ids, positions, attention)
            decoder, agrees = follower_probe(model, kv_cache, backend.name, message.probe_fused_mlp,
                                             groups.all_reduce, eager, (input_ids, positions, attention))
            native = decoder if count_disagreeing(groups, agrees) == 0 else None
            continue
        groups.begin_step(dict(message.inputs.lengths)["input_ids"])
        try:
            on_device, attention = step_tensors(message.inputs, message.num_decodes, kv_cache, backend, device)
            input_ids, positions = on_device["input_ids"].view(1, -1), on_device["positions"].view(1, -1)
            if native is not None:
                native.hidden_states(input_ids, positions, attention)
            else:
                _eager_hidden_states(base, input_ids, positions, attention)
        except TensorParallelLost:
            raise
        except Exception as exc:  # failed on every rank; rank 0 retries the requests in parts
            if groups.in_step:
                logger.exception("a step failed on this rank: every rank fails it, and rank 0 retries its requests")
                report_failure(f"{type(exc).__name__}: {exc}")
                groups.fail_step()
            else:  # NOTE: after the last all-reduce (the final norm): its KV is written, and rank 0 does not need it
                logger.exception("a step failed on this rank after its last all-reduce; no rank depends on the rest")


def _eager_hidden_states(base: Any, input_ids: torch.Tensor, positions: torch.Tensor,
                         attention: StepAttention) -> torch.Tensor:
    """The base model's output over a step, through the Hugging Face modules (the reference forward)."""
    hidden: torch.Tensor = base(input_ids=input_ids, position_ids=positions, use_cache=False,
                                tokenmill_step=attention).last_hidden_state
    return hidden


def _load(config: EngineConfig, shard: Shard) -> LoadedModel:
    """This rank's shard of the model, loaded as rank 0 loads its own, on its device (CUDA: its rank's GPU)."""
    if config.model.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(shard.rank)
    return load_engine_model(config, shard)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when rank 0's process is gone (the follower is then re-parented), whatever it is doing."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="tm-tp-parent-watch", daemon=True).start()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="a tensor-parallel follower rank (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="rank 0's store, on 127.0.0.1")
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0's process")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
