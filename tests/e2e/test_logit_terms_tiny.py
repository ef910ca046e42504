"""Attention terms the kernels lack, honoured through engine/model/hf_attention.py's own path: logit soft-capping
(a Gemma-2-style tiny model, ``attn_logit_softcapping``) and attention sinks (a gpt-oss-style tiny model, one logit
per head in each softmax denominator). The engine's tokens and logprobs equal Hugging Face's eager attention's, with
either backend writing the cache, over chunked prefills beside decodes; each test first checks that the term moves
the logprobs far more than the tolerance (so dropping it fails). The path's decode rows give the same output from a
captured step's metadata (no host context lengths, the table's whole width) as from an eager step's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig

from tests.e2e.parity_helpers import assert_parity, hf_greedy, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import build_tokenizer
from tokenmill.engine.kernels.attention import AttentionMetadata
from tokenmill.engine.kernels.attention.reference import ReferenceBackend
from tokenmill.engine.model.hf_attention import attend_with_logit_terms
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
TOLERANCE = 1e-4  # float32 logprobs of the same forward in another order


def _config(kind: str, vocab_size: int, eos_token_id: int) -> Any:
    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=0,
                                  hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16)
    if kind == "softcap":
        return Gemma2Config(intermediate_size=128, attn_logit_softcapping=0.5, final_logit_softcapping=30.0,
                            query_pre_attn_scalar=16, max_position_embeddings=1024, sliding_window=512, **common)
    return GptOssConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=256,
                        **common)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A float32 tiny model of each kind (gpt-oss's experts have no float64 kernel), weights scaled up as in
    tests/tiny_models.py so that the terms matter; the sinks large enough to take a share of each row."""
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    paths = {}
    for kind in ("softcap", "sinks"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(kind, len(tokenizer), eos), dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.2)
                elif name.endswith("sinks"):
                    param.normal_(0.0, 2.0)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        paths[kind] = path
    return paths


def _logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The reference's logprob of each of ``tokens`` after ``prompt`` and the tokens before it."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return [rows[i, token].item() for i, token in enumerate(tokens)]


def _without_the_term(kind: str, path: Path) -> torch.nn.Module:
    """The reference with the term taken out: what an engine that dropped it would compute."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if kind == "softcap":
                layer.self_attn.attn_logit_softcapping = None
            else:
                layer.self_attn.sinks.fill_(float("-inf"))
    return model


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["softcap", "sinks"])
def test_the_engine_matches_hf_eager_attention(kind: str, backend: str, models: dict[str, Path]) -> None:
    path = models[kind]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts(reference.config.vocab_size, 4, seed=1, max_len=40)
    engine = build_engine(str(path), device="cpu", dtype="float32", kv_cache_memory="8MiB", block_size=4,
                          max_prefill_chunk=7, max_num_batched_tokens=16, attention_backend=backend)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                                  progress=False)
    finally:
        engine.close()
    dropped = _without_the_term(kind, path)
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        assert_parity(output.token_ids, hf_greedy(reference, prompt, MAX_TOKENS), prompt, reference)
        got = [entry.logprob for entry in output.token_logprobs or []]
        want = _logprobs(reference, prompt, output.token_ids)
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOLERANCE
        assert max(abs(g - w) for g, w in zip(got, _logprobs(dropped, prompt, output.token_ids))) > 100 * TOLERANCE


@pytest.mark.parametrize(("softcap", "with_sinks"), [(0.5, False), (None, True), (None, False)])
def test_decode_rows_replay_from_a_captured_steps_metadata(softcap: float | None, with_sinks: bool) -> None:
    """A captured decode step's metadata has no host context lengths and the table's whole width as its longest
    context: the decode rows read the device's lengths and give what an eager step's metadata gives; with neither
    term the path is plain attention, the reference backend's."""
    torch.manual_seed(3)
    num_blocks, block_size, kv_heads, heads, dim, width = 32, 4, 2, 4, 8, 6
    keys, values = (torch.randn(num_blocks, block_size, kv_heads, dim) for _ in range(2))
    query = torch.randn(3, heads, dim)
    contexts = [13, 7, 2]
    tables = torch.randperm(num_blocks)[:3 * width].view(3, width).to(torch.int32)
    sinks = torch.randn(heads) if with_sinks else None

    def meta(eager: bool) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=tables,
            seq_lens=torch.tensor(contexts, dtype=torch.int32),
            query_start_loc=torch.arange(4, dtype=torch.int32), num_decodes=3,
            max_seq_len=max(contexts) if eager else width * block_size, max_query_len=1,
            seq_lens_host=contexts if eager else [], query_start_host=[0, 1, 2, 3])

    eager = attend_with_logit_terms(query, keys, values, meta(True), 0.3, softcap, sinks)
    captured = attend_with_logit_terms(query, keys, values, meta(False), 0.3, softcap, sinks)
    torch.testing.assert_close(captured, eager, rtol=1e-6, atol=1e-6)
    if softcap is None and not with_sinks:
        torch.testing.assert_close(eager, ReferenceBackend().attend(query, keys, values, meta(True), 0.3),
                                   rtol=1e-5, atol=1e-6)
