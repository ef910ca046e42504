"""vLLM's engine flags (cli/engine_flags.py): each sets its setting on ``tokenmill worker``, ``serve --model`` and
``bulk --model``, above env and file; a bad value or a flag without the worker it configures is one clear error;
``--help`` and docs/operations.md list every flag of the table. No Redis, no model: the commands stop where the
worker would start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tokenmill.cli import bulk as bulk_module
from tokenmill.cli import serve_command
from tokenmill.cli.app import app
from tokenmill.cli.engine_flags import FLAGS, NOT_TAKEN, parse_gib_or_size, parse_token_count
from tokenmill.worker import runtime
from tokenmill.worker.config import Settings

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
NO_REDIS = ["--redis-url", "redis://localhost:1/0"]  # nothing must connect: a connection would fail the test
# Each flag of the table: the arguments that give it and the value its setting then has.
EXAMPLES: dict[str, tuple[list[str], Any]] = {
    "--device": (["--device", "cpu"], "cpu"),
    "--dtype": (["--dtype", "half"], "float16"),
    "--served-model-name": (["--served-model-name", "my-model"], "my-model"),
    "--max-model-len": (["--max-model-len", "4K"], 4096),
    "--tensor-parallel-size": (["-tp", "3"], 3),
    "--max-num-seqs": (["--max-num-seqs", "7"], 7),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "4096"], 4096),
    "--gpu-memory-utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "--kv-cache-memory": (["--kv-cache-memory-bytes", "2GiB"], "2GiB"),
    "--swap-space": (["--swap-space", "4"], "4GiB"),
    "--block-size": (["--block-size", "32"], 32),
    "--enable-prefix-caching": (["--no-enable-prefix-caching"], False),
    "--enforce-eager": (["--enforce-eager"], "off"),
}


def _setting(settings: Settings, dotted: str) -> Any:
    value: Any = settings
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings each command would start its worker with (the worker itself never starts)."""
    seen: list[Settings] = []

    def run_worker(settings: Settings, *, burst: bool = False) -> int:
        seen.append(settings)
        return 0

    def serve(_ctx: Any, _serve_overrides: Any, worker_settings: Settings | None) -> None:
        assert worker_settings is not None
        seen.append(worker_settings)

    def bulk(_ctx: Any, settings: Settings, *_args: Any) -> Any:
        seen.append(settings)
        raise SystemExit(0)

    monkeypatch.setattr(runtime, "run_worker", run_worker)
    monkeypatch.setattr(serve_command, "_serve", serve)
    monkeypatch.setattr(bulk_module, "_run_with_own_worker", bulk)
    monkeypatch.delenv("TOKENMILL_CONFIG", raising=False)
    return seen


def test_every_flag_of_the_table_has_an_example() -> None:
    assert set(EXAMPLES) == {flag.flag for flag in FLAGS}


@pytest.mark.parametrize("flag", FLAGS, ids=lambda flag: flag.flag)
@pytest.mark.parametrize("command", [["worker", "--model", "some/model"], ["serve", "--model", "some/model"],
                                     ["bulk", "in.jsonl", "out.jsonl", "--model", "some/model"]],
                         ids=lambda command: command[0])
def test_each_flag_sets_its_setting(flag: Any, command: list[str], started: list[Settings]) -> None:
    args, expected = EXAMPLES[flag.flag]
    without = runner.invoke(app, [*NO_REDIS, *command])
    outcome = runner.invoke(app, [*NO_REDIS, *command, *args])
    assert (without.exit_code, outcome.exit_code) == (0, 0), outcome.output
    assert _setting(started[1], flag.setting) == expected
    assert _setting(started[0], flag.setting) != expected  # NOTE: the flag set it, not a default


def test_a_flag_wins_over_env_and_file(tmp_path: Path, started: list[Settings],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "deploy.toml"
    config.write_text("[engine.model]\ndtype = \"bfloat16\"\n[engine.scheduler]\nmax_num_seqs = 5\n")
    monkeypatch.setenv("TOKENMILL_ENGINE__SCHEDULER__MAX_NUM_SEQS", "6")
    for args in ([], ["--max-num-seqs", "7", "--dtype", "float"]):
        outcome = runner.invoke(app, [*NO_REDIS, "--config", str(config), "worker", "--model", "m", *args])
        assert outcome.exit_code == 0, outcome.output
    (env_and_file, flags) = started
    assert (env_and_file.engine.scheduler.max_num_seqs, env_and_file.engine.model.dtype) == (6, "bfloat16")
    assert (flags.engine.scheduler.max_num_seqs, flags.engine.model.dtype) == (7, "float32")


def test_serve_and_bulk_set_their_workers_logging(started: list[Settings]) -> None:
    for command in (["serve", "m", "--log-level", "debug", "--log-json"], ["bulk", "i", "o", "--model", "m"],
                    ["bulk", "i", "o", "--model", "m", "--log-level", "info"]):
        outcome = runner.invoke(app, [*NO_REDIS, *command])
        assert outcome.exit_code == 0, outcome.output
    assert [(s.engine.model.name, s.worker.log_level, s.worker.log_json) for s in started] == [
        ("m", "DEBUG", True), ("m", "WARNING", False), ("m", "INFO", False)]


@pytest.mark.parametrize(("command", "message"), [
    (["serve", "--dtype", "half", "-tp", "2"], "error: --dtype, --tensor-parallel-size configure the worker "
                                               "tokenmill serve runs with --model; give --model too"),
    (["bulk", "in.jsonl", "out.jsonl", "--max-num-seqs", "4"], "error: --max-num-seqs configures the worker "
                                                               "tokenmill bulk runs with --model"),
    (["bulk", "in.jsonl", "out.jsonl", "--log-level", "INFO"], "--log-level is the log level of the worker --model"),
    (["serve", "one", "--model", "other"], "error: two models: 'one' and --model 'other'; give one"),
    (["worker", "--model", "m", "--max-num-seqs", "0"],
     "engine.scheduler.max_num_seqs (--max-num-seqs): Input should be greater than or equal to 1 (got 0)"),
    (["worker", "--model", "echo", "-tp", "2"], "the echo model has no weights to shard"),
    (["serve", "--model", "m", "--kv-cache-memory", "lots"], "not a size: 'lots'"),
], ids=["serve-no-model", "bulk-no-model", "bulk-log-level", "two-models", "out-of-range", "echo-sharded",
        "bad-size"])
def test_combinations_that_cannot_run_are_one_clear_error(command: list[str], message: str,
                                                          started: list[Settings]) -> None:
    outcome = runner.invoke(app, [*NO_REDIS, *command])
    assert outcome.exit_code == 1, outcome.output
    assert message in " ".join(outcome.output.split()) and "Traceback" not in outcome.output
    assert started == []


@pytest.mark.parametrize(("args", "flag"), [(["--dtype", "fp8"], "--dtype"), (["--max-model-len", "4x"],
                                                                              "--max-model-len")])
def test_a_value_of_the_wrong_form_is_a_usage_error_naming_the_flag(args: list[str], flag: str,
                                                                    started: list[Settings]) -> None:
    outcome = runner.invoke(app, ["worker", "--model", "m", *args])
    assert outcome.exit_code == 2 and f"Invalid value for '{flag}'" in outcome.output
    assert started == []


def test_token_counts_and_swap_sizes_read_as_in_vllm() -> None:
    assert [parse_token_count(text) for text in ("4096", "4k", "4K", "25.6k", "1M")] == [4096, 4000, 4096, 25600,
                                                                                       2**20]
    assert [parse_gib_or_size(text) for text in ("4", "0.5", "512MiB")] == ["4GiB", "0.5GiB", "512MiB"]
    with pytest.raises(ValueError, match="not a token count"):
        parse_token_count("lots")


@pytest.mark.parametrize("command", [["worker"], ["serve"], ["bulk"]], ids=lambda command: command[0])
def test_help_lists_every_flag(command: list[str]) -> None:
    outcome = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert outcome.exit_code == 0
    for flag in FLAGS:
        assert flag.flag in outcome.output, flag.flag
    assert "--model" in outcome.output
    assert ("[MODEL]" in outcome.output) == (command == ["serve"])  # NOTE: vllm serve MODEL


def test_the_operations_guide_lists_every_flag_and_its_setting() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    for flag in FLAGS:
        assert f"`{flag.flag}`" in guide and flag.setting in guide, flag.flag
    for name in NOT_TAKEN:
        assert f"`{name}`" in guide, name
