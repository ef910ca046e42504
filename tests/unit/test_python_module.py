"""engine/kernels/python_module.py: a C++ source built into a CPython module on first use, cached under
TOKENMILL_HOME and reused (no second compile), imported without torch; and when it cannot be built (no compiler,
no source, a compile error) a warning that says why and what to do, None for the caller's Python path, no half-built
binary left behind."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.engine.kernels.python_module import PythonModule

SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef definition = {PyModuleDef_HEAD_INIT, "tokenmill_test_answer", "", -1, methods};
PyMODINIT_FUNC PyInit_tokenmill_test_answer(void) { return PyModule_Create(&definition); }
"""


@pytest.fixture(autouse=True)
def own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))


def _module(tmp_path: Path, text: str = SOURCE) -> PythonModule:
    source = tmp_path / "answer.cpp"
    source.write_text(text)
    return PythonModule("tokenmill_test_answer", source, what="the test module", fallback="the Python path is used")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tokenmill.engine.kernels.python_module" and r.levelno == logging.WARNING]


def test_a_module_is_built_once_and_then_loaded_from_the_cache(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module(tmp_path).load()
    assert module is not None and module.answer() == 42
    (binary,) = (tmp_path / "home" / "python_extensions").glob("tokenmill_test_answer-*/tokenmill_test_answer*.so")

    def no_compile(*args: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(PythonModule, "_compile", no_compile)
    again = _module(tmp_path).load()  # a new process's first load: from the cache
    assert again is not None and again.answer() == 42
    assert not list(binary.parent.glob("*.partial"))


def test_the_build_needs_no_torch(tmp_path: Path) -> None:
    probe = ("import sys; from pathlib import Path; from tokenmill.engine.kernels.python_module import PythonModule; "
             f"m = PythonModule('tokenmill_test_answer', Path({str(tmp_path / 'answer.cpp')!r}), 'w', 'f').load(); "
             "print(m.answer(), 'torch' in sys.modules)")
    (tmp_path / "answer.cpp").write_text(SOURCE)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["42", "False"]


def test_a_missing_compiler_is_named_with_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "tokenmill-no-such-compiler")
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.kernels.python_module")
    module = _module(tmp_path)
    assert module.load() is None
    assert module.load() is None  # asked again: the answer is kept, the warning not repeated
    (warning,) = _warnings(caplog)
    assert warning.startswith("the test module unavailable (the Python path is used): no C++ compiler")
    assert "apt-get install g++" in warning
    assert not (tmp_path / "home").exists()


def test_a_missing_source_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.kernels.python_module")
    module = PythonModule("tokenmill_test_answer", tmp_path / "absent.cpp", what="the test module", fallback="f")
    assert module.load() is None
    (warning,) = _warnings(caplog)
    assert f"its C++ source is not installed ({tmp_path / 'absent.cpp'})" in warning


def test_a_compile_error_is_reported_and_leaves_no_binary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokenmill.engine.kernels.python_module")
    assert _module(tmp_path, SOURCE + "\nthis is not C++;\n").load() is None
    (warning,) = _warnings(caplog)
    assert "the build failed" in warning and "error" in warning
    assert not [path for path in (tmp_path / "home").rglob("*") if path.suffix in (".so", ".partial")]
