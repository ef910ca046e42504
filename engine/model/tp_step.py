"""The message rank 0 broadcasts to tensor-parallel followers for each step: the step's KV block copies
(swap-out, copy-on-write, swap-in: every rank's pool must stay in step) and the forward's integer inputs
(engine/model/step_inputs.py: token ids, positions, slots, block tables, context lengths), or stop. A probe is
a step whose inputs every rank runs both eagerly and through the native decoder stack, at load
(engine/model/native_decoder), to agree on which forward the steps after it take.

On the wire, two broadcasts of int64 host tensors: a fixed-size header (what follows and how long each
part is), then one payload holding the block pairs and the packed inputs. Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.errors import InvariantError
from tokenmill.engine.model.model_runner import STEP_INPUT_NAMES
from tokenmill.engine.model.step_inputs import StepInputs
from tokenmill.engine.model.tp_group import ProcessGroups

Pairs = list[tuple[int, int]]

_STOP, _STEP, _PROBE_FUSED_MLP, _PROBE_ATEN_MLP = 0, 1, 2, 3
# op, pairs of swap-out, copy and swap-in, decodes in the batch, whether inputs follow, each input list's length
_HEADER_LEN = 6 + len(STEP_INPUT_NAMES)


@dataclass
class StepMessage:
    """One step as a follower runs it: block copies in the runner's order, then the forward over ``inputs``."""

    swap_out: Pairs
    copy_blocks: Pairs
    swap_in: Pairs
    inputs: StepInputs | None  # None: block copies only
    num_decodes: int = 0
    # A probe of the native decoder stack, built with its fused SiLU-gated MLP (True) or ATen's (False); None: a step
    probe_fused_mlp: bool | None = None


def send_step(groups: ProcessGroups, message: StepMessage) -> None:
    """Broadcast ``message`` from rank 0.

    Raises:
        TensorParallelLost: a follower is gone.
    """
    inputs = message.inputs
    lengths = [0] * len(STEP_INPUT_NAMES)
    if inputs is not None:
        names = [name for name, _ in inputs.lengths]
        if tuple(names) != STEP_INPUT_NAMES:
            raise InvariantError(f"step inputs {names} are not the wire's {STEP_INPUT_NAMES}")
        lengths = [length for _, length in inputs.lengths]
    pairs = [message.swap_out, message.copy_blocks, message.swap_in]
    op = _STEP if message.probe_fused_mlp is None else _PROBE_FUSED_MLP if message.probe_fused_mlp else \
        _PROBE_ATEN_MLP
    header = [op, *(len(p) for p in pairs), message.num_decodes, int(inputs is not None), *lengths]
    groups.broadcast(torch.tensor(header, dtype=torch.int64))
    parts = [torch.tensor([v for p in pairs for pair in p for v in pair], dtype=torch.int64)]
    if inputs is not None:
        parts.append(inputs.host())
    payload = torch.cat(parts)
    if payload.numel():
        groups.broadcast(payload)


def send_stop(groups: ProcessGroups) -> None:
    """Tell every follower to leave its loop."""
    groups.broadcast(torch.tensor([_STOP] + [0] * (_HEADER_LEN - 1), dtype=torch.int64))


def receive_step(groups: ProcessGroups) -> StepMessage | None:
    """A follower's next step (it waits for as long as the engine idles); None: stop.

    Raises:
        TensorParallelLost: rank 0 is gone.
    """
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    groups.broadcast(header)
    op, num_swap_out, num_copy, num_swap_in, num_decodes, has_inputs, *lengths = header.tolist()
    if op == _STOP:
        return None
    num_pairs = num_swap_out + num_copy + num_swap_in
    payload = torch.empty(2 * num_pairs + sum(lengths), dtype=torch.int64)
    if payload.numel():
        groups.broadcast(payload)
    flat = payload[: 2 * num_pairs].tolist()
    pairs = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    inputs = StepInputs.received(payload[2 * num_pairs:], list(zip(STEP_INPUT_NAMES, lengths))) if has_inputs \
        else None
    return StepMessage(pairs[:num_swap_out], pairs[num_swap_out:num_swap_out + num_copy],
                       pairs[num_swap_out + num_copy:], inputs, num_decodes,
                       None if op == _STEP else op == _PROBE_FUSED_MLP)


def count_disagreeing(groups: ProcessGroups, agrees: bool) -> int:
    """After a probe, on every rank: how many ranks' native stacks differed from their eager forward."""
    verdict = torch.tensor([0.0 if agrees else 1.0])
    groups.all_reduce(verdict)
    return round(verdict.item())
