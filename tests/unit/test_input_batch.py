"""The runner's persistent batch (engine/model/input_batch.py): a step's inputs built by difference from the rows
of the requests in the batch are the very integers the plain path flattens from the chunks, step after step, as
requests join, grow past block boundaries, copy a shared block, trim rejected drafts, are preempted (swapped or
recomputed) and resumed, run prefill in chunks, finish, and come back under the same id; through the forward's
inputs and the static decode buffers alike. The assumptions the rows rest on are checked every step here
(``check``), and a table changed against them is reported."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.core.step_io import ModelOutput, ScheduledChunk, SchedulerOutput, StepRunner
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kernels.attention.reference import ReferenceBackend
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.model.input_batch import InputBatch
from tokenmill.engine.model.kv_cache import KVCache, KVCacheSpec
from tokenmill.engine.model.model_loader import LoadedModel
from tokenmill.engine.model.model_runner import ModelRunner, PreparedBatch, StaticStep
from tokenmill.engine.model.static_decode import StaticDecode, decode_buckets
from tokenmill.engine.model.step_inputs import StepInputs, TableRows
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.protocol.sampling import SamplingParams

MAX_BLOCKS_PER_SEQ = 256


def input_runner(block_size: int, persistent: bool, static: bool = False, max_num_seqs: int = 8) -> ModelRunner:
    """A runner with no model, for its inputs only (:meth:`ModelRunner.plan_step`); ``static``: decode steps fill
    static-shape buffers (as CUDA graphs replay them)."""
    device = torch.device("cpu")
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size, dtype=torch.float32)
    kv_cache = KVCache(spec, 4, 0, device)
    backend = ReferenceBackend()
    static_decode = None
    if static:
        static_decode = StaticDecode(lambda *args: torch.zeros(0), kv_cache, backend, decode_buckets(max_num_seqs),
                                     max_blocks_per_seq=MAX_BLOCKS_PER_SEQ)
    loaded = cast(LoadedModel, SimpleNamespace(model=None, device=device, eos_token_ids=frozenset()))
    runner = ModelRunner(loaded, kv_cache, cast(Sampler, None), backend, static_decode=static_decode,
                         persistent_batch=persistent)
    if runner.input_batch is not None:
        runner.input_batch.check = True
    return runner


def assert_same_step(plain: PreparedBatch | StaticStep | None, persistent: PreparedBatch | StaticStep | None,
                     chunks: list[ScheduledChunk]) -> None:
    """The two paths' inputs of one step are the same integers (and the persistent one gathered its tables)."""
    if plain is None or persistent is None:
        assert plain is None and persistent is None
        return
    if isinstance(plain, StaticStep) or isinstance(persistent, StaticStep):
        assert isinstance(plain, StaticStep) and isinstance(persistent, StaticStep)
        assert plain.tables is None and persistent.tables is not None
        assert plain.shape == persistent.shape
        plain.static._fill(chunks, plain.shape, plain.tables)
        persistent.static._fill(chunks, persistent.shape, persistent.tables)
        for name in ("_input_ids", "_positions", "_slot_mapping", "_block_tables", "_seq_lens"):
            assert torch.equal(getattr(plain.static, name), getattr(persistent.static, name)), name
        return
    assert plain.inputs.lengths == persistent.inputs.lengths
    assert torch.equal(plain.inputs.host(), persistent.inputs.host())
    assert [c.request_id for c in plain.sample_chunks] == [c.request_id for c in persistent.sample_chunks]
    for name in ("block_tables", "slot_mapping", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(plain.attention.meta, name), getattr(persistent.attention.meta, name)), name
    assert plain.attention.meta.num_decodes == persistent.attention.meta.num_decodes
    assert persistent.inputs.values("tables") == plain.inputs.values("tables")


class Comparing:
    """Wraps a step runner: every step's inputs, built by both paths (each with its own runner, as the engine's
    would be), must agree before the step runs."""

    def __init__(self, inner: StepRunner, block_size: int, static: bool = False, max_num_seqs: int = 8) -> None:
        self.inner = inner
        self.plain = input_runner(block_size, persistent=False, static=static, max_num_seqs=max_num_seqs)
        self.persistent = input_runner(block_size, persistent=True, static=static, max_num_seqs=max_num_seqs)
        self.num_steps = self.num_static_steps = self.num_draft_chunks = 0

    @property
    def batch(self) -> InputBatch:
        assert self.persistent.input_batch is not None
        return self.persistent.input_batch

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        plain, persistent = self.plain.plan_step(plan), self.persistent.plan_step(plan)
        assert_same_step(plain, persistent, plan.chunks)
        self.num_steps += bool(plan.chunks)
        self.num_static_steps += isinstance(persistent, StaticStep)
        self.num_draft_chunks += sum(1 for c in plan.chunks if c.num_draft_tokens)
        return self.inner.execute(plan)


# ------------------------------------------------------------------------------ step inputs with gathered rows


def test_gathered_rows_are_packed_with_the_lists_in_one_tensor() -> None:
    table = torch.arange(40, dtype=torch.int64).view(5, 8)
    inputs = StepInputs()
    inputs.add("ids", [5, 6, 7])
    inputs.add_rows("tables", TableRows(table, [3, 0], 2))
    inputs.add("seq_lens", [9, 2**40])
    inputs.add_rows("none", TableRows(table, [], 3))
    assert inputs.lengths == [("ids", 3), ("tables", 4), ("seq_lens", 2), ("none", 0)]
    assert inputs.values("ids") == [5, 6, 7] and inputs.values("seq_lens") == [9, 2**40]
    assert inputs.values("tables") == [24, 25, 0, 1]
    assert inputs.host().tolist() == [5, 6, 7, 24, 25, 0, 1, 9, 2**40]
    uploaded = inputs.upload(torch.device("cpu"))
    assert uploaded["tables"].tolist() == [24, 25, 0, 1] and uploaded["seq_lens"].tolist() == [9, 2**40]
    received = StepInputs.received(inputs.host(), inputs.lengths)
    assert received.values("tables") == [24, 25, 0, 1] and received.values("seq_lens") == [9, 2**40]


# ------------------------------------------------------------------------------ a scripted block manager


class Steps:
    """Steps over a real block manager, each prepared by both paths and compared."""

    def __init__(self, block_size: int = 4, static: bool = False) -> None:
        self.bm = BlockManager(64, 32, block_size)
        self.plain = input_runner(block_size, persistent=False, static=static)
        self.persistent = input_runner(block_size, persistent=True, static=static)
        self.outputs: dict[str, int] = {}

    @property
    def batch(self) -> InputBatch:
        assert self.persistent.input_batch is not None
        return self.persistent.input_batch

    def chunk(self, request_id: str, start: int, num_tokens: int, needs_sample: bool = True,
              num_draft_tokens: int = 0) -> ScheduledChunk:
        assert self.bm.append_slots(request_id, start + num_tokens) is not None
        output = self.outputs.get(request_id, 0)
        if needs_sample:
            self.outputs[request_id] = output + 1
        return ScheduledChunk(request_id, list(range(100, 100 + num_tokens)), start, self.bm.block_table(request_id),
                              needs_sample, SamplingParams(), output, num_draft_tokens=num_draft_tokens)

    def run(self, chunks: list[ScheduledChunk], preempted: list[str] | None = None) -> None:
        plan = SchedulerOutput(chunks=chunks, preempted_request_ids=preempted or [])
        assert_same_step(self.plain.plan_step(plan), self.persistent.plan_step(plan), chunks)


@pytest.mark.parametrize("static", [False, True], ids=["forward", "static-decode"])
def test_rows_follow_every_way_a_table_changes(static: bool) -> None:
    steps = Steps(static=static)
    bm, batch = steps.bm, steps.batch
    # a joins with a prompt in two chunks; b joins with a short one
    steps.run([steps.chunk("a", 0, 6, needs_sample=False), steps.chunk("b", 0, 3)])
    steps.run([steps.chunk("b", 3, 1), steps.chunk("a", 6, 4)])
    assert batch.num_full_writes == 2
    # decodes past block boundaries: only the new blocks are written
    for position in range(4, 13):
        steps.run([steps.chunk("a", position + 6, 1), steps.chunk("b", position, 1)])
    assert batch.num_full_writes == 2 and batch.num_entry_writes > 0
    # c forks from b in the middle of b's last block: whichever writes first copies it (b here, in place)
    bm.fork("b", "c")
    steps.outputs["c"] = steps.outputs["b"]
    copies = bm.copy_on_write("b", 13)
    assert copies
    steps.run([steps.chunk("a", 19, 1), steps.chunk("b", 13, 1), steps.chunk("c", 13, 1)])
    assert batch.length(batch.row_of("b") or 0) == len(bm.block_table("b"))
    # drafts: a verifies 6 tokens (blocks for them), keeps 1 + 1, the rest trimmed
    steps.run([steps.chunk("a", 20, 6, num_draft_tokens=5), steps.chunk("b", 14, 1), steps.chunk("c", 14, 1)])
    bm.trim("a", 22)
    steps.outputs["a"] += 1
    steps.run([steps.chunk("a", 22, 1), steps.chunk("b", 15, 1), steps.chunk("c", 15, 1)])
    # b swapped out (its row goes), then back in with other blocks
    mapping = bm.swap_out("b")
    assert mapping
    steps.run([steps.chunk("a", 23, 1), steps.chunk("c", 16, 1)], preempted=["b"])
    assert batch.row_of("b") is None
    assert bm.swap_in("b")
    steps.run([steps.chunk("b", 16, 1), steps.chunk("a", 24, 1), steps.chunk("c", 17, 1)])
    # c finishes, a skips a step (the budget), then returns
    bm.free("c")
    steps.run([steps.chunk("b", 17, 1)])
    assert batch.num_rows == 1
    steps.run([steps.chunk("a", 25, 1), steps.chunk("b", 18, 1)])
    # b finishes and a new b (same id) starts over at once: a start that does not advance writes it whole
    bm.free("b")
    steps.outputs["b"] = 0
    full_writes = batch.num_full_writes
    steps.run([steps.chunk("a", 26, 1), steps.chunk("b", 0, 5)])
    assert batch.num_full_writes == full_writes + 1
    # a recomputed after preemption: released, then written whole from its first chunk
    bm.free("a")
    steps.run([steps.chunk("b", 5, 1)], preempted=["a"])
    steps.run([steps.chunk("b", 6, 1), steps.chunk("a", 0, 8, needs_sample=False)])
    steps.run([steps.chunk("b", 7, 1), steps.chunk("a", 8, 20)])
    # the same step run again (the engine isolating a failure) is still right
    chunks = [steps.chunk("b", 8, 1), steps.chunk("a", 28, 1)]
    steps.run(chunks)
    steps.run(chunks[1:])
    steps.run(chunks)


# (start, block table, output tokens before) of a request's chunk in two consecutive steps; block size 4. In each,
# one cheap check alone sees that the second table is not the first one changed as assumption 1 allows.
TABLES_BUILT_ANEW = {
    "a block the chunk writes, not the last": [(0, [10, 11, 12], 0), (5, [10, 21, 12], 1)],
    "the start does not advance": [(12, [10, 11, 12, 13], 5), (8, [10, 21, 12, 13], 6)],
    "the output tokens do not grow": [(12, [10, 11, 12, 13], 5), (14, [10, 21, 12, 13], 0)],
    "the first block": [(12, [10, 11, 12, 13], 5), (13, [30, 11, 12, 13], 6)],
    "the block at the row's old end": [(4, [10, 11], 5), (8, [10, 21, 22], 6)],
    "the block at the trimmed end": [(8, [10, 11, 12, 13], 5), (9, [10, 11, 22], 6)],
}


@pytest.mark.parametrize("case", list(TABLES_BUILT_ANEW))
def test_each_cheap_check_sees_a_table_built_anew(case: str) -> None:
    steps = Steps()
    for start, table, num_output_tokens in TABLES_BUILT_ANEW[case]:
        chunk = ScheduledChunk("a", [1], start, table, True, SamplingParams(), num_output_tokens)
        steps.run([chunk])  # NOTE: the debug check raises if the row missed the change
        assert steps.batch.blocks(steps.batch.row_of("a") or 0) == table


def test_rows_grow_past_the_first_allocation() -> None:
    steps = Steps(block_size=1)
    steps.persistent.input_batch = InputBatch(1, max_rows=2, max_blocks=2, check=True)
    steps.run([steps.chunk(f"r{i}", 0, 3 + i) for i in range(5)])
    steps.run([steps.chunk(f"r{i}", 3 + i, 1) for i in range(5)])
    assert steps.batch.table.shape[0] >= 5 and steps.batch.table.shape[1] >= 8


def test_a_table_changed_against_the_assumptions_is_reported() -> None:
    """A block in the middle of a table replaced between two steps (nothing the block manager does) is not seen by
    the cheap checks; the debug check reports it, and the rows start over."""
    steps = Steps()
    steps.run([steps.chunk("a", 0, 12)])
    table = steps.bm.block_table("a")
    chunk = ScheduledChunk("a", [1], 12, table[:1] + [63] + table[2:] + [62], True, SamplingParams(), 1)
    with pytest.raises(InvariantError, match="input batch"):
        steps.batch.rows([chunk])
    assert steps.batch.num_rows == 0  # started over: the next step writes every row whole
    assert steps.batch.rows([chunk]) == [steps.batch.row_of("a")]


# ------------------------------------------------------------------------------ the real scheduler (echo model)


PROMPTS = ["the cat sat on the mat and the cat sat on the hat", "abcabcabcabcabcabc",
           "no repeats here: 0123456789", "say stop here and stop there, stop!", "xyzxyzxyzxyz" * 3,
           "hello hello hello hello"]

SCENARIOS: dict[str, dict[str, Any]] = {
    "chunked": {"scheduler": {"max_num_batched_tokens": 24, "max_prefill_chunk": 7, "max_num_seqs": 6},
                "cache": {"block_size": 4}},
    "swap": {"scheduler": {"max_num_batched_tokens": 24, "max_prefill_chunk": 8, "max_num_seqs": 6,
                           "preemption_mode": "swap"},
             "cache": {"block_size": 4, "kv_cache_memory": 160, "swap_space": 4096},
             "model": {"name": "echo", "max_model_len": 128}, "length": {"budget_kv": False}},
    "recompute": {"scheduler": {"max_num_batched_tokens": 24, "max_prefill_chunk": 8, "max_num_seqs": 6,
                                "preemption_mode": "recompute"},
                  "cache": {"block_size": 4, "kv_cache_memory": 160},
                  "model": {"name": "echo", "max_model_len": 128}, "length": {"budget_kv": False}},
    "block1": {"cache": {"block_size": 1}},
}


def _echo_engine(scenario: str, speculative: str, overlap: bool = False) -> Engine:
    sections = {"model": {"name": "echo"}, **SCENARIOS[scenario], "speculative": {"method": speculative}}
    if overlap:
        sections["execution"] = {"overlap": "on"}
    return Engine.from_config(EngineConfig.model_validate(sections))


def _generate(engine: Engine, prompts: list[str], **params: Any) -> list[tuple[Any, ...]]:
    outputs = engine.generate(prompts, SamplingParams(**params), progress=False)
    return [(o.finish_reason, o.token_ids, [s.token_ids for s in o.samples or []]) for o in outputs]


@pytest.mark.parametrize("static", [False, True], ids=["forward", "static-decode"])
@pytest.mark.parametrize("speculative", ["off", "auto"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_scheduler_s_steps_give_the_same_inputs_both_ways(scenario: str, speculative: str, static: bool) -> None:
    engine = _echo_engine(scenario, speculative)
    block_size = engine.scheduler.block_manager.block_size
    comparing = Comparing(engine.runner, block_size, static=static, max_num_seqs=engine.scheduler.config.max_num_seqs)
    engine.runner = comparing
    prompts = [p * 2 for p in PROMPTS]
    expected = _generate(_echo_engine(scenario, speculative), prompts, max_tokens=60, ignore_eos=True)
    assert _generate(engine, prompts, max_tokens=60, ignore_eos=True) == expected
    # n > 1: the samples fork from one prompt and copy its last block on write (with the prefix cache's hits)
    assert _generate(engine, PROMPTS[:3], max_tokens=20, n=3, ignore_eos=True) == \
        _generate(_echo_engine(scenario, speculative), PROMPTS[:3], max_tokens=20, n=3, ignore_eos=True)
    # two tokens each: the decode step samples the last one, with no room for a draft, so even where speculation
    # drafts in every other step (how often its cost model lets it is timing's), plain decode steps run here
    assert _generate(engine, PROMPTS, max_tokens=2, ignore_eos=True) == \
        _generate(_echo_engine(scenario, speculative), PROMPTS, max_tokens=2, ignore_eos=True)
    stats = engine.stats()
    batch = comparing.batch
    assert comparing.num_steps > 20 and batch.num_entry_writes > 0 and batch.num_releases > 0
    if scenario in ("swap", "recompute"):
        assert stats.counters.num_preemptions > 0
    if speculative == "auto":
        assert comparing.num_draft_chunks > 0
    if static:
        assert comparing.num_static_steps > 0
    assert stats.num_used_gpu_blocks == 0


def test_the_overlapped_loop_gives_the_same_inputs_both_ways() -> None:
    """Steps planned ahead on the device thread (their tables grown while the step before runs)."""
    engine = _echo_engine("chunked", "off", overlap=True)
    assert engine.overlaps
    comparing = Comparing(engine.runner, engine.scheduler.block_manager.block_size)
    engine.runner = comparing
    expected = _generate(_echo_engine("chunked", "off"), PROMPTS, max_tokens=40, ignore_eos=True)
    assert _generate(engine, PROMPTS, max_tokens=40, ignore_eos=True) == expected
    assert comparing.num_steps > 20
    engine.close()


def test_a_request_id_used_again_at_once_is_written_whole() -> None:
    """A request finishes and a new one with its id (and the same prompt: the prefix cache hands it the same first
    blocks) runs in the very next step."""
    engine = _echo_engine("chunked", "off")
    comparing = Comparing(engine.runner, engine.scheduler.block_manager.block_size)
    engine.runner = comparing
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    prompt = [ord(c) for c in PROMPTS[0]]
    engine.add_request("other", [ord(c) for c in PROMPTS[1]], SamplingParams(max_tokens=200, ignore_eos=True))
    for round_ in range(4):
        engine.add_request("again", prompt if round_ % 2 else prompt[:30], params)
        while not any(o.request_id == "again" and o.finished for o in engine.step()):
            pass
    engine.abort("other")
    while engine.has_unfinished():
        engine.step()
    assert comparing.batch.num_full_writes >= 5
