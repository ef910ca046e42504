"""The ``tokenmill`` CLI without Redis: --help everywhere, config errors field by field (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app

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
