"""One tree, however tokenmill is reached: a clone made as Windows makes one, without symbolic links
(``core.symlinks=false``), a plain checkout without an install and an editable install (``pip install -e .``) each
import every module of the package from the checkout's part folders, the same files the wheel holds
(test_wheel_install.py) and mypy checks (ops/typecheck.py: a type error put into an engine module is caught); and
none of them makes a part importable by its bare name (``import engine``). tests/unit/test_layout.py checks that
the repository holds no link.

Each interpreter is a fresh virtualenv that reaches the project's dependencies but holds no tokenmill of its own,
run from the folder that makes the case: the copy of the checkout (its root first on ``sys.path``, as pytest and the
ops scripts have it) or a temporary folder (an install only).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops.typecheck import package_modules
from tests.integration.packaging_helpers import (
    FIND_MODULES,
    ROOT,
    build_env,
    copy_checkout,
    dependencies_venv,
    run,
)
from tokenmill import PARTS

pytestmark = pytest.mark.timeout(900)

# Run from a checkout: the bare names are refused, each with the import error saying which name to use.
BARE_NAMES = """
import json, tokenmill
refused = {}
for part in tokenmill.PARTS:
    try:
        __import__(part)
    except ImportError as error:
        refused[part] = str(error)
print(json.dumps(refused))
"""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout (tracked files and untracked ones not ignored; no symbolic link among them)."""
    target = tmp_path_factory.mktemp("packaging") / "checkout"
    copy_checkout(target)
    return target


def _found(python: Path, cwd: Path, modules: list[str]) -> dict[str, str]:
    found: dict[str, str] = json.loads(run([str(python), "-c", FIND_MODULES, json.dumps(modules)], cwd))
    return found


def _expected(checkout: Path) -> dict[str, str]:
    return {name: str(path) for name, path in package_modules(checkout).items()}


def test_a_clone_without_symbolic_links_imports_every_part(tmp_path: Path) -> None:
    """What a Windows clone without core.symlinks holds (of the repository's HEAD: commit first to test changes)."""
    clone = tmp_path / "clone"
    run(["git", "clone", "--quiet", "-c", "core.symlinks=false", str(ROOT), str(clone)], tmp_path)
    assert not [path for path in clone.rglob("*") if path.is_symlink()]
    python, _ = dependencies_venv(tmp_path / "venv")
    modules = _expected(clone)
    assert _found(python, clone, sorted(modules)) == modules
    imported = run([str(python), "-c", "import json, importlib; print(json.dumps({part: importlib.import_module("
                    "f'tokenmill.{part}').__file__ for part in ('protocol', 'engine', 'producer', 'serve', 'cli')}))"],
                   clone)
    assert json.loads(imported) == {part: str(clone / part / "__init__.py")
                                    for part in ("protocol", "engine", "producer", "serve", "cli")}


def test_a_checkout_without_an_install_imports_the_same_files(checkout: Path, tmp_path: Path) -> None:
    python, _ = dependencies_venv(tmp_path / "venv")
    modules = _expected(checkout)
    assert len(modules) > 150 and "tokenmill.engine.core.scheduler" in modules
    assert _found(python, checkout, sorted(modules)) == modules
    refused = json.loads(run([str(python), "-c", BARE_NAMES], checkout))
    assert set(refused) == set(PARTS)
    assert all(f"is tokenmill.{part}: import it by that name" in message for part, message in refused.items())


def test_a_bare_name_finds_an_installed_package_of_that_name_not_the_checkouts_folder(checkout: Path,
                                                                                       tmp_path: Path) -> None:
    """The checkout's root first on sys.path: once tokenmill is imported, ``engine`` is whatever else is installed
    under that name (here a folder on PYTHONPATH), never the checkout's engine/ under a second name."""
    other = tmp_path / "other" / "engine"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'another package'\n")
    python, _ = dependencies_venv(tmp_path / "venv")
    done = subprocess.run([str(python), "-c", "import tokenmill, engine; print(engine.WHO)"], cwd=checkout,
                          env={"PYTHONPATH": str(tmp_path / "other"), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "another package", done.stderr[-2000:]


def test_an_editable_install_imports_the_same_files(checkout: Path, tmp_path: Path) -> None:
    """``pip install -e .``: setuptools' import hook maps tokenmill.<part> to the part's folder (package-dir); from
    any other folder every module comes from the checkout, and the bare names are not importable at all."""
    python, _ = dependencies_venv(tmp_path / "venv")
    editable = tmp_path / "editable"
    shutil.copytree(checkout, editable)
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "-e", str(editable)], tmp_path, build_env(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    modules = _expected(editable)
    assert _found(python, elsewhere, sorted(modules)) == modules
    bare = run([str(python), "-c", "import importlib.util, json, tokenmill; "
                "print(json.dumps([p for p in tokenmill.PARTS if importlib.util.find_spec(p)]))"], elsewhere)
    assert json.loads(bare) == []


def test_mypy_checks_the_package_tree_and_catches_an_error_in_the_engine(checkout: Path, tmp_path: Path) -> None:
    """ops/typecheck.py (make typecheck) hands mypy every module of the package under its installed name: an error put
    into an engine module is reported at the checkout's file, and every module is checked. Starts from the
    project's mypy cache when there is one (a copy: only the changed module and those importing it are checked
    again), else checks everything (about 3 minutes on 2 busy cores)."""
    pytest.importorskip("mypy")
    broken = tmp_path / "checkout"
    shutil.copytree(checkout, broken)
    if (ROOT / ".mypy_cache").is_dir():
        shutil.copytree(ROOT / ".mypy_cache", broken / ".mypy_cache")
    scheduler = broken / "engine" / "core" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n\ndef _deliberate() -> int:\n    return 'not an int'\n")
    line = len(scheduler.read_text().splitlines())
    done = subprocess.run([sys.executable, "ops/typecheck.py"], cwd=broken, capture_output=True, text=True,
                          timeout=800)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"engine/core/scheduler.py:{line}: error: Incompatible return value type" in done.stdout, done.stdout
    assert f"Found 1 error in 1 file (checked {len(package_modules(broken))} source files)" in done.stdout, done.stdout
