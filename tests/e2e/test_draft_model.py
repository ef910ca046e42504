"""The draft model's proposer (``[engine.speculative] method = "draft"``, engine/spec/draft_model.py) on
tiny random models: batched drafts equal the one-request-at-a-time reference's and a fresh greedy
continuation's, over steps where drafts are kept in part; one forward per draft position for all requests
and one read of the device per call; a cache within its budget however many requests draft (least recent
evicted, the same drafts after); finished and preempted requests give their blocks back; the KV pool made
smaller by the draft model's cache; and the engine's greedy output with a draft model the same as without."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tests.e2e.parity_helpers import random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine import Engine
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.model import model_setup
from tokenmill.engine.model.model_loader import LoadedModel, load_model
from tokenmill.engine.model.model_setup import kv_cache_spec
from tokenmill.engine.spec.draft_model import (
    BLOCK_TOKENS,
    DraftModelProposer,
    SequentialDraftProposer,
    draft_kv_bytes_per_token,
)
from tokenmill.engine.spec.speculator import DraftSpeculator
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def near_draft_dir(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with noise on its weights: a draft model that agrees with it often, not always."""
    source = tiny_model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.03)
    path = tmp_path_factory.mktemp("near-draft")
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def _load(path: Path, dtype: str) -> LoadedModel:
    return load_model(str(path), device="cpu", dtype=dtype, attn_implementation="sdpa")


def _proposer(draft: LoadedModel, cache_tokens: int, **options: Any) -> DraftModelProposer:
    return DraftModelProposer(draft, draft, kv_cache_spec(draft, BLOCK_TOKENS), cache_tokens, **options)


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=1000), 0.0, status=RequestStatus.RUNNING)


@torch.inference_mode()
def _greedy(draft: LoadedModel, token_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The draft model's greedy continuation from scratch (a fresh cache): what every draft must be."""
    cache, feed, out = DynamicCache(), list(token_ids), []
    for _ in range(num_tokens):
        logits = draft.model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
        feed = [out[-1]]
    return out


def _advance(rng: random.Random, request: Request, draft: list[int]) -> None:
    """What verification does to a request: keeps a prefix of the draft, then one more token."""
    kept = rng.randint(0, len(draft))
    request.output_token_ids.extend(draft[:kept] + [rng.randrange(4, VOCAB_SIZE)])


@pytest.mark.parametrize(("family", "dtype"), [("llama", "float64"), ("gpt2", "float64"), ("qwen2", "float32")])
def test_batched_drafts_equal_the_per_request_reference(family: str, dtype: str,
                                                        tiny_model_dirs: dict[str, Path]) -> None:
    """Requests of mixed lengths (some fed alone first: longer than a batched feed), a random subset drafting
    each step with its own length, drafts kept in part: the batched drafts are the per-request path's, and
    the model's greedy continuation from scratch."""
    draft = _load(tiny_model_dirs[family], dtype)
    batched, reference = _proposer(draft, 4096), SequentialDraftProposer(draft, draft)
    rng = random.Random(5)
    requests = [_request(f"r{i}", prompt) for i, prompt in
                enumerate(random_prompts(VOCAB_SIZE, 6, seed=11, min_len=1, max_len=90))]
    num_compared = 0
    for _ in range(7):
        wanted = [(r, r.token_view, rng.randint(1, 6)) for r in requests if rng.random() < 0.8]
        drafts = batched.propose(wanted)
        assert drafts == reference.propose(wanted)
        for request, token_ids, num_tokens in wanted:
            assert drafts[request.request_id] == _greedy(draft, list(token_ids), num_tokens)
            _advance(rng, request, drafts[request.request_id])
            num_compared += 1
    assert num_compared > 25


def test_one_forward_per_draft_position_and_one_read_of_the_device(tiny_model_dirs: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests drafting four tokens each: four forwards of the draft model in all (the reference runs
    thirty-two) and one transfer to the host (the reference, one per token)."""
    draft = _load(tiny_model_dirs["llama"], "float64")
    batched, reference = _proposer(draft, 4096), SequentialDraftProposer(draft, draft)
    requests = [_request(f"r{i}", p) for i, p in enumerate(random_prompts(VOCAB_SIZE, 8, seed=2, max_len=8))]
    wanted = [(r, r.token_view, 4) for r in requests]
    batched.propose(wanted)
    reference.propose(wanted)
    for request in requests:
        request.output_token_ids.append(7)
    forwards, reads = [0], [0]
    forward = draft.model.forward
    monkeypatch.setattr(draft.model, "forward", lambda *a, **kw: (forwards.__setitem__(0, forwards[0] + 1),
                                                                    forward(*a, **kw))[1])
    for name in ("tolist", "item", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, **kw: (
            reads.__setitem__(0, reads[0] + 1), _o(self, *a, **kw))[1])
    drafts = batched.propose(wanted)
    assert (forwards[0], reads[0]) == (4, 1)
    forwards[0] = reads[0] = 0
    assert reference.propose(wanted) == drafts
    assert (forwards[0], reads[0]) == (32, 32)


def test_the_cache_stays_within_its_budget_with_many_requests(tiny_model_dirs: dict[str, Path]) -> None:
    """Forty requests, four drafting at a time, through a cache of 256 tokens: it never holds more, the least
    recently drafted go, and an evicted request drafts the same tokens after (it re-feeds its own)."""
    draft = _load(tiny_model_dirs["llama"], "float64")
    proposer = _proposer(draft, 256)
    assert proposer.num_blocks * BLOCK_TOKENS == 256
    rng = random.Random(9)
    requests = [_request(f"r{i}", p) for i, p in enumerate(random_prompts(VOCAB_SIZE, 40, seed=4, max_len=24))]
    for _ in range(12):
        wanted = [(r, r.token_view, 4) for r in rng.sample(requests, 4)]
        drafts = proposer.propose(wanted)
        assert proposer.num_used_blocks <= proposer.num_blocks
        assert proposer.num_cached_tokens <= 256
        for request, token_ids, num_tokens in wanted:
            assert drafts[request.request_id] == _greedy(draft, list(token_ids), num_tokens)
            _advance(rng, request, drafts[request.request_id])
    assert proposer.num_evictions > 0


def test_finished_and_preempted_requests_give_their_blocks_back(tiny_model_dirs: dict[str, Path]) -> None:
    draft = _load(tiny_model_dirs["llama"], "float64")
    proposer = _proposer(draft, 1024)
    done, preempted, running = (_request(f"r{i}", [5 + i] * 20) for i in range(3))
    proposer.propose([(r, r.token_view, 4) for r in (done, preempted, running)])
    assert proposer.num_cached_requests == 3
    used = proposer.num_used_blocks
    done.status = RequestStatus.FINISHED_ABORTED
    proposer.finished(done)
    assert proposer.num_cached_requests == 2 and proposer.num_used_blocks == used - 2  # 23 tokens: 2 blocks
    preempted.status = RequestStatus.SWAPPED
    proposer.propose([(running, running.token_view, 4)])
    assert proposer.num_cached_requests == 1 and proposer.num_used_blocks == 2
    proposer.finished(running)
    assert proposer.num_cached_requests == 0 and proposer.num_used_blocks == 0


def _speculator(engine: Engine) -> tuple[DraftSpeculator, DraftModelProposer]:
    speculator = engine.scheduler.speculator
    assert isinstance(speculator, DraftSpeculator)
    [proposer] = [p for p in speculator.proposers if isinstance(p, DraftModelProposer)]
    speculator.min_acceptance = 0.0  # keep drafting where the draft model is often wrong
    return speculator, proposer


@pytest.mark.parametrize("scenario", ["default", "tight-recompute", "tight-swap"])
def test_greedy_output_with_a_draft_model_is_the_output_without(scenario: str, tiny_model_dirs: dict[str, Path],
                                                                near_draft_dir: Path) -> None:
    """A draft model that agrees with the target in part: the engine's greedy tokens are those of method
    "off", token for token, drafts kept and rejected; under a tight KV budget (preemptions, and the draft
    model's cache, as many tokens as the pool, evicting) as well; every block given back at the end."""
    path = tiny_model_dirs["llama"]
    prompts = random_prompts(VOCAB_SIZE, 8, seed=21, max_len=60)
    settings: dict[str, Any] = dict(device="cpu", dtype="float64", block_size=4)
    if scenario != "default":
        per_token = 2 * 2 * 2 * 16 * 8  # layers x (k, v) x kv heads x head dim x float64
        settings.update(kv_cache_memory=2 * (max(map(len, prompts)) + MAX_TOKENS + 16) * per_token,
                        preemption_mode=scenario.removeprefix("tight-"), swap_space="8MiB", budget_kv=False,
                        max_prefill_chunk=32, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain = build_engine(str(path), method="off", **settings)
    want = [o.token_ids for o in plain.generate(prompts, params, progress=False)]
    engine = build_engine(str(path), method="draft", draft_model=str(near_draft_dir), **settings)
    speculator, proposer = _speculator(engine)
    got = [o.token_ids for o in engine.generate(prompts, params, progress=False)]
    assert got == want
    counters = speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.draft_tokens_by_proposer.get("draft", 0) > 0
    if scenario != "default":
        assert engine.stats().counters.num_preemptions > 0
    assert proposer.num_cached_requests == 0 and proposer.num_used_blocks == 0


def test_the_kv_pool_makes_room_for_the_draft_models_cache(tiny_model_dirs: dict[str, Path],
                                                           near_draft_dir: Path) -> None:
    """The KV budget holds both models' caches token for token: the engine's pool is smaller by the draft
    model's share, and the draft model's cache holds as many tokens as the pool (within the budget)."""
    path = tiny_model_dirs["llama"]
    budget = 1 << 20
    settings: dict[str, Any] = dict(device="cpu", dtype="float64", block_size=4, kv_cache_memory=budget)
    plain = build_engine(str(path), method="off", **settings)
    engine = build_engine(str(path), method="draft", draft_model=str(near_draft_dir), **settings)
    _, proposer = _speculator(engine)
    draft_token_bytes = draft_kv_bytes_per_token(kv_cache_spec(proposer.draft, BLOCK_TOKENS))
    block_bytes = engine.limits.kv_block_bytes
    blocks, plain_blocks = engine.stats().num_gpu_blocks, plain.stats().num_gpu_blocks
    assert plain_blocks == budget // block_bytes
    assert blocks == budget // (block_bytes + 4 * draft_token_bytes) < plain_blocks
    assert proposer.num_blocks == blocks * 4 // BLOCK_TOKENS
    assert blocks * block_bytes + proposer.num_blocks * BLOCK_TOKENS * draft_token_bytes <= budget


def test_the_draft_model_loads_before_the_kv_pool_is_sized(tiny_model_dirs: dict[str, Path], near_draft_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the pool is what free memory allows once the weights are in: the draft model's must be in by then,
    and its cache counted in the sizing."""
    events: list[Any] = []
    load, size = model_setup.load_model, model_setup.size_kv_cache
    monkeypatch.setattr(model_setup, "load_model", lambda name, **kw: (events.append(("load", name)),
                                                                        load(name, **kw))[1])

    def sized(*args: Any, **kwargs: Any) -> tuple[int, int]:
        events.append(("size", args[4:] or tuple(kwargs.values())))
        return size(*args, **kwargs)

    monkeypatch.setattr(model_setup, "size_kv_cache", sized)
    build_engine(str(tiny_model_dirs["llama"]), method="draft", draft_model=str(near_draft_dir), device="cpu",
                 dtype="float64", kv_cache_memory=1 << 20)
    assert [event[0] for event in events] == ["load", "load", "size"]
    assert events[1] == ("load", str(near_draft_dir))
    draft_token_bytes, reserved_bytes = events[2][1]
    assert draft_token_bytes == 2 * 2 * 2 * 16 * 8 and reserved_bytes > 0
