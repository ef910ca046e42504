"""The verdicts of the one-call GPU check (ops/gpu/check.py), from stage results shaped as a GPU run
leaves them: pytest's verbose lines (read even from a stage killed at its limit), the measuring
stages' JSON (step times that mean one token per step, bandwidth against the device's specification,
partial baselines), stage budgets within the deadline, and one table layout within 20 lines."""

from __future__ import annotations

from typing import Any

from ops.gpu.check import (
    BANDWIDTH_ROW,
    DEADLINE_S,
    LLAMA_DECODE_ROWS,
    SMOLLM2_ROW,
    SPECULATION_ROW,
    STAGE_BUDGETS_S,
    THROUGHPUT_CHILD_S,
    THROUGHPUT_RUN_DEADLINE_S,
    THROUGHPUT_SYSTEMS,
    StageRun,
    Target,
    measured_rows,
    pytest_outcomes,
    pytest_rows,
    table_layout,
)
from ops.gpu.stages import spec_bandwidth

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


def timing(batch: int, step_ms: float, tokens_per_step: float = 1.0, full_steps: int = 30,
           graph_steps: int = 30) -> dict[str, Any]:
    return {"batch": batch, "context": 512, "steps": 30, "full_steps": full_steps, "graph_steps": graph_steps,
            "step_wall_ms": step_ms, "step_event_ms": step_ms - 1, "tokens_per_step": tokens_per_step,
            "tokens_per_s": 1000 * batch * tokens_per_step / step_ms}


def measuring_stages(step_ms: float, graph_steps: int, fraction: float, tokens_per_step: float = 1.0,
                     device: str = "NVIDIA H200", partial: bool = False) -> dict[str, StageRun]:
    specified = spec_bandwidth(device)
    decode = [{**timing(b, 5.0), "fraction_of_spec_bandwidth": fraction if specified else None,
               "fraction_of_copy_bandwidth": fraction + 0.1} for b in (1, 64, 256)]
    static = {"speedup": 6.0, "target": 5.0, "passed": True, "num_requests": 64,
              "partial": ["hf_static16"] if partial else [], "finished_requests": {"tokenmill": 64, "hf_static16": 16}}
    return {
        "smollm2-step": stage("smollm2-step", {
            **timing(64, step_ms, tokens_per_step, graph_steps=graph_steps),
            "speculation": timing(64, step_ms + 1, 2.5, graph_steps=0)}),
        "throughput": stage("throughput", {"summary": {"targets": {
            "hf_static16": static, "hf_cb": {"speedup": 2.5, "target": 3.0, "passed": False, "partial": []}}}}),
        "llama8b": stage("llama8b", {"decode": decode, "prefill": {"tokens": 4096, "tokens_per_s": 2e4},
                                     "device_name": device, "spec_bandwidth_bytes_per_s": specified,
                                     "copy_bandwidth_bytes_per_s": 4.3e12,
                                     "gpu_peak_bytes": 120 << 30, "weights_bytes": 16 << 30}),
    }


def test_measured_rows_are_judged_against_their_targets() -> None:
    rows = by_name(measured_rows(measuring_stages(8.0, 30, 0.75), dry=False))
    assert rows[SMOLLM2_ROW].verdict == "PASS"
    assert rows[SPECULATION_ROW].verdict == "PASS" and rows[SPECULATION_ROW].measured.startswith("2.50 tok/step")
    assert rows["throughput vs HF static batch 16"].verdict == "PASS"
    assert rows["throughput vs transformers CB"].verdict == "FAIL"
    assert rows[BANDWIDTH_ROW].verdict == "PASS"
    assert rows[BANDWIDTH_ROW].measured.startswith("75% / 75% of 4.80 TB/s spec; copy 85% / 85%")
    assert rows["8B GPU memory (max_memory_allocated)"].measured.startswith("120.0 GiB")
    slow = by_name(measured_rows(measuring_stages(12.0, 30, 0.5), dry=False))
    assert slow[SMOLLM2_ROW].verdict == "FAIL"
    assert slow[BANDWIDTH_ROW].verdict == "FAIL"
    eager = by_name(measured_rows(measuring_stages(8.0, 0, 0.75), dry=False))
    assert eager[SMOLLM2_ROW].verdict == "FAIL"  # fast, but no graph replayed
    assert "NO GRAPHS" in eager[SMOLLM2_ROW].measured


def test_a_step_time_with_drafts_in_it_fails() -> None:
    """The step-time row means one token per sequence per step (speculation off), over steps that all ran the whole
    batch: drafts kept or requests gone make it FAIL, however fast."""
    drafted = by_name(measured_rows(measuring_stages(8.0, 30, 0.75, tokens_per_step=1.6), dry=False))
    assert drafted[SMOLLM2_ROW].verdict == "FAIL" and "1.60 tok/step, not 1" in drafted[SMOLLM2_ROW].measured
    stages = measuring_stages(8.0, 30, 0.75)
    stages["llama8b"].result["decode"][1] = {**stages["llama8b"].result["decode"][1], "full_steps": 12}
    rows = by_name(measured_rows(stages, dry=False))
    assert rows[LLAMA_DECODE_ROWS[1]].verdict == "FAIL" and "only 12/30 steps" in rows[LLAMA_DECODE_ROWS[1]].measured


def test_bandwidth_is_judged_against_the_devices_specification_or_the_copy() -> None:
    assert spec_bandwidth("NVIDIA H200") == 4.8e12
    assert spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12  # the SXM part's name
    assert spec_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert spec_bandwidth("NVIDIA A10G") is None
    unknown = by_name(measured_rows(measuring_stages(8.0, 30, 0.65, device="NVIDIA A10G"), dry=False))
    assert unknown[BANDWIDTH_ROW].measured.startswith("75% / 75% of copy (NVIDIA A10G: no spec")
    assert unknown[BANDWIDTH_ROW].verdict == "PASS"  # 75% of the copy
    pcie = by_name(measured_rows(measuring_stages(8.0, 30, 0.65, device="NVIDIA H100 PCIe"), dry=False))
    assert "of 2.00 TB/s spec" in pcie[BANDWIDTH_ROW].measured and pcie[BANDWIDTH_ROW].verdict == "FAIL"


def test_a_partial_baseline_is_judged_and_says_so() -> None:
    rows = by_name(measured_rows(measuring_stages(8.0, 30, 0.75, partial=True), dry=False))
    row = rows["throughput vs HF static batch 16"]
    assert row.verdict == "PASS" and row.measured == "6.00x (partial: hf_static16 16/64)"


def test_every_outcome_prints_the_same_rows_within_twenty_lines() -> None:
    """The table's rows are named the same whatever ran: a GPU run, a failed stage, a skipped one, a dry run."""
    tests = pytest_rows({"pytest-kernels": stage("pytest-kernels", {}), "pytest-parity": stage("pytest-parity", {})},
                        dry=False)
    env = [Target("environment", "", "", "")]
    failed = measuring_stages(8.0, 30, 0.75)
    failed["llama8b"] = StageRun("llama8b", ["python"], exit_code=1)
    skipped = {name: StageRun(name, [], skipped="no CUDA device") for name in ("smollm2-step", "throughput", "llama8b")}
    for stages in (measuring_stages(8.0, 30, 0.75), failed, skipped):
        rows = env + tests + measured_rows(stages, dry=False)
        assert [row.name for row in rows] == table_layout()
    assert {r.verdict for r in measured_rows(failed, dry=False) if r.name.startswith("8B")} == {"FAIL"}
    assert len(table_layout()) + 2 <= 20  # rows + header and rule


def test_the_stage_budgets_fit_the_deadline() -> None:
    """The stages' budgets leave a fifth of the deadline to the rest; in the throughput stage each system's run stops
    well before its process is given up (a static batch begun before may still finish), and the systems' typical
    runs, ending some seconds after their deadlines, fit the stage."""
    assert sum(STAGE_BUDGETS_S.values()) <= 0.8 * DEADLINE_S
    assert set(THROUGHPUT_RUN_DEADLINE_S) == set(THROUGHPUT_SYSTEMS)
    assert all(seconds + 8 <= THROUGHPUT_CHILD_S for seconds in THROUGHPUT_RUN_DEADLINE_S.values())
    assert sum(seconds + 10 for seconds in THROUGHPUT_RUN_DEADLINE_S.values()) <= STAGE_BUDGETS_S["throughput"]
