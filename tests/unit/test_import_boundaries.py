"""The dependency rule of docs/design.md, enforced: engine never imports Redis/Celery/msgpack or the
other packages; the pure scheduler core never imports torch; the producer never imports torch,
the engine, the worker, the server or the cli; the server (serve/) is a producer: never torch, the
engine or the worker; the cli imports the worker and the server only inside its commands; nothing
imports the worker or the cli."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules of engine/ that must load without torch or transformers (STYLE.md).
PURE_ENGINE_MODULES = [
    "request", "scheduler", "block_manager", "outputs", "config", "clock", "errors",
    "detokenizer", "postprocess", "prompts",
]
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


def _imported_top_levels(path: Path, *, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


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


def test_pure_engine_core_loads_without_torch() -> None:
    modules = _loaded_modules_after("; ".join(f"import engine.{name}" for name in PURE_ENGINE_MODULES))
    assert "torch" not in modules and "transformers" not in modules


def test_the_vocabulary_loads_nothing_but_pydantic_and_msgpack() -> None:
    modules = _loaded_modules_after("import protocol, protocol.sampling, protocol.outcomes, protocol.heartbeat")
    assert not {"torch", "transformers", "redis", "engine", "producer", "worker"} & modules


def test_producer_loads_without_torch_or_engine() -> None:
    modules = _loaded_modules_after("import producer, producer.client, producer.aio, producer.schema")
    assert not {"torch", "transformers", "engine", "worker"} & modules


def test_cli_loads_without_the_worker() -> None:
    """`tokenmill --help` and the client commands pay for neither the worker, the server nor torch."""
    modules = _loaded_modules_after("import cli.app")
    assert not {"torch", "transformers", "engine", "worker", "serve", "fastapi"} & modules


def test_the_server_loads_without_torch_or_engine() -> None:
    """`tokenmill serve` is a producer: its app and every route load no model code."""
    modules = _loaded_modules_after("import serve.app, serve.completions, serve.batches, serve.files, serve.models")
    assert not {"torch", "transformers", "engine", "worker"} & modules
