"""The fleet cache on tiny models: a second engine (a second worker, or one restarted cold) takes the prompt
blocks a first one computed from the shared block store, and its greedy outputs stay token-identical to
Hugging Face ``generate``; a failing, slow or foreign store only costs recomputation, counted; a bad block in
the store (another prompt's, another namespace's, corrupted, values no model computes) is rejected, counted,
discarded and computed; a fine-tune gets a namespace of its own."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.doubles import LocalBlockStore
from tests.e2e.parity_helpers import hf_greedy, load_reference, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine.kv.block_store import ENVELOPE_HEADER, block_digests, seal, unseal
from tokenmill.engine.model.model_loader import load_model
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PREFIX_TOKENS = 64

SCENARIOS: dict[str, dict[str, Any]] = {
    "block16": dict(block_size=16),
    "block4-chunked": dict(block_size=4, max_prefill_chunk=7, max_num_batched_tokens=64),
    "swap-preemption": dict(block_size=4, preemption_mode="swap", max_prefill_chunk=32, max_num_batched_tokens=64,
                            kv_cache_memory=None),
}


def _prompts(seed: int = 5) -> list[list[int]]:
    """Eight prompts behind one shared 64-token prefix (a system prompt), of different tails."""
    shared = random_prompts(VOCAB_SIZE, 1, seed=99, min_len=PREFIX_TOKENS, max_len=PREFIX_TOKENS)[0]
    return [shared + tail for tail in random_prompts(VOCAB_SIZE, 8, seed=seed, min_len=3, max_len=30)]


def _engine(path: Path, store: Any, **settings: Any) -> Any:
    options: dict[str, Any] = dict(device="cpu", dtype="float64", kv_cache_memory="8MiB", swap_space="8MiB",
                                   min_blocks=1)
    options.update(settings)
    if options.get("kv_cache_memory") is None:
        options["kv_cache_memory"] = _tight_pool(path)
    return build_engine(str(path), block_store=store, **options)


def _tight_pool(path: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    bytes_per_token = config.num_hidden_layers * 2 * num_kv_heads * head_dim * 8
    return (PREFIX_TOKENS + 30 + MAX_TOKENS + 16) * 3 * bytes_per_token


def _greedy(engine: Any, prompts: Sequence[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_second_engine_fetches_the_prefix_and_matches_hf(family: str, scenario: str,
                                                        tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs[family]
    prompts = _prompts()
    reference = load_reference(path, __import__("torch").float64, "cpu")
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    store = LocalBlockStore()
    first = _engine(path, store, **SCENARIOS[scenario])
    assert _greedy(first, prompts) == expected
    assert first.fleet is not None and first.fleet.flush(timeout_s=10)
    published = first.stats().fleet
    assert published.num_published_blocks > 0 and len(store) == published.num_published_blocks
    assert published.num_hits == 0  # the first engine found nothing to fetch

    second = _engine(path, store, **SCENARIOS[scenario])
    assert _greedy(second, prompts) == expected
    fleet = second.stats().fleet
    assert fleet.num_hits >= 1 and fleet.num_hit_blocks >= PREFIX_TOKENS // SCENARIOS[scenario]["block_size"] - 1
    assert fleet.num_fetched_bytes == fleet.num_fetched_blocks * second.limits.kv_block_bytes
    assert fleet.num_fetched_blocks == fleet.num_hit_blocks  # requests sharing the prefix fetched it once
    assert fleet.num_fallbacks == 0, fleet.fallbacks
    # The second engine computed fewer prompt tokens: the fetched blocks were prefix-cache hits.
    assert second.stats().prefix.num_hit_tokens > first.stats().prefix.num_hit_tokens
    assert not second.has_unfinished() and second.stats().num_used_gpu_blocks == 0


def test_parallel_samples_and_prefix_hits_after_a_fetch(tiny_model_dirs: dict[str, Path]) -> None:
    """n > 1 samples share the fetched blocks copy-on-write; seeded samples are the same with the cache on and off."""
    path = tiny_model_dirs["llama"]
    prompts = _prompts(seed=8)[:3]
    params = SamplingParams(max_tokens=MAX_TOKENS, n=3, temperature=0.9, seed=11)
    local = build_engine(str(path), device="cpu", dtype="float64", kv_cache_memory="8MiB", block_size=4)
    expected = [[s.token_ids for s in out.samples] for out in local.generate(prompts, params, progress=False)]
    store = LocalBlockStore()
    _engine(path, store, block_size=4).generate(prompts, params, progress=False)
    second = _engine(path, store, block_size=4)
    got = [[s.token_ids for s in out.samples] for out in second.generate(prompts, params, progress=False)]
    assert got == expected
    assert second.stats().fleet.num_hit_blocks > 0


def test_foreign_blocks_never_match(tiny_model_dirs: dict[str, Path]) -> None:
    """Blocks of another model, dtype or block size live under another namespace: never fetched."""
    store = LocalBlockStore()
    prompts = _prompts()
    _greedy(_engine(tiny_model_dirs["llama"], store, block_size=4), prompts)
    for family, settings in (("gpt2", dict(block_size=4)), ("llama", dict(block_size=8)),
                             ("llama", dict(block_size=4, dtype="float32"))):
        other = _engine(tiny_model_dirs[family], store, **settings)
        _greedy(other, prompts)
        assert other.stats().fleet.num_hits == 0, (family, settings)


class _FailingStore(LocalBlockStore):
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        raise ConnectionError("store down")

    def put(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> None:
        raise ConnectionError("store down")


class _SlowStore(LocalBlockStore):
    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        time.sleep(1.0)
        return super().get(keys)


def test_a_failing_store_costs_recomputation_counted(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    prompts = _prompts()
    expected = _greedy(build_engine(str(path), device="cpu", dtype="float64", kv_cache_memory="8MiB"), prompts)
    engine = _engine(path, _FailingStore())
    assert _greedy(engine, prompts) == expected
    engine.fleet.flush(timeout_s=10)
    fleet = engine.stats().fleet
    assert fleet.fallbacks["error"] >= 1 and fleet.num_publish_errors >= 1 and fleet.num_hits == 0


def test_a_slow_fetch_is_given_up_and_counted(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    prompts = _prompts()[:2]
    store = _SlowStore()
    expected = _greedy(_engine(path, store), prompts)
    engine = _engine(path, store, max_wait_s=0.1)
    assert _greedy(engine, prompts) == expected
    fleet = engine.stats().fleet
    assert fleet.fallbacks["timeout"] >= 1 and fleet.fallback_blocks > 0


@pytest.mark.parametrize("publish", ["reused", "all"])
def test_what_is_published_unique_prompts_travel_only_with_publish_all(
        publish: str, tiny_model_dirs: dict[str, Path]) -> None:
    """``reused`` publishes a prompt's blocks once a second request uses them (shared prefixes), never a unique
    document's; ``all`` publishes every full prompt block."""
    path = tiny_model_dirs["llama"]
    store = LocalBlockStore()
    engine = _engine(path, store, block_size=16, publish=publish)
    unique = random_prompts(VOCAB_SIZE, 1, seed=7, min_len=70, max_len=70)[0]  # four full blocks
    _greedy(engine, [unique])
    assert engine.fleet is not None and engine.fleet.flush(timeout_s=10)
    assert engine.stats().fleet.num_published_blocks == (4 if publish == "all" else 0)
    _greedy(engine, [unique[:40] + [1, 2, 3]])  # its first two blocks used again
    assert engine.fleet.flush(timeout_s=10)
    assert engine.stats().fleet.num_published_blocks == (4 if publish == "all" else 2)
    assert len(store) == engine.stats().fleet.num_published_blocks


def test_a_prefill_worker_publishes_every_prompt_block(tiny_model_dirs: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.worker.runtime as runtime
    from tokenmill.worker.config import Settings

    store = LocalBlockStore()
    monkeypatch.setattr(runtime, "redis_block_store", lambda *args, **kwargs: store)
    settings = Settings.model_validate({"engine": {"model": {"name": str(tiny_model_dirs["llama"]), "device": "cpu"},
                                                   "fleet_cache": {"enabled": True}},
                                        "worker": {"role": "prefill"}})
    assert settings.engine.fleet_cache.publish == "reused"  # the default, overridden for a prefill worker
    engine = runtime.build_engine(settings, client=object())  # type: ignore[arg-type]
    _greedy(engine, [random_prompts(VOCAB_SIZE, 1, seed=7, min_len=70, max_len=70)[0]])
    assert engine.fleet is not None and engine.fleet.flush(timeout_s=10)
    assert engine.stats().fleet.num_published_blocks == 4
    engine.close()


@pytest.fixture(scope="module")
def finetuned_llama(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with one k_proj weight changed (its last value: past any prefix of the tensor), as a
    fine-tune that touched only k_proj would be."""
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("finetuned") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], target)
    weights = load_file(target / "model.safetensors")
    weights["model.layers.1.self_attn.k_proj.weight"][-1, -1] += 0.5
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_checkpoints_differing_only_in_k_proj_get_different_fingerprints(
        dtype: str, tiny_model_dirs: dict[str, Path], finetuned_llama: Path) -> None:
    """float32 packs the CPU's linear layers (they keep no plain weight); float64 does not."""
    base, tuned = (load_model(str(path), device="cpu", dtype=dtype, attn_implementation="sdpa",
                              fingerprint_weights=True) for path in (tiny_model_dirs["llama"], finetuned_llama))
    assert base.weights_fingerprint is not None and tuned.weights_fingerprint is not None
    assert base.weights_fingerprint != tuned.weights_fingerprint
    again = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype=dtype, attn_implementation="sdpa",
                       fingerprint_weights=True)
    assert again.weights_fingerprint == base.weights_fingerprint  # the same weights, the same fingerprint
    is_packed = not any(name.endswith("k_proj.weight") for name, _ in base.model.named_parameters())
    assert is_packed == (dtype == "float32" and _packs_float32())
    assert load_model(str(finetuned_llama), device="cpu", dtype=dtype,
                      attn_implementation="sdpa").weights_fingerprint is None  # only when asked for


def _packs_float32() -> bool:
    from tokenmill.engine.kernels.cpu_linear import kernel_for

    return kernel_for(torch.float32, "auto") is not None


def test_a_finetune_never_fetches_its_base_models_blocks(tiny_model_dirs: dict[str, Path],
                                                         finetuned_llama: Path) -> None:
    prompts = _prompts()[:4]
    expected = _greedy(build_engine(str(finetuned_llama), device="cpu", dtype="float32", kv_cache_memory="8MiB"),
                       prompts)
    store = LocalBlockStore()
    base = _engine(tiny_model_dirs["llama"], store, dtype="float32", publish="all")
    _greedy(base, prompts)
    assert base.fleet is not None and base.fleet.flush(timeout_s=10) and len(store) > 0
    tuned = _engine(finetuned_llama, store, dtype="float32", publish="all")
    assert tuned.fleet is not None and tuned.fleet.root != base.fleet.root
    assert _greedy(tuned, prompts) == expected
    assert tuned.stats().fleet.num_hits == 0


# How the store's value is tampered with -> the reason the engine logs.
TAMPERINGS = {"another_prompt": "sealed for another address", "another_namespace": "sealed for another address",
              "huge_values": "beyond any real key or value", "nan_values": "non-finite values",
              "corrupted": "does not match its digest", "unsealed": "bytes, not the"}


@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_a_bad_block_is_rejected_counted_discarded_and_computed(
        tampering: str, tiny_model_dirs: dict[str, Path], finetuned_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's value of the shared prefix's second block is replaced: the engine loads the first block,
    computes the second and the ones after it, answers token for token as without the fleet cache, and
    publishes the block it computed in place of the bad one."""
    path = tiny_model_dirs["llama"]
    prompts = _prompts()
    unrelated = random_prompts(VOCAB_SIZE, 1, seed=3, min_len=40, max_len=40)
    expected = _greedy(build_engine(str(path), device="cpu", dtype="float64", kv_cache_memory="8MiB"), prompts)
    store = LocalBlockStore()
    first = _engine(path, store, block_size=16, publish="all")
    _greedy(first, prompts + unrelated)
    assert first.fleet is not None and first.fleet.flush(timeout_s=10)
    block_bytes = first.limits.kv_block_bytes
    keys = block_digests(first.fleet.root, prompts[0], 16)
    target = keys[1]
    good = store.get([target])[0]
    assert good is not None
    payload = bytes(unseal(target, good, block_bytes))  # what the first engine published: a sealed block
    if tampering == "another_prompt":  # a valid block, of another prompt, under this prompt's address
        bad = store.get(block_digests(first.fleet.root, unrelated[0], 16)[:1])[0]
    elif tampering == "another_namespace":  # the same prompt's block as a fine-tune of the model computed it
        tuned = _engine(finetuned_llama, store, block_size=16, publish="all")
        _greedy(tuned, prompts[:1])
        assert tuned.fleet is not None and tuned.fleet.flush(timeout_s=10)
        bad = store.get([block_digests(tuned.fleet.root, prompts[0], 16)[1]])[0]
    elif tampering == "huge_values":  # sealed as a worker would: only the values give it away
        bad = seal(target, torch.full((block_bytes // 8,), 1e30, dtype=torch.float64).numpy().tobytes())
    elif tampering == "nan_values":
        values = torch.frombuffer(bytearray(payload), dtype=torch.float64).clone()
        values[5] = float("nan")
        bad = seal(target, values.numpy().tobytes())
    elif tampering == "corrupted":  # one bit flipped in the store
        flipped = bytearray(good)
        flipped[ENVELOPE_HEADER.size + 100] ^= 0x10
        bad = bytes(flipped)
    else:  # the raw payload, as blocks were stored before the envelope
        bad = payload
    assert bad is not None and bad != good
    store.discard([target])
    store.put([target], [bad])

    second = _engine(path, store, block_size=16, publish="all")
    with caplog.at_level("WARNING", logger="tokenmill.engine.core.fleet_cache"):
        assert _greedy(second, prompts) == expected
    rejections = [r for r in caplog.records if getattr(r, "event", None) == "fleet_block_rejected"]
    assert len(rejections) == 1 and TAMPERINGS[tampering] in rejections[0].getMessage()
    assert getattr(rejections[0], "digest", None) == target.hex()
    fleet = second.stats().fleet
    assert fleet.num_rejected_blocks == 1, fleet
    assert fleet.fallbacks["rejected"] >= 1 and fleet.fallback_blocks >= PREFIX_TOKENS // 16 - 1, fleet
    assert fleet.num_hit_blocks >= 1  # the first block, before the bad one, was loaded
    assert second.fleet is not None and second.fleet.flush(timeout_s=10)
    replaced = store.get([target])[0]  # the block computed in place of the bad one, published
    assert replaced is not None and replaced != bad
    assert second.runner.kv_cache.check_blocks([unseal(target, replaced, block_bytes)]) == [None]
