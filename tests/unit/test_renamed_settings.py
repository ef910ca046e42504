"""Settings renamed to say what they do: the old names are still accepted for one release, each with a warning
naming the new one, from a TOML file, the environment and Python alike; the new names are what the docs show."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tokenmill.engine.config import EngineConfig, ExecutionConfig, LengthConfig, SchedulerConfig
from tokenmill.worker.config import load_settings

RENAMED = [  # (section model, old key, new key, a value that is not the default)
    (SchedulerConfig, "max_consecutive_decode_steps", "demote_after_decode_steps", 7),
    (ExecutionConfig, "compile", "decode_fast_path", "off"),
    (LengthConfig, "predict", "estimate", False),
    (LengthConfig, "confidence", "tail_quantile", 0.8),
]


@pytest.mark.parametrize(("model", "old", "new", "value"), RENAMED)
def test_an_old_name_sets_the_new_setting_with_a_warning(model: type, old: str, new: str, value: object) -> None:
    with pytest.warns(DeprecationWarning, match=f"'{old}' is now '{new}'"):
        section = model.model_validate({old: value})
    assert getattr(section, new) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NOTE: the new name warns about nothing
        assert getattr(model.model_validate({new: value}), new) == value


def test_old_names_in_a_file_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "old.toml"
    path.write_text('[worker]\nread_count = 3\n[engine.model]\nname = "echo"\n'
                    '[engine.scheduler]\nmax_consecutive_decode_steps = 9\n[engine.execution]\ncompile = "off"\n')
    monkeypatch.setenv("TOKENMILL_WORKER__BLOCK_MS", "250")
    with pytest.warns(DeprecationWarning) as caught:
        settings = load_settings(path, {})
    assert (settings.worker.read_batch, settings.worker.idle_wait_ms) == (3, 250)
    assert settings.engine.scheduler.demote_after_decode_steps == 9
    assert settings.engine.execution.decode_fast_path == "off"
    named = " ".join(str(w.message) for w in caught)
    assert all(name in named for name in ("read_batch", "idle_wait_ms", "demote_after_decode_steps",
                                          "decode_fast_path"))


def test_the_new_name_wins_when_both_are_given() -> None:
    with pytest.warns(DeprecationWarning):
        config = EngineConfig.model_validate({"model": {"name": "echo"},
                                              "scheduler": {"max_consecutive_decode_steps": 1,
                                                            "demote_after_decode_steps": 2}})
    assert config.scheduler.demote_after_decode_steps == 2
