"""The ``tokenmill`` CLI without Redis: --help everywhere, config errors field by field (exit 1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from tokenmill.cli.app import app

runner = CliRunner()

COMMANDS = [[], ["worker"], ["submit"], ["result"], ["cancel"], ["status"], ["dead"], ["bulk"], ["demo"],
            ["redis"], ["redis", "start"], ["redis", "status"], ["redis", "stop"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "tokenmill")
def test_every_command_has_help(command: list[str]) -> None:
    outcome = runner.invoke(app, [*command, "--help"])
    assert outcome.exit_code == 0, outcome.output
    assert "Usage" in outcome.output


def test_bulk_help_lists_its_options() -> None:
    outcome = runner.invoke(app, ["bulk", "--help"], env={"COLUMNS": "200"})
    for option in ("--priority", "--max-in-flight", "--max-tokens", "--temperature", "--retries", "--errors",
                   "--format", "--prompt-column"):
        assert option in outcome.output


def test_bad_redis_url_is_reported_by_field_with_exit_1() -> None:
    outcome = runner.invoke(app, ["--redis-url", "ftp://nowhere", "status"])
    assert outcome.exit_code == 1
    assert "invalid configuration" in outcome.output and "redis.url" in outcome.output


def test_bad_queue_and_prefix_are_each_reported() -> None:
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", "--queue", "a:b", "--prefix", "has space",
                                  "result", "x"])
    assert outcome.exit_code == 1
    assert "prefix" in outcome.output and "must not contain whitespace" in outcome.output


def test_global_options_come_from_the_environment() -> None:
    outcome = runner.invoke(app, ["status"], env={"REDIS_URL": "ftp://from-env"})
    assert outcome.exit_code == 1 and "ftp://from-env" in outcome.output


def test_client_commands_read_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('[redis]\nurl = "ftp://from-file"\n[worker]\nmax_waiting = 1\n')
    outcome = runner.invoke(app, ["--config", str(path), "status"])
    assert outcome.exit_code == 1 and "redis.url" in outcome.output and "ftp://from-file" in outcome.output


def test_dead_requeue_needs_ids_or_all() -> None:
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", "dead", "--requeue"])
    assert outcome.exit_code == 1 and "--all" in outcome.output


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(name, command) of every leaf command under ``group`` (typer's own click types: duck-typed)."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def _options(command: Any) -> list[Any]:
    return [param for param in command.params if type(param).__name__ == "TyperOption"]


def test_every_option_of_every_command_has_help() -> None:
    root = typer.main.get_command(app)
    missing = [f"{name} {option.opts[0]}" for name, command in [("tokenmill", root), *_commands(root)]
               for option in _options(command) if not option.help]
    assert missing == []


def test_waiting_is_timeout_everywhere() -> None:
    root = typer.main.get_command(app)
    names = {opt for _, command in _commands(root) for option in _options(command) for opt in option.opts}
    assert "--timeout" in names and "--wait" not in names


@pytest.mark.parametrize("command", [["submit", "x", "--no-wait"], ["result", "x"], ["cancel", "x"], ["status"],
                                     ["dead"], ["bulk", "in.jsonl", "out.jsonl"], ["worker", "--model", "echo"],
                                     ["serve"]], ids=lambda c: c[0])
def test_queue_is_accepted_after_the_command(command: list[str]) -> None:
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", *command, "--queue", "has space"])
    assert outcome.exit_code == 1, outcome.output
    assert "queue.name" in outcome.output and "must not contain whitespace" in outcome.output


def test_queue_after_the_command_wins_over_the_global_one() -> None:
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", "--queue", "good", "status",
                                  "--queue", "bad one"])
    assert outcome.exit_code == 1 and "got 'bad one'" in outcome.output


@pytest.mark.parametrize(("command", "options"), [
    (["submit"], ["--min-tokens", "--logprobs", "--model", "--system", "--json-schema", "--regex",
                  "--response-format", "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
                  "--timeout", "--queue"]),
    (["bulk"], ["--top-k", "--stop", "--queue"]),
    (["result"], ["--timeout", "--queue"]),
    (["worker"], ["--log-level", "--queue"]),
])
def test_commands_offer_their_options(command: list[str], options: list[str]) -> None:
    outcome = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    for option in options:
        assert option in outcome.output, option


def test_structured_output_options_are_one_at_a_time(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", "submit", "x", "--json-schema", str(schema),
                                  "--regex", "a+"])
    assert outcome.exit_code == 1 and "give one of --json-schema, --regex" in outcome.output
    schema.write_text("{not json")
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", "submit", "x", "--json-schema", str(schema)])
    assert outcome.exit_code == 1 and "is not JSON" in outcome.output


@pytest.mark.parametrize(("flag", "expected"), [("--dashboard-public", True), ("--dashboard-private", False)])
def test_serve_takes_the_dashboards_access_from_its_flag(flag: str, expected: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.serve.app as serve_app

    seen = []
    monkeypatch.setattr(serve_app, "run_server", lambda settings, **_: seen.append(settings.serve.dashboard_public))
    result = runner.invoke(app, ["serve", flag])
    assert result.exit_code == 0, result.output
    assert seen == [expected]
