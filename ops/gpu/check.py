"""The GPU check in one run (ops/gpu/check.sh calls it): what is missing first, then every stage in a
process of its own under a time limit, all inside one deadline (9 minutes on an H200), then one
table of targets with PASS / FAIL / SKIP and one JSON report.

    python ops/gpu/check.py --out DIR [--model-files .gpu/smollm2] [--dry]

Stages, in order of what a short run should not lose:

    env             torch / CUDA / versions, and the modules the engine and tests need
    pytest-kernels  Triton and reference attention on CUDA: bfloat16 at head_dim 64/128, GQA, ragged
                    contexts, split decodes, a pool past 2^31 elements (-m gpu)
    pytest-parity   greedy parity on CUDA: tiny models in float64 (Triton and reference, CUDA graphs
                    captured and replayed) and SmolLM2's shape with random weights in float32
    smollm2-step    SmolLM2 bfloat16 decode step at batch 64, speculation off: Engine.step wall clock and
                    CUDA events, one token per sequence per step; then speculation on, a row of its own
    llama8b         an 8B-shaped Llama, speculation off: decode tok/s, prefill tok/s, the fraction of the
                    device's specified HBM bandwidth (and of a measured copy), memory
    throughput      ops/bench/throughput.py against HF static batching and transformers' CB, speculation
                    off (HF never speculates); each system time-boxed to a partial figure

Time: the stages' budgets (:data:`STAGE_BUDGETS_S`) add to at most 80% of the deadline, the rest left to the
environment probe, start-ups and the report; a stage gets the smaller of its budget and what is left. In the
throughput stage each system stops its timed run at a deadline of its own and reports tokens/s of what it made
(``--run-deadline-s``; marked partial in the table) rather than be killed with no figure, and the benchmark
writes its JSON after each system, which this script reads even from a stage cut short.

``--dry`` runs the same stages on the CPU at tiny shapes (pytest only collects) and prints the same table, row
for row (:func:`table_layout`): CI runs it, so the script keeps working between the rare runs on a GPU.
Standard library only; stages import torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from ops.gpu.models import SMOLLM2_FILES, export_smollm2_files
from ops.gpu.stages import LLAMA_PLAN, SMOLLM2_PLAN

DEADLINE_S = 510.0  # every stage ends by then (the device call allows 9 minutes; installing wheels comes first)
# Seconds each stage may run, in running order: together at most 80% of the deadline (a test checks).
# NOTE: guesses until a GPU run times the stages (ops/gpu has not run since the CUDA path was rebuilt).
STAGE_BUDGETS_S = {"pytest-kernels": 65.0, "pytest-parity": 105.0, "smollm2-step": 55.0, "llama8b": 55.0,
                   "throughput": 128.0}
# The throughput stage's systems, each in a process given up after THROUGHPUT_CHILD_S; each stops its timed run
# at its deadline after its process started (a partial figure), leaving time to finish a static batch begun
# before it and exit with its result. tokenmill, the numerator of every ratio, gets the longest: a continuous
# batcher's early seconds are mostly prefill, so a short partial run of it would understate it.
THROUGHPUT_SYSTEMS = ("tokenmill", "hf_static16", "hf_cb")
THROUGHPUT_CHILD_S = 50.0
THROUGHPUT_RUN_DEADLINE_S = {"tokenmill": 42.0, "hf_static16": 22.0, "hf_cb": 24.0}
# Importable modules the engine, its tests and the benchmarks need, and what each is for.
NEEDED_MODULES = {
    "torch": "the engine", "transformers": "the models", "triton": "the CUDA attention kernel",
    "tokenizers": "SmolLM2's tokenizer", "safetensors": "transformers", "accelerate": "transformers' loading",
    "pydantic": "engine config", "pydantic_settings": "worker config (imported by tests)", "redis": "tests' conftest",
    "msgpack": "the wire format", "pytest": "the test stages", "pytest_timeout": "pytest's timeout setting",
}
# The table's rows of test results: (target, stage, pattern of the test ids it counts); a test counts
# in the first row of its stage whose pattern it matches.
TEST_TARGETS = [
    ("bf16 kernel vs reference (hd 64/128, GQA)", "pytest-kernels", r"::test_bfloat16_"),
    ("Triton split decode vs reference", "pytest-kernels", r"::test_(split_decode|static_decode_width)"),
    ("other CUDA kernel tests (int64 pool, ...)", "pytest-kernels", r"."),
    ("CUDA graphs captured + replayed (tiny)", "pytest-parity", r"::test_cuda_graphs_are_captured"),
    ("tiny parity fp64, Triton + reference", "pytest-parity", r"test_parity_tiny\.py"),
    ("SmolLM2 fp32 random weights vs HF", "pytest-parity", r"test_parity_random_smollm2\.py"),
    ("speculative drafts (Triton, graphs between) vs HF", "pytest-parity", r"test_speculation_tiny\.py"),
]
KERNEL_TESTS = ["tests/unit/test_attention_backends.py", "tests/unit/test_step_inputs.py"]
PARITY_TESTS = ["tests/e2e/test_static_decode.py", "tests/e2e/test_parity_tiny.py",
                "tests/e2e/test_parity_random_smollm2.py", "tests/e2e/test_speculation_tiny.py"]
# NOTE: of the tiny parity matrix only these scenarios: each new shape compiles Triton kernels (~1 s each)
# on a fresh machine, and the rest repeat their code paths (block size 1 and recompute preemption).
PARITY_SELECTION = ("test_cuda_graphs or test_random_smollm2 or block16 or block4-chunked or swap-preemption "
                    "or test_drafts_through_the_device_kernel")


@dataclass
class StageRun:
    """What one stage's process did."""

    name: str
    command: list[str]
    seconds: float = 0.0
    exit_code: int | None = None  # None: not run
    timed_out: bool = False
    skipped: str = ""  # why it did not run
    output_tail: str = ""
    result: dict[str, Any] = field(default_factory=dict)  # the stage's JSON, or parsed test outcomes


@dataclass(frozen=True)
class Target:
    """One row of the final table."""

    name: str
    measured: str
    goal: str
    verdict: str  # PASS, FAIL or SKIP


def missing_modules() -> dict[str, str]:
    return {name: why for name, why in NEEDED_MODULES.items() if importlib.util.find_spec(name) is None}


def run_stage(stage: StageRun, timeout_s: float, log: Path, env: dict[str, str]) -> str:
    """Run ``stage.command`` from the repository root in a session of its own, killed with its
    children after ``timeout_s``; its output is appended to ``log`` and returned (its tail kept)."""
    if timeout_s < 5:
        stage.skipped = "no time left before the deadline"
        return ""
    with log.open("a") as out:
        out.write(f"\n===== {stage.name}: {' '.join(stage.command)}\n")
        out.flush()
        start = time.monotonic()
        proc = subprocess.Popen(stage.command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            stage.exit_code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stage.exit_code = proc.wait()
            stage.timed_out = True
        stage.seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    output = text[text.rfind(f"===== {stage.name}:"):]
    stage.output_tail = output[-3000:]
    print(f"  {stage.name}: exit {stage.exit_code}{' (timed out)' if stage.timed_out else ''} "
          f"in {stage.seconds:.0f} s", flush=True)
    return output


def pytest_outcomes(output: str) -> dict[str, str]:
    """``test id -> PASSED/FAILED/ERROR/SKIPPED`` from pytest's verbose lines (they survive a kill)."""
    found = re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", output, re.MULTILINE)
    return {match.group(1): match.group(2) for match in found}


def pytest_rows(stages: dict[str, StageRun], dry: bool) -> list[Target]:
    """A row per group of tests (:data:`TEST_TARGETS`)."""
    groups: dict[str, list[str]] = {name: [] for name, _, _ in TEST_TARGETS}
    for stage_name in ("pytest-kernels", "pytest-parity"):
        for tid, outcome in stages[stage_name].result.get("tests", {}).items():
            name = next(n for n, s, pattern in TEST_TARGETS if s == stage_name and re.search(pattern, tid))
            groups[name].append(outcome)
    rows = []
    for (name, stage_name, _), results in zip(TEST_TARGETS, groups.values()):
        passed, failed = results.count("PASSED"), results.count("FAILED") + results.count("ERROR")
        stage = stages[stage_name]
        if dry:
            rows.append(Target(name, f"{stage.result.get('collected', 0)} collected (dry)", "all pass", "SKIP"))
        elif failed or stage.timed_out:  # NOTE: a stage cut short leaves its groups unproven
            rows.append(Target(name, f"{passed} passed, {failed} failed" + (", timed out" if stage.timed_out else ""),
                               "all pass", "FAIL"))
        elif passed:
            rows.append(Target(name, f"{passed} passed", "all pass", "PASS"))
        else:
            rows.append(Target(name, stage.skipped or "none ran", "all pass", "SKIP" if stage.skipped else "FAIL"))
    return rows


def _verdict(ok: bool | None) -> str:
    return "SKIP" if ok is None else ("PASS" if ok else "FAIL")


SMOLLM2_ROW = f"SmolLM2 bf16 decode step, batch {SMOLLM2_PLAN.batches[0]}, spec off"
SPECULATION_ROW = f"SmolLM2 bf16 decode, batch {SMOLLM2_PLAN.batches[0]}, spec auto"
THROUGHPUT_ROWS = (("hf_static16", "throughput vs HF static batch 16"), ("hf_cb", "throughput vs transformers CB"))
LLAMA_DECODE_ROWS = tuple(f"8B decode, batch {batch} (ctx {LLAMA_PLAN.context})" for batch in LLAMA_PLAN.batches)
LLAMA_PREFILL_ROW = f"8B prefill, {LLAMA_PLAN.prefill_tokens}-token step"
BANDWIDTH_ROW = "8B decode bandwidth, batch " + " / ".join(map(str, LLAMA_PLAN.batches[:2]))
MEMORY_ROW = "8B GPU memory (max_memory_allocated)"


def table_layout() -> list[str]:
    """The table's rows, in order: the same on a GPU and in a dry run (the dry run's own shapes are in its cells)."""
    return ["environment", *(name for name, _, _ in TEST_TARGETS), SMOLLM2_ROW, SPECULATION_ROW,
            *(label for _, label in THROUGHPUT_ROWS), *LLAMA_DECODE_ROWS, LLAMA_PREFILL_ROW, BANDWIDTH_ROW, MEMORY_ROW]


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _decode_problems(timing: dict[str, Any]) -> list[str]:
    """What makes a speculation-off decode timing not what it claims: steps short of the batch, or a step that
    gave a sequence other than one token."""
    problems = []
    if timing["full_steps"] != timing["steps"]:
        problems.append(f"only {timing['full_steps']}/{timing['steps']} steps ran the whole batch")
    if abs(timing["tokens_per_step"] - 1.0) > 1e-9:
        problems.append(f"{timing['tokens_per_step']:.2f} tok/step, not 1")
    return problems


def measured_rows(stages: dict[str, StageRun], dry: bool) -> list[Target]:
    """The rows of the measuring stages (a stage that failed makes its rows FAIL, one not run SKIP), named as
    :func:`table_layout` says whatever happened."""
    rows: list[Target] = []

    def failed(stage: StageRun, names: list[tuple[str, str]]) -> bool:
        if stage.result:
            return False
        why = stage.skipped or ("timed out" if stage.timed_out else f"exit {stage.exit_code}")
        rows.extend(Target(name, why, goal, "SKIP" if stage.skipped else "FAIL") for name, goal in names)
        return True

    step = stages["smollm2-step"]
    if not failed(step, [(SMOLLM2_ROW, "<= 10 ms, graphs"), (SPECULATION_ROW, "measured")]):
        r = step.result
        graphs_ok = dry or r["graph_steps"] == r["full_steps"]
        problems = _decode_problems(r) + ([] if graphs_ok else ["NO GRAPHS"])
        ok = r["step_wall_ms"] <= 10 and (r["step_event_ms"] is None or r["step_event_ms"] <= 10) and not problems
        event = "-" if r["step_event_ms"] is None else f"{r['step_event_ms']:.2f}"
        dry_shape = f" (dry: batch {r['batch']})" if dry else ""
        rows.append(Target(SMOLLM2_ROW, f"wall {r['step_wall_ms']:.2f} / event {event} ms"
                           + "".join(f", {p}" for p in problems) + dry_shape, "<= 10 ms, graphs",
                           "SKIP" if dry else _verdict(ok)))
        spec = r.get("speculation", {})
        if "error" in spec or not spec:
            rows.append(Target(SPECULATION_ROW, spec.get("error", "not run")[:60], "measured",
                               "SKIP" if dry else "FAIL"))
        else:
            rows.append(Target(SPECULATION_ROW, f"{spec['tokens_per_step']:.2f} tok/step, "
                               f"{spec['step_wall_ms']:.2f} ms: {spec['tokens_per_s']:,.0f} tok/s "
                               f"(off: {r['tokens_per_s']:,.0f})" + dry_shape, "measured",
                               "SKIP" if dry else _verdict(spec["full_steps"] == spec["steps"])))
    throughput = stages["throughput"]
    if not failed(throughput, [(label, ">= 5x" if system == "hf_static16" else ">= 3x")
                               for system, label in THROUGHPUT_ROWS]):
        targets = throughput.result.get("summary", {}).get("targets", {})
        for system, label in THROUGHPUT_ROWS:
            t = targets.get(system)
            partial = ""
            if t and t.get("partial"):
                done = t.get("finished_requests", {})
                partial = " (partial: " + ", ".join(f"{s} {done.get(s)}/{t.get('num_requests')}"
                                                    for s in t["partial"]) + ")"
            rows.append(Target(label, f"{t['speedup']:.2f}x{partial}" if t else "not measured",
                               f">= {t['target']:.0f}x" if t else "-",
                               "SKIP" if dry else _verdict(t["passed"] if t else False)))
    llama = stages["llama8b"]
    names = [(name, "measured") for name in LLAMA_DECODE_ROWS] + [
        (LLAMA_PREFILL_ROW, "measured"), (BANDWIDTH_ROW, ">= 70%"), (MEMORY_ROW, "measured")]
    if not failed(llama, names):
        r = llama.result
        for name, d in zip(LLAMA_DECODE_ROWS, r["decode"]):
            problems = _decode_problems(d)
            dry_shape = f" (dry: batch {d['batch']}, ctx {d['context']})" if dry else ""
            rows.append(Target(name, f"{d['tokens_per_s']:,.0f} tok/s, {d['step_wall_ms']:.2f} ms"
                               + "".join(f", {p}" for p in problems) + dry_shape, "measured",
                               "SKIP" if dry else _verdict(not problems)))
        dry_shape = f" (dry: {r['prefill']['tokens']} tokens)" if dry else ""
        rows.append(Target(LLAMA_PREFILL_ROW, f"{r['prefill']['tokens_per_s']:,.0f} tok/s" + dry_shape, "measured",
                           "SKIP" if dry else "PASS"))
        rows.append(bandwidth_row(r))
        peak = r["gpu_peak_bytes"]
        measured = "-" if peak is None else f"{peak / 2**30:.1f} GiB (weights {r['weights_bytes'] / 2**30:.1f})"
        rows.append(Target(MEMORY_ROW, measured, "measured", "SKIP" if peak is None else "PASS"))
    return rows


def bandwidth_row(result: dict[str, Any]) -> Target:
    """The fraction of the device's specified HBM bandwidth a decode step reads at (weights + KV per step), at the
    first two batches, and of the copy measured in the same run; judged against the specification, or the copy
    where the device is not in the table (ops/gpu/stages.py ``HBM_BANDWIDTH``)."""
    decodes = result["decode"][:2]
    specified, copy = result.get("spec_bandwidth_bytes_per_s"), result.get("copy_bandwidth_bytes_per_s")
    of_spec = [d.get("fraction_of_spec_bandwidth") for d in decodes]
    of_copy = [d.get("fraction_of_copy_bandwidth") for d in decodes]
    copies = " / ".join(_percent(f) for f in of_copy)
    if specified:
        measured = f"{' / '.join(_percent(f) for f in of_spec)} of {specified / 1e12:.2f} TB/s spec; copy {copies}"
        judged = of_spec
    elif copy:
        measured = f"{copies} of copy ({result.get('device_name', '?')}: no spec in the table)"
        judged = of_copy
    else:
        return Target(BANDWIDTH_ROW, "-", ">= 70%", "SKIP")
    return Target(BANDWIDTH_ROW, measured, ">= 70%",
                  _verdict(all(f is not None and f >= 0.7 for f in judged)))


def print_table(rows: list[Target]) -> None:
    widths = [max(len(getattr(r, f)) for r in rows + [Target("target", "measured", "goal", "result")])
              for f in ("name", "measured", "goal", "verdict")]
    header = Target("target", "measured", "goal", "result")
    for row in [header, Target(*("-" * w for w in widths)), *rows]:
        cells = (row.name, row.measured, row.goal, row.verdict)
        print("  ".join(c.ljust(w) if i < 3 else c for i, (c, w) in enumerate(zip(cells, widths))))


Reader = Callable[[StageRun, str], None]  # fills a stage's result from its output


def stage_commands(args: argparse.Namespace, scratch: Path) -> list[tuple[StageRun, float, Reader]]:
    """``(stage, budget seconds, read its result)`` in running order."""
    python = sys.executable
    pytest_base = [python, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-o", "addopts=",
                   "-W", "ignore::pytest.PytestConfigWarning"]
    pytest_mode = ["--collect-only", "-q"] if args.dry else ["-v", "-rN"]

    def read_json(path: Path, even_cut_short: bool = False) -> Reader:
        """The stage's JSON: when it exited 0, or (``even_cut_short``: it writes as it goes) whatever it left."""
        def read(stage: StageRun, output: str) -> None:
            if (stage.exit_code == 0 or even_cut_short) and path.exists():
                try:
                    stage.result = json.loads(path.read_text())
                except json.JSONDecodeError:  # NOTE: killed while writing it
                    stage.result = {}
        return read

    def read_tests(stage: StageRun, output: str) -> None:
        if args.dry:
            found = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
            stage.result = {"collected": int(found.group(1)) if found else 0} if stage.exit_code == 0 else {}
        else:
            stage.result = {"tests": pytest_outcomes(output)}

    model = str(args.model_files)
    dry = ["--dry"] if args.dry else []
    throughput_json = scratch / "throughput.json"
    throughput = [python, "ops/bench/throughput.py", "--random-init", "--model", model, "--no-step-table",
                  "--systems", ",".join(THROUGHPUT_SYSTEMS), "--speculative", "off", "--json", str(throughput_json),
                  "--child-timeout", str(THROUGHPUT_CHILD_S)]
    throughput += [arg for system, seconds in THROUGHPUT_RUN_DEADLINE_S.items()
                   for arg in ("--system-deadline-s", f"{system}={seconds:g}")]
    if args.dry:
        throughput += ["--device", "cpu", "--dtype", "float32", "--quick", "--num-requests", "4",
                       "--model", str(scratch / "smollm2-tiny"), "--kv-cache-memory", "64MiB", "--swap-space", "16MiB",
                       "--hf-cb-num-blocks", "64", "--hf-cb-max-batch-tokens", "256"]
    else:
        throughput += ["--device", "cuda", "--dtype", "bfloat16", "--threads", "8", "--hf-batch1-limit", "8",
                       "--kv-cache-memory", "8GiB"]
    budget = STAGE_BUDGETS_S
    return [
        (StageRun("pytest-kernels", pytest_base + pytest_mode + KERNEL_TESTS), budget["pytest-kernels"], read_tests),
        (StageRun("pytest-parity", pytest_base + pytest_mode + ["-k", PARITY_SELECTION] + PARITY_TESTS),
         budget["pytest-parity"], read_tests),
        (StageRun("smollm2-step", [python, "-m", "ops.gpu.stages", "smollm2-step", "--model", model, "--result",
                                   str(scratch / "step.json"), *dry]), budget["smollm2-step"],
         read_json(scratch / "step.json")),
        (StageRun("llama8b", [python, "-m", "ops.gpu.stages", "llama8b", "--result", str(scratch / "llama.json"),
                              *dry]), budget["llama8b"], read_json(scratch / "llama.json")),
        (StageRun("throughput", throughput), budget["throughput"], read_json(throughput_json, even_cut_short=True)),
    ]


def probe_device(env: dict[str, str]) -> dict[str, Any]:
    """Versions and the CUDA device, from a process of its own (importing torch here would cost its time)."""
    code = ("import json, sys, torch, transformers\n"
            "info = {'python': sys.version.split()[0], 'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'cuda': torch.cuda.is_available()}\n"
            "try:\n    import triton; info['triton'] = triton.__version__\n"
            "except ImportError:\n    info['triton'] = None\n"
            "if info['cuda']:\n    p = torch.cuda.get_device_properties(0)\n"
            "    info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))\n"
            "print(json.dumps(info))")
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        return dict(json.loads(done.stdout.strip().splitlines()[-1])) if done.returncode == 0 else {
            "error": done.stderr[-1500:]}
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        return {"error": repr(exc)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where check.json and check.log go")
    parser.add_argument("--model-files", type=Path, default=SMOLLM2_FILES,
                        help="SmolLM2's config and tokenizer (ops/gpu/prepare.sh puts them here)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, pytest only collects")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    args = parser.parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "check.log"
    log.write_text("")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))

    missing = missing_modules()
    print("missing modules: " + (", ".join(f"{m} ({why})" for m, why in missing.items()) or "none"), flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="tm-gpu-check-"))
    if not (args.model_files / "config.json").exists():
        if args.dry:  # CI has the alias; a GPU machine gets the files from prepare.sh
            args.model_files = export_smollm2_files(scratch / "smollm2")
        else:
            print(f"SmolLM2's files are missing at {args.model_files}: run ops/gpu/prepare.sh first", flush=True)
    if args.dry:
        from ops.gpu.models import TINY_SMOLLM2, shrunk

        shrunk(args.model_files, scratch / "smollm2-tiny", TINY_SMOLLM2)
    env["TOKENMILL_SMOLLM2_FILES"] = str(args.model_files)
    device = probe_device(env)
    print("device: " + json.dumps(device), flush=True)
    no_cuda = "" if args.dry or device.get("cuda") else "no CUDA device"
    blocking = [m for m in missing if m not in ("pytest_timeout",)]
    why_not = no_cuda or (f"missing {', '.join(blocking)}" if blocking else "")

    stages: list[StageRun] = []
    for stage, budget, read in stage_commands(args, scratch):
        if why_not or (stage.name.startswith("pytest") and "pytest" in missing):
            stage.skipped = why_not or "pytest is missing"
        elif stage.name in ("smollm2-step", "throughput", "pytest-parity") and \
                not (args.model_files / "config.json").exists():
            stage.skipped = "SmolLM2's files are missing (ops/gpu/prepare.sh)"
        else:
            remaining = args.deadline_s - (time.monotonic() - started)
            read(stage, run_stage(stage, min(budget, remaining), log, env))
        stages.append(stage)

    env_ok = bool(device.get("cuda")) and not blocking
    rows = [Target("environment", f"{device.get('device', 'no GPU')}; torch {device.get('torch')}, "
                   f"triton {device.get('triton')}", "CUDA + modules",
                   "SKIP" if args.dry else _verdict(env_ok))]
    rows += pytest_rows({s.name: s for s in stages}, args.dry)
    rows += measured_rows({s.name: s for s in stages}, args.dry)
    report = {"dry": args.dry, "seconds": time.monotonic() - started, "missing_modules": missing, "device": device,
              "stages": [asdict(s) for s in stages], "targets": [asdict(r) for r in rows]}
    (args.out / "check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nGPU check{' (dry: CPU, tiny shapes)' if args.dry else ''}: {time.monotonic() - started:.0f} s; "
          f"JSON {args.out / 'check.json'}, log {log}\n")
    print_table(rows)
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
