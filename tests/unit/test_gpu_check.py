"""The verdicts of the one-call GPU check (ops/gpu/check.py), from stage results shaped as a GPU run
leaves them: pytest's verbose lines (read even from a stage killed at its limit), the measuring
stages' JSON, and a table that stays within 20 lines."""

from __future__ import annotations

from typing import Any

from ops.gpu.check import StageRun, Target, measured_rows, pytest_outcomes, pytest_rows

VERBOSE = """\
===== pytest-kernels: python -m pytest -v
tests/unit/test_attention_backends.py::test_bfloat16_matches_the_float32_reference[triton-cuda-heads0] PASSED [  1%]
tests/unit/test_attention_backends.py::test_bfloat16_matches_the_float32_reference[reference-cuda-heads0] PASSED [  2%]
tests/unit/test_attention_backends.py::test_split_decode_matches_the_reference[triton-cuda-heads0-dtype0] FAILED [  3%]
tests/unit/test_attention_backends.py::test_block_offsets_past_two_to_the_31[triton-cuda] PASSED [  4%]
tests/unit/test_step_inputs.py::test_every_list_comes_back_as_a_view_of_one_upload[cuda] SKIPPED (x) [  5%]
"""


def stage(name: str, result: dict[str, Any], **fields: Any) -> StageRun:
    return StageRun(name, ["python"], exit_code=0, result=result, **fields)


def by_name(rows: list[Target]) -> dict[str, Target]:
    return {row.name: row for row in rows}


def test_verbose_lines_give_each_test_its_outcome() -> None:
    outcomes = pytest_outcomes(VERBOSE)
    assert list(outcomes.values()) == ["PASSED", "PASSED", "FAILED", "PASSED", "SKIPPED"]
    assert all(test_id.startswith("tests/") and "::" in test_id for test_id in outcomes)


def test_test_groups_pass_fail_or_skip() -> None:
    parity = {"tests/e2e/test_static_decode.py::test_cuda_graphs_are_captured_and_replayed[llama]": "PASSED",
              "tests/e2e/test_parity_tiny.py::test_greedy_matches_hf_generate[llama-block16-cuda-kernel]": "PASSED"}
    rows = by_name(pytest_rows({"pytest-kernels": stage("pytest-kernels", {"tests": pytest_outcomes(VERBOSE)}),
                                "pytest-parity": stage("pytest-parity", {"tests": parity})}, dry=False))
    assert rows["bf16 kernel vs reference (hd 64/128, GQA)"].verdict == "PASS"
    assert rows["Triton split decode vs reference"].verdict == "FAIL"
    assert rows["other CUDA kernel tests (int64 pool, ...)"].verdict == "PASS"
    assert rows["CUDA graphs captured + replayed (tiny)"].verdict == "PASS"
    assert rows["tiny parity fp64, Triton + reference"].verdict == "PASS"
    assert rows["SmolLM2 fp32 random weights vs HF"].verdict == "FAIL"  # none ran: not proven
    cut = pytest_rows({"pytest-kernels": stage("pytest-kernels", {"tests": pytest_outcomes(VERBOSE)}),
                       "pytest-parity": stage("pytest-parity", {"tests": parity}, timed_out=True)}, dry=False)
    assert by_name(cut)["tiny parity fp64, Triton + reference"].verdict == "FAIL"  # a stage cut short proves nothing
    skipped = StageRun("pytest-parity", [], skipped="no CUDA device")
    rows = by_name(pytest_rows({"pytest-kernels": skipped, "pytest-parity": skipped}, dry=False))
    assert {row.verdict for row in rows.values()} == {"SKIP"}


def measuring_stages(step_ms: float, graph_steps: int, fraction: float) -> dict[str, StageRun]:
    decode = [{"batch": b, "context": 512, "tokens_per_s": 100.0 * b, "step_wall_ms": 5.0,
               "fraction_of_copy_bandwidth": fraction} for b in (1, 64, 256)]
    return {
        "smollm2-step": stage("smollm2-step", {"batch": 64, "steps": 30, "graph_steps": graph_steps,
                                               "step_wall_ms": step_ms, "step_event_ms": step_ms - 1}),
        "throughput": stage("throughput", {"summary": {"targets": {
            "hf_static16": {"speedup": 6.0, "target": 5.0, "passed": True},
            "hf_cb": {"speedup": 2.5, "target": 3.0, "passed": False}}}}),
        "llama8b": stage("llama8b", {"decode": decode, "prefill": {"tokens": 4096, "tokens_per_s": 2e4},
                                     "gpu_peak_bytes": 120 << 30, "weights_bytes": 16 << 30}),
    }


def test_measured_targets_are_judged_against_the_issue() -> None:
    rows = by_name(measured_rows(measuring_stages(8.0, 30, 0.75), dry=False))
    assert rows["SmolLM2 bf16 decode step, batch 64"].verdict == "PASS"
    assert rows["throughput vs HF static batch 16"].verdict == "PASS"
    assert rows["throughput vs transformers CB"].verdict == "FAIL"
    assert rows["8B bandwidth fraction, batch 1"].verdict == "PASS"
    assert "8B bandwidth fraction, batch 256" not in rows  # the aim is for batch 1-64
    assert rows["8B GPU memory (max_memory_allocated)"].measured.startswith("120.0 GiB")
    slow = by_name(measured_rows(measuring_stages(12.0, 30, 0.5), dry=False))
    assert slow["SmolLM2 bf16 decode step, batch 64"].verdict == "FAIL"
    assert slow["8B bandwidth fraction, batch 64"].verdict == "FAIL"
    eager = by_name(measured_rows(measuring_stages(8.0, 0, 0.75), dry=False))
    assert eager["SmolLM2 bf16 decode step, batch 64"].verdict == "FAIL"  # fast, but no graph replayed


def test_a_failed_stage_fails_its_rows_and_the_table_fits_twenty_lines() -> None:
    stages = measuring_stages(8.0, 30, 0.75)
    stages["llama8b"] = StageRun("llama8b", ["python"], exit_code=1)
    rows = measured_rows(stages, dry=False)
    assert {r.verdict for r in rows if r.name.startswith("8B")} == {"FAIL"}
    full = measured_rows(measuring_stages(8.0, 30, 0.75), dry=False)
    tests = pytest_rows({"pytest-kernels": stage("pytest-kernels", {}), "pytest-parity": stage("pytest-parity", {})},
                        dry=False)
    assert 1 + len(tests) + len(full) + 2 <= 20  # environment + rows + header and rule
