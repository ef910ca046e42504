"""A production install gets the C++ fast path: this checkout's sdist, the wheel built
from that sdist, installed into a fresh virtualenv, builds and loads every C++ extension from the
installed location (into TOKENMILL_HOME, nothing next to the sources), and a worker started from
that virtualenv says in its start-up log that it runs the C++ attention kernel and the native
decoder stack, then answers a request.

The sdist holds the checkout's part folders as they are and the wheel holds them inside tokenmill
(pyproject.toml's package-dir), each exactly the checkout's modules and package data (test_packaging.py
checks the other ways in: a clone without links, a plain checkout, an editable install, mypy).

The only guard against a wheel without its package data, so it runs in the normal suite. Its cost
is one build of the three extensions (about 40 s on 2 busy cores): a shared build cache would not
be safe, since ninja rebuilds whenever a source's path changes, and the installed sources' path
differs from the checkout's (both would keep rebuilding each other's binaries).

The new virtualenv reaches the project's dependencies (torch, transformers, ...) through a .pth
file, so nothing is downloaded; tokenmill itself comes from the wheel only: every command runs from
a temporary folder, so the checkout is not on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from ops.typecheck import package_files, package_modules
from tests.integration.packaging_helpers import FIND_MODULES, ROOT, build_env, copy_checkout, dependencies_venv, run
from tests.tiny_models import save_tiny_model
from tests.worker_helpers import enqueue
from tokenmill.engine.kernels import panel_linear
from tokenmill.engine.kernels.attention import cpu_kernel
from tokenmill.engine.kernels.cpp_build import CppExtension
from tokenmill.engine.model import native_decoder
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import decode_result

pytestmark = pytest.mark.timeout(900)

EXTENSIONS: dict[str, CppExtension] = {"attention": cpu_kernel._EXTENSION, "decoder_stack": native_decoder._EXTENSION,
                                       "panel_linear": panel_linear._EXTENSION}
# Run by the new virtualenv's interpreter: where tokenmill was imported from, where its extensions'
# sources are, and whether each builds and loads (all three build side by side).
PROBE = """
import json, torch
import tokenmill.engine as engine
from tokenmill.engine.kernels import cpu_linear, panel_linear
from tokenmill.engine.kernels.attention import cpu_kernel
from tokenmill.engine.model import native_decoder
extensions = {"attention": cpu_kernel._EXTENSION, "decoder_stack": native_decoder._EXTENSION,
              "panel_linear": panel_linear._EXTENSION}
for extension in extensions.values():
    extension.build_in_background()
from tokenmill.engine.spec import ngram
print(json.dumps({"engine": engine.__file__,
                  "sources": [str(p) for e in extensions.values() for p in (e.source, *e.headers)]
                             + [str(ngram._NATIVE_INDEX.source)],
                  "available": {**{name: e.is_available() for name, e in extensions.items()},
                                "ngram_index": ngram.native_index() is not None},
                  "panels_match_torch": cpu_linear.packing_works(torch.float32, cpu_linear.PANELS)}))
"""


def _csrc_files() -> set[str]:
    """Every C++ file of the engine, as the checkout holds it (``engine/...``; the package's ``tokenmill/engine/...``);
    each extension reads only these."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "engine").rglob("csrc/*") if p.suffix in (".cpp", ".h")}
    read = {p.resolve().relative_to(ROOT).as_posix() for e in EXTENSIONS.values() for p in (e.source, *e.headers)}
    assert read <= files and files, (read, files)
    return files


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


def _sdist_names(sdist_path: Path) -> set[str]:
    import tarfile

    with tarfile.open(sdist_path) as sdist:
        return {member.name.split("/", 1)[1] for member in sdist.getmembers() if "/" in member.name and member.isfile()}


def _wheel_names(wheel_path: Path) -> set[str]:
    import zipfile

    with zipfile.ZipFile(wheel_path) as wheel:
        return set(wheel.namelist())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sdist -> wheel -> a fresh virtualenv with only the wheel installed; its paths."""
    tmp = tmp_path_factory.mktemp("wheel-install")
    source, dist, env = tmp / "checkout", tmp / "dist", build_env(tmp)
    copy_checkout(source)
    sdist = Path(run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                      "print(b.build_sdist(sys.argv[1]))", str(dist)], source, env).split()[-1])
    wheel_dir = tmp / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(wheel_dir), str(dist / sdist)], tmp, env)
    (wheel,) = wheel_dir.glob("tokenmill-*.whl")
    environment = tmp / "venv"
    python, site_packages = dependencies_venv(environment)
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index",
         str(wheel)], tmp)
    return {"tmp": tmp, "checkout": source, "sdist": dist / sdist, "wheel": wheel, "venv": environment,
            "site_packages": site_packages}


def test_sdist_and_wheel_ship_every_cpp_source(installed: dict[str, Path]) -> None:
    wanted = _csrc_files()
    in_sdist, in_wheel = _sdist_names(installed["sdist"]), _wheel_names(installed["wheel"])
    assert wanted <= in_sdist, f"missing from the sdist: {sorted(wanted - in_sdist)}"
    in_wheel = {name.removeprefix("tokenmill/") for name in in_wheel}
    assert wanted <= in_wheel, f"missing from the wheel: {sorted(wanted - in_wheel)}"


def test_the_wheel_and_the_sdist_hold_the_checkouts_files(installed: dict[str, Path]) -> None:
    """No links and a package-dir mapping: the sdist holds the checkout's folders as they are (engine/...), the wheel
    holds them inside tokenmill (tokenmill/engine/...), each every module and data file of the checkout's packages
    and nothing else; the installed package finds every module in the wheel's copy, and those are the modules
    ops/typecheck.py gives mypy."""
    checkout = installed["checkout"]
    files = package_files(checkout)  # installed name -> the checkout's file
    assert any(name.endswith(".cpp") for name in files) and any(name.endswith(".html") for name in files)
    in_wheel = {name for name in _wheel_names(installed["wheel"]) if ".dist-info/" not in name}
    assert in_wheel == set(files), (sorted(in_wheel - set(files)), sorted(set(files) - in_wheel))
    folders = {path.relative_to(checkout).parts[0] for path in files.values()}
    assert folders == {"tokenmill", "protocol", "engine", "worker", "producer", "serve", "cli"}
    in_sdist = {name for name in _sdist_names(installed["sdist"]) if name.split("/")[0] in folders}
    from_checkout = {path.relative_to(checkout).as_posix() for path in files.values()}
    assert in_sdist == from_checkout, (sorted(in_sdist - from_checkout), sorted(from_checkout - in_sdist))
    modules = {name.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): name
               for name in package_files(checkout, data=False)}
    assert set(modules) == set(package_modules(checkout))
    found = json.loads(run([str(installed["venv"] / "bin" / "python"), "-c", FIND_MODULES, json.dumps(sorted(modules))],
                           installed["tmp"]))
    assert found == {module: str(installed["site_packages"] / name) for module, name in modules.items()}


def test_the_wheel_ships_the_dashboards_templates_and_static_files(installed: dict[str, Path]) -> None:
    """The dashboard has no build step and fetches nothing at run time: its templates, stylesheet and script are
    package data, and an installed server renders its pages from them."""
    import zipfile

    folder = ROOT / "serve" / "dashboard"
    wanted = {f"tokenmill/serve/dashboard/{p.relative_to(folder)}" for p in folder.rglob("*")
              if p.parent.name in ("templates", "static") and p.is_file()}
    assert any(name.endswith("dashboard.js") for name in wanted) and any(name.endswith(".html") for name in wanted)
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        in_wheel = set(wheel.namelist())
    assert wanted <= in_wheel, f"missing from the wheel: {sorted(wanted - in_wheel)}"
    python = installed["venv"] / "bin" / "python"
    rendered = run([str(python), "-c", "from tokenmill.serve.dashboard.views import templates; "
                     "print(templates.get_template('login.html').render(error=None, next='/dashboard', "
                     "url_for=lambda *a, **k: '/x'))"], installed["tmp"])
    assert 'name="key"' in rendered


def test_the_wheel_installs_one_top_level_package(installed: dict[str, Path]) -> None:
    """Five generic names (engine, worker, producer, cli, serve) would collide inside a web
    application's virtualenv: an install adds ``tokenmill`` and its metadata, nothing else."""
    import zipfile

    with zipfile.ZipFile(installed["wheel"]) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
        top_level = next(name for name in wheel.namelist() if name.endswith(".dist-info/top_level.txt"))
        assert wheel.read(top_level).decode().split() == ["tokenmill"]
    assert {top for top in tops if not top.endswith(".dist-info")} == {"tokenmill"}, sorted(tops)
    added = {path.name for path in installed["site_packages"].iterdir()
             if not path.name.endswith((".dist-info", ".pth")) and path.name != "__pycache__"}
    assert added == {"tokenmill"}, sorted(added)


def test_installed_worker_builds_and_runs_the_cpp_kernels(installed: dict[str, Path], tmp_path: Path,
                                                          redis_url: str, redis_client: redis.Redis,
                                                          key_prefix: str) -> None:
    environment, package = installed["venv"], installed["site_packages"] / "tokenmill" / "engine"
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    model = save_tiny_model("llama", tmp_path / "tiny-llama")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TOKENMILL_")},
           "TOKENMILL_HOME": str(home), "PATH": f"{environment / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    before = _tree(package)
    keys = Keys(key_prefix)
    request_id = enqueue(redis_client, keys, prompt="The quick brown fox", params={"max_tokens": 4})
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:  # a burst worker: serves the queued request, then exits
        worker = subprocess.Popen(
            [str(environment / "bin" / "tokenmill"), "--redis-url", redis_url, "--prefix", key_prefix, "worker",
             "--model", str(model), "--name", "wheel-worker", "--burst", "--log-json"],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            probe: dict[str, Any] = json.loads(run([str(environment / "bin" / "python"), "-c", PROBE], cwd, env,
                                                    timeout_s=600).splitlines()[-1])
            assert worker.wait(timeout=600) == 0, log_path.read_text()[-5000:]
        finally:
            worker.kill()
    assert Path(probe["engine"]).is_relative_to(environment), probe["engine"]  # tokenmill from the wheel only
    assert all(Path(p).is_relative_to(package) and Path(p).is_file() for p in probe["sources"]), probe["sources"]
    assert probe["available"] == dict.fromkeys([*EXTENSIONS, "ngram_index"], True), (probe,
                                                                                     log_path.read_text()[-5000:])
    assert probe["panels_match_torch"]
    # What an operator reads: the worker's start-up log names the fast path, and warns of nothing.
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    messages = [event["msg"] for event in events]
    assert "attention backend: cpu" in messages, messages
    assert any(m.startswith("decoder layers run natively (C++ stack") for m in messages), messages
    assert not [e for e in events if e["level"] == "WARNING" and "unavailable" in e["msg"]], messages
    result = decode_result(redis_client.get(keys.result(request_id)))  # type: ignore[arg-type]
    assert result.status == "ok" and result.usage.completion_tokens > 0, result
    # Built into TOKENMILL_HOME, one folder per extension; nothing written beside the installed sources.
    for extension in EXTENSIONS.values():
        (folder,) = (home / "torch_extensions").glob(f"{extension.name}-*")
        assert list(folder.glob("*.so")), sorted(_tree(folder))
    (folder,) = (home / "python_extensions").glob("tokenmill_ngram_index-*")  # the worker's and the probe's
    assert list(folder.glob("*.so")), sorted(_tree(folder))
    assert _tree(package) == before
