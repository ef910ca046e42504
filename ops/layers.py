"""The layer contracts, checked by import-linter: ``python ops/layers.py`` (part of ``make test``).

The contracts themselves are pyproject.toml's ``[tool.importlinter]`` (which part may import which, the engine's
layers, what each part may never import, no cycles at any level). import-linter (through grimp) reads a package from
the folder its name is found in, and in a checkout ``tokenmill/`` holds only the package's ``__init__``: the parts are
its siblings (docs/design.md, "Layout and the import rule"). So this script lays out the tree an install holds
(:func:`ops.typecheck.package_files`: the wheel's modules and the checkout files they come from) in a temporary folder,
puts that folder first on ``sys.path`` and runs ``lint-imports`` there. Nothing is imported, only read: the copies are
what grimp parses, and its reports name modules (``tokenmill.engine.core.scheduler``), never the temporary paths.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from typecheck import ROOT, package_files


def lay_out_package(destination: Path, root: Path = ROOT) -> None:
    """Copy every module of the package into ``destination`` as the wheel names it (``tokenmill/engine/...``)."""
    for name, source in package_files(root, data=False).items():
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def lint(folder: Path, *, verbose: bool = False) -> int:
    """Run the contracts over the package laid out in ``folder``: 0 when every one is kept, 1 when one is broken."""
    from importlinter.cli import lint_imports

    # lint-imports puts its working directory first on sys.path: there, tokenmill is the laid-out package
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    return int(lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, verbose=verbose))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="import-linter's timings and every chain it checked")
    parser.add_argument("--laid-out", type=Path, metavar="FOLDER",
                        help="check a package already laid out in FOLDER (the tests add modules that break a contract)")
    args = parser.parse_args(argv)
    if args.laid_out:
        return lint(args.laid_out.resolve(), verbose=args.verbose)
    with tempfile.TemporaryDirectory(prefix="tokenmill-layers-") as folder:
        lay_out_package(Path(folder))
        return lint(Path(folder), verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
