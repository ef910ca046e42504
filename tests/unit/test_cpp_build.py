"""What engine/kernels/cpp_build.py says when an extension cannot be built: a missing compiler or ninja
once per process with what to install, missing sources by name, every kernel's fallback at
WARNING; and nothing is written when nothing can be built. (Builds themselves: the kernels'
own tests and tests/integration/test_wheel_install.py.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from tokenmill.engine.kernels import cpp_build
from tokenmill.engine.kernels.cpp_build import CppExtension


@pytest.fixture(autouse=True)
def fresh_toolchain_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test checks the toolchain anew (the answer is cached per process), builds nowhere but
    its own TOKENMILL_HOME, and leaves no cached answer of its fake toolchain behind."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    cpp_build._missing_toolchain.cache_clear()
    yield
    cpp_build._missing_toolchain.cache_clear()


def _extensions(tmp_path: Path) -> list[CppExtension]:
    source = tmp_path / "kernel.cpp"
    source.write_text("int answer() { return 42; }\n")
    return [CppExtension(f"tokenmill_test_{i}", source, ("-O0",), what=f"test kernel {i}", fallback=f"path {i} used")
            for i in range(2)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tokenmill.engine.kernels.cpp_build" and r.levelno == logging.WARNING]


def test_a_missing_compiler_is_logged_once_with_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "tokenmill-no-such-compiler")
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.kernels.cpp_build")
    extensions = _extensions(tmp_path)
    assert [ext.is_available() for ext in extensions] == [False, False]
    warnings = _warnings(caplog)
    toolchain = [w for w in warnings if w.startswith("the C++ CPU kernels cannot be built")]
    assert len(toolchain) == 1
    assert "'tokenmill-no-such-compiler' is not on PATH" in toolchain[0]
    assert "apt-get install g++ ninja-build" in toolchain[0]
    for i in range(2):  # each kernel still says, at WARNING, that it is unavailable and why
        assert any(w.startswith(f"test kernel {i} unavailable (path {i} used): no C++ compiler") for w in warnings)
    assert not (tmp_path / "home").exists()


def test_a_missing_ninja_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.kernels.cpp_build")
    assert not _extensions(tmp_path)[0].is_available()
    (toolchain,) = [w for w in _warnings(caplog) if w.startswith("the C++ CPU kernels cannot be built")]
    assert "no ninja" in toolchain and "pip install ninja" in toolchain


def test_missing_sources_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A package installed without its C++ files (a wheel built without package data) says so, not a bare
    FileNotFoundError; the header counts like the source."""
    source, header = tmp_path / "kernel.cpp", tmp_path / "csrc" / "shared.h"
    source.write_text("int answer() { return 42; }\n")
    extension = CppExtension("tokenmill_test_headers", source, ("-O0",), what="test kernel", fallback="path used",
                             headers=(header,))
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.kernels.cpp_build")
    assert not extension.is_available()
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"test kernel unavailable (path used): its C++ sources are not installed ({header})")
    assert "installed without its package data" in warning
    assert not (tmp_path / "home").exists()
