"""mypy over the tree an install holds: ``python ops/typecheck.py [mypy flags]`` (``make typecheck``).

The repository keeps one folder per part (engine/, worker/, ...) and pyproject.toml's ``package-dir`` installs
each as a subpackage of tokenmill (engine/x.py is tokenmill.engine.x). mypy has no such mapping: given engine/x.py
it would call it ``engine.x``, and asked for ``-p tokenmill`` it finds tokenmill/, which holds only the package's
``__init__``. So this script hands mypy every module of the package with its installed name and its file in the
checkout (:func:`package_modules`, read from pyproject.toml like setuptools reads it): errors name the real files
(``engine/core/scheduler.py:12: error: ...``), and the options are pyproject.toml's ``[tool.mypy]`` and the flags
given. A bare ``mypy`` has no target (pyproject.toml names none) and says so.

:func:`package_files` is also what the packaging tests compare the wheel and the sdist with.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _setuptools(root: Path) -> dict[str, Any]:
    table: dict[str, Any] = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return table


def package_folder(package: str, root: Path = ROOT) -> Path:
    """The folder a package comes from: its longest prefix in ``package-dir`` (setuptools' rule), the rest below."""
    package_dir: dict[str, str] = _setuptools(root)["package-dir"]
    names = package.split(".")
    for n in range(len(names), 0, -1):
        prefix = ".".join(names[:n])
        if prefix in package_dir:
            return root / package_dir[prefix] / Path(*names[n:])
    return root / Path(*names)


def package_files(root: Path = ROOT, *, data: bool = True) -> dict[str, Path]:
    """Every file an install of the checkout at ``root`` holds, as the wheel names it
    (``tokenmill/engine/core/scheduler.py``), and the checkout's file it comes from: the modules of every package
    ``packages`` lists, and with ``data`` the files ``package-data`` adds (C++ sources, the dashboard's templates)."""
    setuptools = _setuptools(root)
    packages: list[str] = setuptools["packages"]
    package_data: dict[str, list[str]] = setuptools.get("package-data", {})
    files: dict[str, Path] = {}
    for package in packages:
        folder = package_folder(package, root)
        patterns = ["*.py", *((package_data.get("*", []) + package_data.get(package, [])) if data else [])]
        for pattern in patterns:
            for path in sorted(folder.glob(pattern)):
                if path.is_file():
                    files[f"{package.replace('.', '/')}/{path.relative_to(folder).as_posix()}"] = path
    return files


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by its installed name (``tokenmill.engine.core.scheduler``), and its file."""
    modules = {}
    for name, path in package_files(root, data=False).items():
        dotted = name.removesuffix(".py").replace("/", ".")
        modules[dotted.removesuffix(".__init__")] = path
    return modules


def main(argv: list[str]) -> int:
    from mypy import build
    from mypy.errors import CompileError
    from mypy.main import process_options
    from mypy.modulefinder import BuildSource

    os.chdir(ROOT)  # where mypy finds pyproject.toml; and file names in its messages relative to the checkout
    sources = [BuildSource(path.relative_to(ROOT).as_posix(), name) for name, path in package_modules().items()]
    # mypy's own command line reads [tool.mypy] and the flags given; its one target is replaced by the sources.
    _, options = process_options([*argv, "tokenmill/__init__.py"])
    errors: list[str] = []

    def flush(_filename: str | None, messages: list[str], _serious: bool) -> None:
        for message in messages:
            print(message, flush=True)
        errors.extend(message for message in messages if ": error:" in message)

    try:
        build.build(sources, options, flush_errors=flush)
    except CompileError:  # a blocking error, already printed
        return 2
    if errors:
        files = len({message.split(":", 1)[0] for message in errors})
        print(f"Found {len(errors)} error{'s' * (len(errors) != 1)} in {files} file{'s' * (files != 1)} "
              f"(checked {len(sources)} source files)")
        return 1
    print(f"Success: no issues found in {len(sources)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
