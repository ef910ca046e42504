"""tokenmill's version, decided once for every part that reports it (``tokenmill --version``,
serve's ``/version``): the installed package's metadata, else the ``pyproject.toml`` of the
checkout this code runs from. The standard library only.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

DISTRIBUTION = "tokenmill"
UNKNOWN_VERSION = "unknown"
# NOTE: the checkout's root: this file is <root>/protocol/version.py.
CHECKOUT_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def package_version(pyproject: Path = CHECKOUT_PYPROJECT) -> str:
    """The installed distribution's version; in a checkout that was never installed, the version
    its ``pyproject.toml`` declares; ``"unknown"`` when neither says."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return _checkout_version(pyproject)


def _checkout_version(pyproject: Path) -> str:
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return UNKNOWN_VERSION
    version = project.get("version") if project.get("name") == DISTRIBUTION else None
    return version if isinstance(version, str) and version else UNKNOWN_VERSION
