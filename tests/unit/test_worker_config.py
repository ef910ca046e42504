"""Worker settings: file < env < flags, one env name per setting, unknown keys rejected, every key in
configs/default.toml, CLI errors field by field."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from typer.testing import CliRunner

from tokenmill.cli.app import app
from tokenmill.producer.config import ClientSettings
from tokenmill.protocol.errors import ConfigError
from tokenmill.worker.config import Settings, load_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["default.toml", "cpu-small.toml", "gpu.toml"])
def test_shipped_configs_load(name: str) -> None:
    settings = load_settings(CONFIGS / name)
    assert settings.engine.model.name and settings.worker.max_waiting >= 1
    assert ClientSettings.load(CONFIGS / name).queue == settings.queue  # one file serves workers and clients


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, info in model.model_fields.items():
        nested = info.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            keys |= _keys(nested, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def _documented(path: Path) -> set[str]:
    """Keys of the file, set or commented out (``# key = ...``), as ``table.key``."""
    keys, table = set(), ""
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").split("#")[0].strip()
        key = text.split("=")[0].strip()
        if text.startswith("[") and text.endswith("]"):
            table = text[1:-1] + "."
        elif "=" in text and key.isidentifier():
            keys.add(table + key)
    return keys


def test_default_toml_lists_every_key() -> None:
    assert _documented(CONFIGS / "default.toml") == _keys(Settings)


def test_default_toml_matches_the_defaults() -> None:
    """default.toml documents the defaults: every value set in it is the code's default."""
    if os.environ.get("TOKENMILL_TEST_OVERLAP"):
        pytest.skip("TOKENMILL_TEST_OVERLAP replaced the overlap default for this run (tests/conftest.py)")

    def check(values: dict[str, Any], defaults: BaseModel, where: str) -> None:
        for key, value in values.items():
            default = getattr(defaults, key)
            if isinstance(value, dict):
                check(value, default, f"{where}{key}.")
            else:
                assert value == default, f"{where}{key}: file {value!r}, default {default!r}"

    check(tomllib.loads((CONFIGS / "default.toml").read_text()), Settings.model_construct(), "")


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.toml"
    path.write_text('[queue]\nname = "file"\n[worker]\nmax_waiting = 7\nread_batch = 3\n'
                    '[engine.model]\nname = "echo"\n[redis]\nurl = "redis://file:6379/0"\n')
    monkeypatch.setenv("TOKENMILL_WORKER__MAX_WAITING", "9")
    monkeypatch.setenv("TOKENMILL_WORKER__READ_BATCH", "5")
    monkeypatch.setenv("REDIS_URL", "redis://env:6379/0")
    settings = load_settings(path, {"worker": {"read_batch": 11}, "queue": {"name": None}})
    assert (settings.queue.name, settings.worker.max_waiting, settings.worker.read_batch) == ("file", 9, 11)
    assert settings.engine.model.name == "echo" and settings.redis.url == "redis://env:6379/0"
    assert load_settings(path, {"redis": {"url": "redis://flag:6379/0"}}).redis.url == "redis://flag:6379/0"
    monkeypatch.delenv("REDIS_URL")
    assert load_settings(path).redis.url == "redis://file:6379/0"
    assert load_settings(None).queue.name == "default"


@pytest.mark.parametrize("name", ["TOKENMILL_REDIS__URL", "TOKENMILL_REDIS_URL"])
def test_the_redis_url_has_one_env_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, "redis://elsewhere:6379/0")
    with pytest.raises(ConfigError, match="set REDIS_URL"):
        load_settings(None)
    outcome = CliRunner().invoke(app, ["status"])
    assert outcome.exit_code == 1 and "set REDIS_URL" in outcome.output


def test_nested_env_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_QUEUE__HASH_TAG", "true")
    monkeypatch.setenv("TOKENMILL_ENGINE__SCHEDULER__MAX_NUM_SEQS", "3")
    settings = load_settings(None)
    assert settings.queue.keys.lane(0) == "{tokenmill:default}:lane:0" and settings.engine.scheduler.max_num_seqs == 3


def test_unknown_and_invalid_keys_fail(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[worker]\nqueue = 'moved to [queue] name'\n")
    with pytest.raises(ValidationError):
        load_settings(path)
    with pytest.raises(ValidationError, match="stale_after_s"):
        load_settings(None, {"worker": {"heartbeat_interval_s": 10.0, "stale_after_s": 5.0}})


def test_cli_prints_errors_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[worker]\nmax_waiting = 0\nbogus = 1\n")
    result = CliRunner().invoke(app, ["--config", str(path), "worker"])
    assert result.exit_code == 1
    assert "worker.max_waiting" in result.output and "worker.bogus" in result.output


def test_cli_help_and_missing_file() -> None:
    runner = CliRunner()
    assert "--burst" in runner.invoke(app, ["worker", "--help"]).output
    result = runner.invoke(app, ["--config", "/nonexistent.toml", "worker"])
    assert result.exit_code == 1 and "cannot read config file" in result.output
