"""tokenmill: a queue-fed LLM batch worker, installed as one package.

The repository keeps one folder per part (``protocol/``, ``producer/``, ``engine/``, ``worker/``,
``serve/``, ``cli/``); this package holds them as subpackages (``tokenmill.producer`` and so on), so
an install adds a single top-level name to a virtualenv. The names most code needs are here too,
loaded on first use: ``from tokenmill import Producer`` pays for the producer only, and importing
``tokenmill.engine`` does not load the producer (the engine knows nothing of Redis).

In a wheel the parts are folders of this package (setuptools' ``package-dir`` puts them there). In a
checkout this folder holds only this file, and the parts are its siblings: run from a checkout (the
tests, the GPU check, the benchmarks; an editable install too), :class:`_CheckoutParts` maps exactly
``tokenmill.<part>`` to ``<checkout>/<part>/``, and keeps a bare ``import engine`` from finding that
folder under a second name (docs/design.md, "Layout and the import rule").
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.producer import AsyncProducer, Producer, SubmitOptions
    from tokenmill.protocol.outcomes import ErrorCode, FinishReason
    from tokenmill.protocol.sampling import SamplingParams

# Each common name and the module that defines it.
_HOMES = {
    "Producer": "tokenmill.producer",
    "AsyncProducer": "tokenmill.producer",
    "SubmitOptions": "tokenmill.producer",
    "SamplingParams": "tokenmill.protocol.sampling",
    "FinishReason": "tokenmill.protocol.outcomes",
    "ErrorCode": "tokenmill.protocol.outcomes",
    "Engine": "tokenmill.engine",
    "EngineConfig": "tokenmill.engine",
}

__all__ = ["AsyncProducer", "Engine", "EngineConfig", "ErrorCode", "FinishReason", "Producer", "SamplingParams",
           "SubmitOptions"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


# The parts, each a folder of the checkout and a subpackage here (pyproject.toml's package-dir maps the same six).
PARTS = ("protocol", "engine", "worker", "producer", "serve", "cli")


class _CheckoutParts:
    """The import system's finder for a checkout's parts (on ``sys.meta_path``, ahead of the path finder).

    ``tokenmill.engine`` is ``<root>/engine/`` (its modules then come from there through its ``__path__``). A bare
    ``engine`` (``import engine`` with the root on ``sys.path``: pytest run from it, the ops scripts) is searched
    for on ``sys.path`` without the root, so an installed package of that name is found, not shadowed; when there
    is none, the path finder comes to ``<root>/engine/`` after all and its ``__init__`` refuses the bare name."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, part = fullname.partition(".")
        if package == __name__ and part in PARTS:
            folder = os.path.join(self.root, part)
            return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])
        if path is None and fullname in PARTS:
            elsewhere = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != self.root]
            return importlib.machinery.PathFinder.find_spec(fullname, elsewhere)
        return None


def _map_a_checkouts_parts() -> None:
    """Put :class:`_CheckoutParts` first on ``sys.meta_path`` when this file is a checkout's: its folder holds no
    parts (a wheel's does) and its parent holds all six. Once per process."""
    here = os.path.dirname(os.path.realpath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "engine")):
        return
    if not all(os.path.isfile(os.path.join(root, part, "__init__.py")) for part in PARTS):
        return
    if not any(type(finder).__name__ == _CheckoutParts.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutParts(root))


_map_a_checkouts_parts()
