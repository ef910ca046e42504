"""What a user reads of an n > 1 request, on every path: each sample's text is the decode
of its own token ids — never its siblings' texts glued together — through the Producer, a bulk job,
the HTTP chat endpoint and the Batches API, all against one worker on a tiny random model. Sample i
is seeded seed + i, so every path must return the very same texts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.processes import scaled_s
from tests.serve_helpers import run_openai_batch, running_server
from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import Producer, bulk

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Pick a color"}]
PARAMS: dict[str, Any] = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}


def _chat_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, **PARAMS}


def test_every_path_returns_each_sample_as_the_decode_of_its_tokens(
        tmp_path: Path, redis_url: str, key_prefix: str, tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["llama"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = make_settings(redis_url, key_prefix, model=str(model_dir), engine={
        "model": {"device": "cpu", "max_model_len": 256}, "cache": {"kv_cache_memory": "8MiB", "swap_space": 0}})
    served = settings.served_model_name
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "q0", "method": "POST", "url": "/v1/chat/completions",
                                  "body": _chat_body(served)}) + "\n")
    with running_worker(settings), Producer(redis_url, prefix=key_prefix) as producer, \
            running_server(redis_url, key_prefix) as url, openai.OpenAI(base_url=url, api_key="none") as client:
        result = producer.result(producer.submit(messages=MESSAGES, **PARAMS), timeout=scaled_s(60))
        summary = bulk.run(source, tmp_path / "out.jsonl", producer=producer)
        chat = client.chat.completions.create(model=served, messages=MESSAGES, n=3, temperature=1.0, seed=7,
                                              max_tokens=12, extra_body={"ignore_eos": True})
        batch_body = _run_batch(client, served)

    assert result.ok and result.samples is not None and len(result.samples) == 3
    texts = [sample.text for sample in result.samples]
    for sample in result.samples:
        assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True,
                                               clean_up_tokenization_spaces=False)
    assert len(set(texts)) > 1, "three different samples, or the test shows nothing"
    assert result.text == texts[0]

    assert summary.is_complete and summary.num_ok == 1
    [line] = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [c["message"]["content"] for c in line["response"]["body"]["choices"]] == texts

    assert [choice.message.content for choice in sorted(chat.choices, key=lambda c: c.index)] == texts
    assert [c["message"]["content"] for c in batch_body["choices"]] == texts


def _run_batch(client: openai.OpenAI, model: str) -> dict[str, Any]:
    line = {"custom_id": "b0", "method": "POST", "url": "/v1/chat/completions", "body": _chat_body(model)}
    [output] = run_openai_batch(client, [line], timeout_s=120, poll_s=0.2)
    body: dict[str, Any] = output["response"]["body"]
    return body
