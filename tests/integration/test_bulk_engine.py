"""A bulk job through the real engine on a tiny random model (built in code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bulk_helpers import item_ids, read_jsonl, write_input
from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import Producer, bulk

pytest.importorskip("torch")


def test_bulk_through_the_real_engine_on_a_tiny_model(tmp_path: Path, redis_url: str, key_prefix: str,
                                                     producer: Producer) -> None:
    from tests.tiny_models import save_tiny_model

    model_dir = save_tiny_model("llama", tmp_path / "tiny")
    settings = make_settings(redis_url, key_prefix, model=str(model_dir), engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "16MiB", "swap_space": "4MiB"}})
    source = write_input(tmp_path / "in.jsonl", "openai", num_items=12, model="tiny")
    out = tmp_path / "out.jsonl"
    with running_worker(settings):
        summary = bulk.run(source, out, producer=producer, max_in_flight=4)
    assert summary.is_complete and summary.num_ok == 12
    lines = read_jsonl(out)
    assert sorted(item_ids(lines)) == sorted(f"q{i}" for i in range(12))
    for line in lines:
        body = line["response"]["body"]
        assert 1 <= body["usage"]["completion_tokens"] <= 4
        assert body["usage"]["prompt_tokens"] > 0
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
