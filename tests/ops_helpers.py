"""Readers for the deployment files under ops/, for tests that check them structurally where they
cannot run (no Docker engine, no cluster, no systemd here): Dockerfile instructions, .dockerignore
matching, compose-style ``${VAR:-default}`` interpolation, whether the CLI accepts a command line,
and whether ``TOKENMILL_*`` env names and config files are ones the settings really take."""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

from ops.typecheck import package_files as installed_files
from tokenmill.cli.app import app
from tokenmill.producer.config import ClientSettings, ServeSettings
from tokenmill.protocol.config import FileSettings
from tokenmill.worker.config import Settings

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The settings each command reads (the client commands read ClientSettings).
SETTINGS_OF: dict[str, type[FileSettings]] = {"worker": Settings, "serve": ServeSettings}


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comment lines dropped (Docker
    drops them inside a continued instruction too)."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return instructions


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    parts = []
    for piece in re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/")):
        parts.append({"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(piece, re.escape(piece)))
    return re.compile("".join(parts))


def dockerignored(ignore_file: Path, path: str) -> bool:
    """Whether ``path`` (relative to the context) is left out of the build context: the last
    pattern matching it or one of its parent folders decides, ``!`` patterns keep."""
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    candidates = [str(Path(*Path(path).parts[:i])) for i in range(1, len(Path(path).parts) + 1)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        regex = _ignore_regex(pattern.lstrip("!"))
        if any(regex.fullmatch(candidate) for candidate in candidates):
            ignored = not keep
    return ignored


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` against ``env``."""
    def substitute(match: re.Match[str]) -> str:
        name, operator, argument = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        assert operator != ":?", f"${{{name}}} must be set: {argument}"
        return argument if operator in (":-", "-") else ""

    return _VARIABLE.sub(substitute, value).replace("$$", "$")


def command_line(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def assert_cli_accepts(args: list[str]) -> str:
    """The command line (after the ``tokenmill`` program) names a real command and only options it
    has (checked by the CLI's own parser, with ``--help`` so that nothing runs); returns the command."""
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, f"tokenmill {' '.join(args)}: {result.output}"
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    return next(arg for arg in args if arg in commands)


def option(args: list[str], name: str) -> str | None:
    """The value of ``name`` on a command line, if given."""
    return args[args.index(name) + 1] if name in args else None


def _section_model(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The model that holds the last key of ``path`` (None: some key of it does not exist)."""
    for key in path[:-1]:
        field = model.model_fields.get(key)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model if path[-1] in model.model_fields else None


def assert_settings_take(settings: type[FileSettings], config: Path | None, env: Mapping[str, str],
                         monkeypatch: pytest.MonkeyPatch) -> FileSettings:
    """Every ``TOKENMILL_<SECTION>__<KEY>`` name in ``env`` is a setting of ``settings`` (the
    settings would ignore a misspelt one), and ``config`` with ``env`` loads; returns what loads."""
    for name in env:
        if name.startswith("TOKENMILL_") and name != "TOKENMILL_HOME":
            path = name.removeprefix("TOKENMILL_").lower().split("__")
            assert _section_model(settings, path) is not None, f"{name} is no setting of {settings.__name__}"
    for name in [n for n in os.environ if n.startswith("TOKENMILL_") or n == "REDIS_URL"]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return settings.load(config)


def settings_class(command: str) -> type[FileSettings]:
    return SETTINGS_OF.get(command, ClientSettings)


def package_files() -> list[str]:
    """Every file the wheel is built from, relative to the checkout: pyproject.toml, the readme, and each module
    and data file of the package (pyproject's package-dir maps engine/ to tokenmill.engine, ...)."""
    files = [path.relative_to(ROOT).as_posix() for path in installed_files().values()]
    return ["pyproject.toml", PYPROJECT["project"]["readme"], *files]
