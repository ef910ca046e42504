"""The dependency rule of docs/design.md, enforced: engine never imports Redis/Celery/msgpack or the
other packages; inside engine, each folder imports only the folders below it, and the torch-free
folders load without torch; the producer never imports torch, the engine, the worker, the server or
the cli; the server (serve/) is a producer: never torch, the engine or the worker; the cli imports
the worker and the server only inside its commands; nothing imports the worker or the cli; no
two modules import each other, however indirectly; and every import names a part through the one
installed package (``tokenmill.engine``, never a bare ``engine``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ENGINE = ROOT / "engine"
# Folders of engine/ whose every module loads without torch or transformers (docs/design.md), as do the
# modules directly in engine/ (the engine's front: only Engine.from_config loads a model).
PURE_ENGINE_FOLDERS = ["core", "kv", "output"]
# spec/ holds both: the modules that load without torch (the draftless proposers, the goodput rule, the
# verification rule: what the echo engine and the scheduler's replays run) and those that import it. Every
# module of spec/ is in exactly one of the two sets, so a new one is sorted by whoever adds it.
PURE_SPEC_MODULES = {"__init__", "draft_length", "ngram", "speculator", "suffix_pool", "verification"}
TORCH_SPEC_MODULES = {"draft_model", "grammar_drafts"}  # the draft model's proposer; the grammar-forced one
# The engine's folders and the folders each may import (the layers, bottom up). Any folder may also
# import engine/errors.py and engine/config.py, which import no other engine module; none imports
# the front (engine/__init__.py, engine.py, offline.py, echo.py).
ENGINE_LAYERS: dict[str, set[str]] = {
    "kv": set(),  # block ids and reference counts
    "core": {"kv"},  # requests, scheduler, step plan and step I/O, stats
    "output": {"core"},  # prompts, detokenizer, output processor, request outputs
    "sample": {"core"},  # sampler, logits processors, grammars (torch)
    # speculative decoding: proposers, the goodput rule, verification. sample: the grammar-forced proposer walks
    # the sampler's grammar matchers; output: the draft model's tokenizer check knows a model without one.
    "spec": {"core", "output", "sample"},
    "kernels": set(),  # attention backends, linear kernels, the C++ builder (torch)
    "model": {"core", "kv", "output", "sample", "kernels", "spec"},  # runner, loader, KV tensors, setup (torch)
}
ENGINE_FOUNDATIONS = {"tokenmill.engine.errors", "tokenmill.engine.config"}
MAX_ENGINE_TOP_LEVEL_MODULES = 12
# Packages whose modules must not import each other in a cycle.
CYCLE_CHECKED_PACKAGES = ["protocol", "engine", "worker", "producer", "serve", "cli"]
FORBIDDEN = {
    # the vocabulary every part speaks: pydantic and msgpack only
    "protocol": {"torch", "transformers", "redis", "celery", "engine", "producer", "worker", "cli", "serve",
                 "fastapi", "typer"},
    "engine": {"redis", "celery", "msgpack", "producer", "worker", "cli", "typer"},
    "producer": {"torch", "transformers", "engine", "worker", "cli", "serve", "fastapi", "uvicorn", "starlette"},
    "serve": {"torch", "transformers", "engine", "worker", "cli"},
    "worker": {"cli", "serve"},
    "cli": {"torch", "transformers", "engine"},
}


PARTS = ["protocol", "engine", "worker", "producer", "serve", "cli"]


def _part_or_top_level(module: str) -> str:
    """``tokenmill.engine.core`` -> ``engine`` (a part of tokenmill); ``torch.nn`` -> ``torch``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tokenmill" and len(parts) > 1 else parts[0]


def _absolute_imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _imported_top_levels(path: Path, *, module_level_only: bool = False) -> set[str]:
    return {_part_or_top_level(name) for name in _absolute_imports(path, module_level_only=module_level_only)}


def test_every_import_names_a_part_through_the_tokenmill_package() -> None:
    """A bare ``import engine`` would load a second copy of the module beside ``tokenmill.engine`` in a
    checkout, and fails in an install, which holds the parts only inside ``tokenmill``."""
    roots = [ROOT / name for name in [*PARTS, "tokenmill", "tests", "ops"]]
    offenders = [f"{path.relative_to(ROOT)} imports {sorted(bare)}"
                 for root in roots for path in sorted(root.rglob("*.py"))
                 if (bare := {name for name in _absolute_imports(path) if name.split(".")[0] in PARTS})]
    assert not offenders, "\n".join(offenders)


# The tests that import a bare name on purpose, to see it refused.
BARE_ON_PURPOSE = {"tests/unit/test_layout.py", "tests/integration/test_packaging.py"}


def _code_in_strings(path: Path) -> list[ast.Module]:
    """The Python code a module holds in its strings (what ``python -c`` runs in a child process), f-strings'
    replacement fields read as a name."""
    trees = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
        else:
            continue
        if "import" in text:
            try:
                trees.append(ast.parse(text))
            except SyntaxError:
                continue
    return trees


def test_code_run_from_strings_names_the_parts_through_the_tokenmill_package_too() -> None:
    """Child processes' code (``python -c``) is checked by neither ruff nor the test above, and a checkout's root is
    on their sys.path, where the part's ``__init__`` refuses a bare name: say so here, before a child fails."""
    offenders = []
    for root in [ROOT / name for name in [*PARTS, "tokenmill", "tests", "ops"]]:
        for path in sorted(root.rglob("*.py")):
            if path.relative_to(ROOT).as_posix() in BARE_ON_PURPOSE:
                continue
            for tree in _code_in_strings(path):
                names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
                names |= {node.module for node in ast.walk(tree)
                          if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
                if bare := {name for name in names if name.split(".")[0] in PARTS}:
                    offenders.append(f"{path.relative_to(ROOT)} runs code importing {sorted(bare)}")
    assert not offenders, "\n".join(offenders)


def test_the_package_lends_common_names_lazily() -> None:
    modules = _loaded_modules_after("import tokenmill; tokenmill.Producer")
    assert "tokenmill.producer.client" in modules and "tokenmill.engine" not in modules
    engine_modules = _loaded_modules_after("import tokenmill.engine.core.scheduler")
    assert not {"tokenmill.producer", "redis"} & engine_modules


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_the_design_allows(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_nothing_imports_the_worker() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("engine", "producer")
        for path in (ROOT / package).rglob("*.py")
        if "worker" in _imported_top_levels(path)
    ]
    assert not offenders


def test_the_cli_imports_the_worker_and_the_server_only_inside_commands() -> None:
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "cli").rglob("*.py")
                 if {"worker", "serve"} & _imported_top_levels(path, module_level_only=True)]
    assert not offenders


def _loaded_modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _module_name(path: Path) -> str:
    parts = ("tokenmill", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_of(packages: list[str]) -> dict[str, Path]:
    return {_module_name(path): path for package in packages for path in sorted((ROOT / package).rglob("*.py"))}


def _imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules a module imports anywhere in it: at module level, under ``TYPE_CHECKING``
    and inside functions. ``from package import name`` counts as importing the submodule when
    ``name`` is one, else the package. Importing ``a.b`` is not counted as importing ``a``, though
    Python runs ``a/__init__.py`` first: package __init__ modules here only re-export."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    imported.add(f"{base}.{alias.name}")
                elif base in known:
                    imported.add(base)
    return imported


def _import_graph(packages: list[str]) -> dict[str, set[str]]:
    known = _modules_of(packages)
    return {name: _imported_modules(name, path, known) - {name} for name, path in known.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None: a depth-first walk."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path, children = [root], [iter(sorted(graph[root]))]
        while children:
            child = next(children[-1], None)
            if child is None:
                children.pop()
                done.add(path.pop())
            elif child in path:
                return path[path.index(child):] + [child]
            elif child not in done:
                path.append(child)
                children.append(iter(sorted(graph.get(child, set()))))
    return None


def test_no_import_cycles() -> None:
    """Module-level, ``TYPE_CHECKING`` and function-local imports alike: a cycle through any of them
    means two parts each need the other, which moving the shared piece down (or handing the
    collaborator in) undoes."""
    cycle = _find_cycle(_import_graph(CYCLE_CHECKED_PACKAGES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _engine_folder(module: str) -> str | None:
    """The engine folder a module lives in (``tokenmill.engine.core.scheduler`` -> ``core``); None for
    the modules directly in engine/."""
    parts = module.split(".")[1:]
    if len(parts) > 2 or (len(parts) == 2 and (ENGINE / parts[1]).is_dir()):
        return parts[1]
    return None


def test_every_engine_folder_has_a_layer() -> None:
    folders = {path.parent.name for path in ENGINE.glob("*/__init__.py")}
    assert folders == set(ENGINE_LAYERS), "give each engine folder its place in ENGINE_LAYERS"


def test_engine_folders_import_only_the_layers_below() -> None:
    offenders = []
    for module, imported in sorted(_import_graph(["engine"]).items()):
        folder = _engine_folder(module)
        if folder is None:
            if module in ENGINE_FOUNDATIONS and imported:
                offenders.append(f"{module} imports {sorted(imported)}")
            continue
        for other in sorted(imported):
            other_folder = _engine_folder(other)
            if other in ENGINE_FOUNDATIONS or other_folder == folder or other_folder in ENGINE_LAYERS[folder]:
                continue
            offenders.append(f"{module} ({folder}/) imports {other}")
    assert not offenders, "\n".join(offenders)


def test_engine_holds_few_modules_directly() -> None:
    """engine/ shows the step's parts as folders; only its front and foundations sit at the top."""
    top_level = sorted(path.name for path in ENGINE.glob("*.py"))
    assert len(top_level) <= MAX_ENGINE_TOP_LEVEL_MODULES, top_level


def test_every_spec_module_is_sorted_by_torch() -> None:
    modules = {path.stem for path in (ENGINE / "spec").glob("*.py")}
    assert not PURE_SPEC_MODULES & TORCH_SPEC_MODULES
    assert modules == PURE_SPEC_MODULES | TORCH_SPEC_MODULES, "add the new spec/ module to one of the two sets"


def test_torch_free_engine_folders_load_without_torch() -> None:
    """Every module of the torch-free folders, and every module directly in engine/, by directory:
    a new module there is covered without being listed; and spec/'s torch-free modules."""
    modules = sorted(_module_name(path) for folder in PURE_ENGINE_FOLDERS for path in (ENGINE / folder).rglob("*.py"))
    modules += sorted(_module_name(path) for path in ENGINE.glob("*.py"))
    modules += sorted(_module_name(ENGINE / "spec" / f"{name}.py") for name in PURE_SPEC_MODULES)
    assert "tokenmill.engine.core.scheduler" in modules and "tokenmill.engine.output.output_processor" in modules
    assert "tokenmill.engine.spec.speculator" in modules
    loaded = _loaded_modules_after("; ".join(f"import {name}" for name in modules))
    assert not {"torch", "transformers"} & loaded


def test_the_vocabulary_loads_nothing_but_pydantic_and_msgpack() -> None:
    modules = _loaded_modules_after("import tokenmill.protocol.sampling, tokenmill.protocol.outcomes, "
                                    "tokenmill.protocol.heartbeat")
    unwanted = {"torch", "transformers", "redis", "tokenmill.engine", "tokenmill.producer", "tokenmill.worker"}
    assert not unwanted & modules


def test_producer_loads_without_torch_or_engine() -> None:
    modules = _loaded_modules_after("import tokenmill.producer.client, tokenmill.producer.aio, "
                                    "tokenmill.protocol.schema")
    assert not {"torch", "transformers", "tokenmill.engine", "tokenmill.worker"} & modules


def test_cli_loads_without_the_worker() -> None:
    """`tokenmill --help` and the client commands pay for neither the worker, the server nor torch."""
    modules = _loaded_modules_after("import tokenmill.cli.app")
    assert not {"torch", "transformers", "tokenmill.engine", "tokenmill.worker", "tokenmill.serve", "fastapi"} & modules


def test_the_server_loads_without_torch_or_engine() -> None:
    """`tokenmill serve` is a producer: its app and every route load no model code."""
    modules = _loaded_modules_after("import tokenmill.serve.app, tokenmill.serve.completions, tokenmill.serve.batches, "
                                    "tokenmill.serve.files, tokenmill.serve.models")
    assert not {"torch", "transformers", "tokenmill.engine", "tokenmill.worker"} & modules
