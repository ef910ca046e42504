"""The ``openai`` SDK, LiteLLM, LangChain's ``ChatOpenAI`` and instructor against ``tokenmill serve`` and a SmolLM2
worker: their chat, streaming, structured-output and tool-calling paths (client_libraries_probe.py, run in a
virtualenv of their own, without tokenmill, kept per set of pins; skipped only when it cannot be installed)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.serve_helpers import running_server
from tests.worker_helpers import make_settings, running_worker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m"
# NOTE: openai 3.3.0 is the newest release instructor 1.17.0 allows: from 3.3.1 it needs jiter>=0.16, instructor <0.15.
REQUIREMENTS = ("openai==3.3.0", "litellm==1.110.2", "langchain-openai==1.8.1", "instructor==1.17.0")
PROBE = Path(__file__).with_name("client_libraries_probe.py")
INSTALL_TIMEOUT_S = 300  # 40 to 90 s here (2 shared cores)
PROBE_TIMEOUT_S = 600  # about 40 s here
PATHS = frozenset({"chat", "streaming", "structured output", "tool calling"})
# Each check of the probe and the paths it goes through: every library must cover all of PATHS.
CHECK_PATHS: dict[str, frozenset[str]] = {
    "openai_chat_and_stream": frozenset({"chat", "streaming"}),
    "openai_structured_output": frozenset({"structured output"}),
    "openai_tool_calls_and_the_next_turn": frozenset({"tool calling", "chat"}),
    "openai_streamed_tool_calls": frozenset({"tool calling", "streaming"}),
    "litellm_chat_and_stream": frozenset({"chat", "streaming"}),
    "litellm_structured_output": frozenset({"structured output"}),
    "litellm_tool_calls": frozenset({"tool calling", "streaming"}),
    "langchain_chat_and_stream": frozenset({"chat", "streaming"}),
    "langchain_structured_output": frozenset({"structured output", "tool calling"}),  # json_schema, function_calling
    "langchain_bind_tools": frozenset({"tool calling", "streaming"}),
    "instructor_tools_mode": frozenset({"tool calling", "streaming"}),  # create + create_partial
    "instructor_json_schema_mode": frozenset({"structured output", "chat"}),
}
LIBRARIES = ("openai", "litellm", "langchain", "instructor")
# The libraries never reach out: no model cost map or tokenizer download, no tracing.
OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1", "LANGSMITH_TRACING": "false",
               "LANGCHAIN_TRACING_V2": "false", "NO_PROXY": "127.0.0.1,localhost"}


def client_libraries_python() -> Path:
    """The python of a virtualenv holding :data:`REQUIREMENTS`, built on first use and kept.

    NOTE: a lock keeps two runs from building the same one; the ``installed`` marker, written last,
    keeps a half-built one (an interrupted run) from being used.

    Raises:
        pytest.skip.Exception: the libraries could not be installed (with pip's last lines).
    """
    key = hashlib.sha256(f"{sys.base_prefix} {sys.version} {' '.join(REQUIREMENTS)}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TOKENMILL_HOME") or Path.home() / ".cache" / "tokenmill") / "client-libraries"
    venv, marker = cache / key, cache / f"{key}.installed"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            shutil.rmtree(venv, ignore_errors=True)
            _install(venv)
            marker.write_text(" ".join(REQUIREMENTS))
    return venv / "bin" / "python"


def _install(venv: Path) -> None:
    """A fresh virtualenv at ``venv`` with :data:`REQUIREMENTS`; none left behind when that fails."""
    start = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *REQUIREMENTS],
                       check=True, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(venv, ignore_errors=True)
        pytest.skip(f"cannot install {' '.join(REQUIREMENTS)}: {(exc.stderr or exc.stdout)[-2000:]}")
    except subprocess.TimeoutExpired:
        shutil.rmtree(venv, ignore_errors=True)
        pytest.skip(f"installing {' '.join(REQUIREMENTS)} took over {INSTALL_TIMEOUT_S} s")
    print(f"installed {' '.join(REQUIREMENTS)} in {time.monotonic() - start:.0f} s")


@pytest.mark.timeout(INSTALL_TIMEOUT_S + PROBE_TIMEOUT_S + 120)
def test_client_libraries_chat_stream_structured_output_and_tools(redis_url: str, key_prefix: str,
                                                                  tmp_path: Path) -> None:
    python = client_libraries_python()
    settings = make_settings(redis_url, key_prefix, model=MODEL, engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "64MiB", "swap_space": 0}})
    report_path = tmp_path / "report.json"
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, **OFFLINE_ENV}
    with running_worker(settings), running_server(redis_url, key_prefix) as url:
        probe = subprocess.run([str(python), str(PROBE), url, MODEL, str(report_path)], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    assert probe.returncode == 0 and report_path.exists(), f"the probe failed:\n{probe.stdout[-3000:]}\n" \
                                                           f"{probe.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(report_path.read_text())
    print(json.dumps({"versions": report["versions"], "seconds": report["seconds"]}))
    assert set(report["checks"]) == set(CHECK_PATHS), "the probe's checks changed: update CHECK_PATHS"
    for library in LIBRARIES:
        covered = set().union(*(paths for name, paths in CHECK_PATHS.items() if name.startswith(f"{library}_")))
        assert covered == PATHS, f"{library} is not checked for {sorted(PATHS - covered)}"
    failed = {name: outcome for name, outcome in report["checks"].items() if outcome != "ok"}
    assert not failed, "\n\n".join(f"{name} failed:\n{outcome}" for name, outcome in failed.items())
