"""The layer contracts (pyproject.toml's ``[tool.importlinter]``, run by ``ops/layers.py``): the tree keeps them, and
the check sees a broken one: a cycle, an engine folder importing a layer above it, the worker importing the producer,
the engine importing Redis. The checker reads a copy of the package laid out as an install holds it, so these tests
add their offending modules to such a copy, never to the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ops"))
from layers import lay_out_package  # noqa: E402


def _lint(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "ops" / "layers.py"), "--laid-out", str(folder)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("package")
    lay_out_package(folder)
    return folder


def test_the_tree_keeps_every_contract() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "ops" / "layers.py")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "Contracts:" in result.stdout


def test_the_layout_holds_every_part(laid_out: Path) -> None:
    parts = {path.name for path in (laid_out / "tokenmill").iterdir() if path.is_dir()}
    assert parts == {"protocol", "engine", "worker", "producer", "serve", "cli"}
    assert (laid_out / "tokenmill" / "engine" / "core" / "scheduler.py").is_file()


@pytest.mark.parametrize(("modules", "broken"), [
    ({"engine/core/cycle_a.py": "from tokenmill.engine.core import cycle_b\n",
      "engine/core/cycle_b.py": "from tokenmill.engine.core import cycle_a\n"}, "No import cycles"),
    ({"engine/core/upward.py": "import tokenmill.engine.model.model_runner\n"}, "The engine: its front"),
    ({"worker/through_producer.py": "from tokenmill.producer import Producer\n"}, "The worker speaks the wire"),
    ({"engine/kv/remote.py": "import redis\n"}, "The engine knows nothing of Redis"),
    ({"protocol/heavy.py": "import torch\n"}, "The wire contract is pure data"),
    ({"producer/heavy.py": "from tokenmill.engine import Engine\n"}, "The parts"),
], ids=["cycle", "engine-upward", "worker-producer", "engine-redis", "protocol-torch", "producer-engine"])
def test_a_broken_contract_is_reported(laid_out: Path, tmp_path: Path, modules: dict[str, str], broken: str) -> None:
    folder = tmp_path / "package"
    shutil.copytree(laid_out, folder)
    for name, text in modules.items():
        (folder / "tokenmill" / name).write_text(text)
    result = _lint(folder)
    assert result.returncode == 1, result.stdout + result.stderr
    report = result.stdout.partition("Broken contracts")[2]
    assert any(line.startswith(broken) for line in report.splitlines()), result.stdout
