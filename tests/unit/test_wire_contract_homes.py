"""protocol/ is the one wire contract: each of its common types has one home module, and the worker reaches the
producer for nothing of it.

"One home" is checked three ways. The class is defined in its home (``__module__``). Walking every module of
tokenmill (each imported, in a child process, so the walk's imports leave this one alone), no other module exports
it: it is in no other ``__all__`` and re-exported by no ``from ... import X as X`` (mypy's explicit re-export).
A module that merely uses the class holds it as an attribute too, as any Python import does; mypy's strict mode
(``no_implicit_reexport``) refuses ``from that_module import X`` for such a name, so the home stays the only
module it can be imported from. And no source in the repository (the parts, tests, ops) imports it from anywhere
but its home or the ``tokenmill`` package's lazy face.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["protocol", "engine", "worker", "producer", "serve", "cli"]

# Each wire type and the one module that defines it (and that everything imports it from).
HOMES = {
    "SamplingParams": "tokenmill.protocol.sampling",
    "ResponseFormat": "tokenmill.protocol.sampling",
    "ErrorCode": "tokenmill.protocol.outcomes",
    "FinishReason": "tokenmill.protocol.outcomes",
    "AbortReason": "tokenmill.protocol.outcomes",
}
# The package's face, which lends common names lazily (tokenmill/__init__.py's __getattr__, nothing bound).
FACE = "tokenmill"
# Third-party packages a module may need that an install without extras lacks (pyproject's optional
# dependencies): a module whose import fails for one of these is skipped, any other failure fails the walk.
OPTIONAL = {"torch", "transformers", "accelerate", "gguf", "safetensors", "prometheus_client", "xgrammar", "triton",
            "celery", "pyarrow", "fastapi", "uvicorn", "starlette", "multipart", "python_multipart", "jinja2", "ninja"}

_WALK = r"""
import importlib, json, pkgutil, sys
import tokenmill

names, optional = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
found, skipped, failed = {}, {}, {}
# NOTE: the parts are found by tokenmill's own finder in a checkout (not through tokenmill.__path__): walk each
parts = [importlib.import_module(f"tokenmill.{part}") for part in json.loads(sys.argv[3])]
modules = ["tokenmill"] + [part.__name__ for part in parts] + sorted(
    m.name for part in parts for m in pkgutil.walk_packages(part.__path__, part.__name__ + ".")
    if m.name.rpartition(".")[2] != "__main__")
for name in modules:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        (skipped if missing in optional else failed)[name] = f"{type(exc).__name__}: {exc}"
        continue
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
        continue
    exported = set(getattr(module, "__all__", ()))
    found[name] = {"file": getattr(module, "__file__", None) or "", "holds": [], "exports": []}
    for attr in names:
        value = vars(module).get(attr)
        if isinstance(value, type):
            found[name]["holds"].append([attr, value.__module__, value.__qualname__])
        if attr in exported:
            found[name]["exports"].append(attr)
print(json.dumps({"found": found, "skipped": skipped, "failed": failed}))
"""


@pytest.fixture(scope="module")
def walk() -> dict[str, Any]:
    """Every module of tokenmill, imported in a child process: what each holds and exports of :data:`HOMES`."""
    out = subprocess.run([sys.executable, "-c", _WALK, json.dumps(sorted(HOMES)), json.dumps(sorted(OPTIONAL)),
                          json.dumps(PARTS)],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_the_walk_imports_every_module(walk: dict[str, Any]) -> None:
    assert not walk["failed"], walk["failed"]
    found = walk["found"]
    assert set(HOMES.values()) <= set(found)
    assert {"tokenmill.protocol.schema", "tokenmill.protocol.keys", "tokenmill.protocol.shards",
            "tokenmill.worker.reader", "tokenmill.producer.client"} <= set(found)
    # NOTE: the walk ran in a checkout of this repository, not a stray installed copy
    assert all(str(ROOT) in str(info["file"]) for info in found.values())


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_wire_type_is_defined_in_its_home(name: str, walk: dict[str, Any]) -> None:
    home = walk["found"][HOMES[name]]
    assert [name, HOMES[name], name] in home["holds"]


@pytest.mark.parametrize("name", sorted(HOMES))
def test_no_other_module_exports_a_wire_type(name: str, walk: dict[str, Any]) -> None:
    """Held elsewhere only as a private import: in no ``__all__`` but its home's (or none), never ``as X``."""
    found = walk["found"]
    other_classes = [module for module, info in found.items()
                     if any(attr == name and (home, qualname) != (HOMES[name], name)
                            for attr, home, qualname in info["holds"])]
    assert not other_classes, f"another class named {name} in {other_classes}"
    exporters = [module for module, info in found.items()
                 if name in info["exports"] and module not in (HOMES[name], FACE)]
    assert not exporters, f"{name} is re-exported by {exporters}; import it from {HOMES[name]}"
    explicit = [f"{module} ({info['file']})" for module, info in found.items()
                if module != HOMES[name] and _reexports_explicitly(Path(str(info["file"])), name)]
    assert not explicit, f"{name} is re-exported with 'import {name} as {name}' by {explicit}"


def test_the_package_face_lends_each_wire_type_from_its_home() -> None:
    code = ("import importlib, json, tokenmill; names = json.loads(__import__('sys').argv[1]); "
            "print(json.dumps({n: getattr(tokenmill, n) is getattr(importlib.import_module(h), n) "
            "for n, h in names.items() if n in tokenmill.__all__}))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(HOMES)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    lent = json.loads(out.stdout)
    assert lent == {"SamplingParams": True, "ErrorCode": True, "FinishReason": True}


def test_every_import_of_a_wire_type_names_its_home() -> None:
    """In every source file of the repository: the parts, the tests, ops/ (function-local imports included)."""
    roots = [ROOT / name for name in [*PARTS, "tests", "ops"]] + [ROOT / "tokenmill" / "__init__.py"]
    offenders = []
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
                    continue
                if node.module.split(".")[0] != "tokenmill":  # another library's own (vLLM's SamplingParams)
                    continue
                for alias in node.names:
                    if alias.name in HOMES and node.module not in (HOMES[alias.name], FACE):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} "
                                         f"from {node.module}")
    assert not offenders, "\n".join(offenders)


def test_the_worker_takes_the_wire_contract_from_protocol() -> None:
    """The worker imports nothing of the producer: the schema, the keys, the shards, the settings, the errors and
    the Redis connection are protocol/'s (the demo, which composes both sides, is the cli's)."""
    imported: dict[str, set[str]] = {}
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name == "tokenmill.producer" or name.startswith("tokenmill.producer."):
                    imported.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert imported == {}


def _reexports_explicitly(path: Path, name: str) -> bool:
    """Whether ``path`` binds ``name`` with ``import ... as name`` of the same name (mypy's explicit re-export)."""
    if not path.is_file():
        return False
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name.rpartition(".")[2] == name and alias.asname == name for alias in node.names):
                return True
    return False
