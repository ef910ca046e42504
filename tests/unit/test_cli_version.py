"""``tokenmill --version``: the installed package's version, else the checkout's pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenmill.cli.app import app
from tokenmill.protocol import version as version_module
from tokenmill.protocol.version import UNKNOWN_VERSION, package_version

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_installed_package_version() -> None:
    outcome = runner.invoke(app, ["--version"])
    assert outcome.exit_code == 0, outcome.output
    assert outcome.output == f"tokenmill {importlib.metadata.version('tokenmill')}\n"


def test_version_needs_no_command_and_runs_none() -> None:
    """Eager: printed before the command is looked at (no Redis is reached, nothing else printed)."""
    outcome = runner.invoke(app, ["--redis-url", "redis://localhost:1/0", "--version", "status"])
    assert outcome.exit_code == 0 and outcome.output.startswith("tokenmill "), outcome.output
    assert len(outcome.output.splitlines()) == 1


def _not_installed(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


def test_a_checkout_never_installed_reads_its_pyproject(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(version_module.importlib.metadata, "version", _not_installed)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "tokenmill"\nversion = "9.8.7"\n')
    assert package_version(pyproject) == "9.8.7"
    checkout = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert package_version() == checkout  # by default: this checkout's own pyproject.toml


@pytest.mark.parametrize("text", [None, "not toml [", '[project]\nname = "other"\nversion = "1.0"\n',
                                  '[project]\nname = "tokenmill"\n'])
def test_without_metadata_or_a_tokenmill_pyproject_the_version_is_unknown(
        text: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(version_module.importlib.metadata, "version", _not_installed)
    pyproject = tmp_path / "pyproject.toml"
    if text is not None:
        pyproject.write_text(text)
    assert package_version(pyproject) == UNKNOWN_VERSION
