"""The repository's layout and the one installed package (docs/design.md, "Layout and the import rule"): one folder
per part, no symbolic links; pyproject.toml's package-dir maps each folder into tokenmill and lists every package
in it; a checkout maps the same six names (tokenmill/__init__.py) and refuses each by its bare name. The builds,
the installs and mypy are tested in tests/integration/test_packaging.py and test_wheel_install.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tokenmill
from ops.typecheck import package_folder, package_modules

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_repository_holds_no_symbolic_link() -> None:
    """Mode 120000 is a link: a Windows clone without core.symlinks would hold a text file in its place."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert listing and not [line for line in listing.splitlines() if line.startswith("120000")]
    assert not [path for path in (ROOT / "tokenmill").iterdir() if path.is_symlink()]


def test_package_dir_maps_each_part_folder_into_tokenmill() -> None:
    assert SETUPTOOLS["package-dir"] == {"tokenmill": "tokenmill", **{f"tokenmill.{p}": p for p in tokenmill.PARTS}}
    assert sorted(tokenmill.PARTS) == sorted(["protocol", "engine", "worker", "producer", "serve", "cli"])


def test_every_package_of_the_part_folders_is_listed() -> None:
    """setuptools finds no package through a mapping: one left out of ``packages`` would be missing from the wheel
    (and from mypy's check), so the list is every folder with an ``__init__.py``, and every folder holding Python
    files has one."""
    folders = [ROOT / "tokenmill", *(ROOT / part for part in tokenmill.PARTS)]
    found = set()
    for top in folders:
        for folder in [top, *(p for p in top.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            if (folder / "__init__.py").is_file():
                relative = folder.relative_to(ROOT).parts
                found.add(".".join(("tokenmill", *relative) if top.name != "tokenmill" else relative))
            else:
                assert not list(folder.glob("*.py")), f"{folder} holds Python files but no __init__.py"
    assert sorted(SETUPTOOLS["packages"]) == sorted(found)
    assert all(package_folder(package).is_dir() for package in SETUPTOOLS["packages"])


def test_the_package_holds_every_python_file_of_the_part_folders() -> None:
    """What ops/typecheck.py gives mypy and what the wheel holds: each file once, under its installed name."""
    modules = package_modules()
    files = {path for top in ("tokenmill", *tokenmill.PARTS) for path in (ROOT / top).rglob("*.py")
             if "__pycache__" not in path.parts}
    assert sorted(modules.values()) == sorted(files)
    assert modules["tokenmill.engine.core.scheduler"] == ROOT / "engine" / "core" / "scheduler.py"
    assert modules["tokenmill.engine"] == ROOT / "engine" / "__init__.py"


def test_a_checkout_maps_the_parts_and_refuses_their_bare_names() -> None:
    """Run from the checkout (its root first on sys.path, as here): tokenmill.engine is engine/, and ``import engine``
    fails, before tokenmill is imported (engine/__init__.py refuses the name) and after (the finder skips the root
    and the folder then refuses it); the module of the failed import is not left behind."""
    code = """
import json, sys
refused = {}
try:
    import engine.core.scheduler
except ImportError as error:
    refused["before"] = str(error)
import tokenmill
import tokenmill.engine.core.scheduler as scheduler
for part in ("engine", "cli", "serve"):
    try:
        __import__(part)
    except ImportError as error:
        refused[part] = str(error)
print(json.dumps({"refused": refused, "scheduler": scheduler.__file__,
                  "bare": sorted(m for m in sys.modules if m.split(".")[0] in tokenmill.PARTS)}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["scheduler"] == str(ROOT / "engine" / "core" / "scheduler.py")
    assert result["bare"] == []
    assert set(result["refused"]) == {"before", "engine", "cli", "serve"}
    assert "is tokenmill.engine: import it by that name, not as 'engine'" in result["refused"]["before"]
    assert "is tokenmill.cli: import it by that name" in result["refused"]["cli"]


def test_the_parts_are_tokenmills_subpackages_here() -> None:
    """This test process (pytest, root on sys.path) sees each part once, as tokenmill.<part>, from its folder."""
    import importlib

    for part in tokenmill.PARTS:
        module = importlib.import_module(f"tokenmill.{part}")
        assert module.__file__ == str(ROOT / part / "__init__.py")
        assert part not in sys.modules
