"""Worker settings: file < env < flags, unknown keys rejected, CLI errors field by field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from worker.cli import app
from worker.config import load_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["default.toml", "cpu-small.toml", "gpu.toml"])
def test_shipped_configs_load(name: str) -> None:
    settings = load_settings(CONFIGS / name)
    assert settings.engine.model and settings.worker.max_waiting >= 1


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.toml"
    path.write_text('[worker]\nqueue = "file"\nmax_waiting = 7\nread_count = 3\n[engine]\nmodel = "echo"\n')
    monkeypatch.setenv("TOKENMILL_WORKER__MAX_WAITING", "9")
    monkeypatch.setenv("TOKENMILL_WORKER__READ_COUNT", "5")
    settings = load_settings(path, {"worker": {"read_count": 11, "queue": None}})
    assert (settings.worker.queue, settings.worker.max_waiting, settings.worker.read_count) == ("file", 9, 11)
    assert settings.engine.model == "echo"
    assert load_settings(None).worker.queue == "default"


def test_unknown_and_invalid_keys_fail(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[worker]\nqueu = 'typo'\n")
    with pytest.raises(ValidationError):
        load_settings(path)
    with pytest.raises(ValidationError, match="stale_after_s"):
        load_settings(None, {"worker": {"heartbeat_interval_s": 10.0, "stale_after_s": 5.0}})


def test_cli_prints_errors_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[worker]\nmax_waiting = 0\nbogus = 1\n")
    result = CliRunner().invoke(app, ["worker", "--config", str(path)])
    assert result.exit_code == 1
    assert "worker.max_waiting" in result.output and "worker.bogus" in result.output


def test_cli_help_and_missing_file() -> None:
    runner = CliRunner()
    assert "--burst" in runner.invoke(app, ["worker", "--help"]).output
    result = runner.invoke(app, ["worker", "--config", "/nonexistent.toml"])
    assert result.exit_code == 1 and "cannot read config file" in result.output
