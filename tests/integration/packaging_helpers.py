"""What the packaging tests share (test_wheel_install.py, test_packaging.py): a copy of the checkout, an environment
that can build it offline, and fresh virtualenvs that hold the project's dependencies but not tokenmill."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import tomllib
import venv
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 300) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{command[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def copy_checkout(target: Path) -> None:
    """The files a fresh clone would hold plus untracked ones not ignored (no .venv, no build/). None is a symbolic
    link: a Windows clone without core.symlinks would hold a text file in its place."""
    listing = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT)
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        assert not source.is_symlink(), f"{name} is a symbolic link"
        if source.is_file():  # tracked files deleted in the working tree are listed too
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())


def build_env(tmp: Path) -> dict[str, str]:
    """An environment whose interpreter has what ``[build-system] requires`` asks: this one's when
    it qualifies (offline), else those packages fetched once into a folder on PYTHONPATH."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def satisfied(spec: str) -> bool:
        requirement = Requirement(spec)
        try:
            return requirement.specifier.contains(metadata.version(requirement.name), prereleases=True)
        except metadata.PackageNotFoundError:
            return False

    if not all(map(satisfied, requires)):
        run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tmp / "build-env"), *requires], tmp)
        env["PYTHONPATH"] = str(tmp / "build-env")
    return env


def dependencies_venv(environment: Path) -> tuple[Path, Path]:
    """A new virtualenv without tokenmill that reaches the project's dependencies (torch, transformers, ...) through
    a .pth file, after its own site-packages, so nothing is downloaded; its interpreter and site-packages. Paths a
    .pth names are not scanned for .pth files of their own, so the project's editable install is not in it."""
    venv.EnvBuilder(with_pip=False).create(environment)
    (site_packages,) = environment.glob("lib/python*/site-packages")
    (site_packages / "project_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return environment / "bin" / "python", site_packages


# Run by another interpreter, from the folder given: every module of the package (argv[1]: a JSON list of names),
# and the file each is found in; finding a submodule imports the packages above it (their __init__ files only).
FIND_MODULES = """
import importlib.util, json, sys
print(json.dumps({name: importlib.util.find_spec(name).origin for name in json.loads(sys.argv[1])}))
"""
