"""Builders for the bulk tests: input files in every format and readers of the output files."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

NUM_ITEMS = 200


def write_input(path: Path, fmt: str, num_items: int = NUM_ITEMS, model: str = "echo") -> Path:
    """``num_items`` prompts ``item <i>`` with ids ``q<i>``, in ``fmt`` (OpenAI bodies name ``model``)."""
    if fmt == "jsonl":
        lines = [json.dumps({"id": f"q{i}", "prompt": f"item {i}", "max_tokens": 4} if i % 2 else
                            {"id": f"q{i}", "messages": [{"role": "user", "content": f"item {i}"}],
                             "params": {"max_tokens": 4}}) for i in range(num_items)]
        path.write_text("\n".join(lines) + "\n")
    elif fmt == "openai":
        lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": model, "messages": [{"role": "user", "content": f"item {i}"}],
                                      "max_completion_tokens": 4, "temperature": 0}}) for i in range(num_items)]
        path.write_text("\n".join(lines) + "\n")
    elif fmt == "csv":
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["id", "prompt", "max_tokens", "topic"])
            writer.writerows([f"q{i}", f"item {i}", 4, "t"] for i in range(num_items))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": [f"q{i}" for i in range(num_items)], "prompt": [f"item {i}" for i in range(num_items)],
                          "max_tokens": [4] * num_items})
        pq.write_table(table, path)
    else:
        raise ValueError(fmt)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def item_ids(records: list[dict[str, Any]]) -> list[str]:
    return [str(r.get("custom_id", r.get("id"))) for r in records]
