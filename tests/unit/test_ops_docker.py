"""The Docker images and compose file under ops/docker, checked structurally: this machine has no
Docker engine, so nothing here builds or runs an image (docs/operations.md says so). What is
checked: every COPY source exists and survives the repository's .dockerignore, the install has the
extras the commands need (serve among them) and the compilers the kernels need, every command line
is one the CLI takes with settings that load, and compose's services, volumes and model paths agree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops_helpers import (
    PYPROJECT,
    ROOT,
    assert_cli_accepts,
    assert_settings_take,
    command_line,
    dockerfile,
    dockerignored,
    interpolate,
    option,
    package_files,
    settings_class,
)
from tokenmill.engine.model.model_loader import MODEL_ALIASES

DOCKER = ROOT / "ops" / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
COMPOSE_ENV = {"TOKENMILL_REDIS_PASSWORD": "secret"}  # what `up` needs set; the rest have defaults


def _instructions(name: str, keyword: str) -> list[str]:
    return [arguments for key, arguments in dockerfile(DOCKER / name) if key == keyword]


def _json_list(arguments: str) -> list[str]:
    return list(yaml.safe_load(arguments))  # exec form: a JSON list, which YAML reads too


def _apt_packages(name: str) -> set[str]:
    runs = " && ".join(_instructions(name, "RUN"))
    return {word for command in re.findall(r"apt-get install ([^&]+)", runs) for word in command.split()
            if not word.startswith("-")}


def _container_path(name: str, path: str) -> Path:
    """Where a path inside the image comes from in the checkout (WORKDIR + ``COPY . .``)."""
    (workdir,) = _instructions(name, "WORKDIR")
    assert path.startswith(workdir + "/"), f"{path} is not under the WORKDIR {workdir}"
    return ROOT / path.removeprefix(workdir + "/")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_sources_exist_and_survive_the_dockerignore(name: str) -> None:
    ignore = ROOT / ".dockerignore"  # the context is the repository (compose: context ../..)
    copies = [arguments.split() for arguments in _instructions(name, "COPY")]
    assert copies, "the image copies nothing"
    for *sources, _destination in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not dockerignored(ignore, source) or source == ".", f"COPY {source}: excluded by {ignore.name}"
    # What the package install and the command read is copied and in the context ...
    (command,) = _instructions(name, "CMD")
    config = _container_path(name, option(_json_list(command), "--config") or "")
    needed = [*package_files(), str(config.relative_to(ROOT))]
    assert any(f.endswith(".cpp") for f in needed) and any(f.startswith("serve/") for f in needed)
    sources = [source.rstrip("/") for *sources, _destination in copies for source in sources]
    assert [f for f in needed if not any(s in (".", f) or f.startswith(s + "/") for s in sources)] == []
    assert [f for f in needed if dockerignored(ignore, f)] == []
    # ... and the checkout's bulk is not.
    for heavy in (".venv/lib/site.py", ".git/HEAD", "tests/tiny_models.py", "engine/__pycache__/x.pyc"):
        assert dockerignored(ignore, heavy), heavy


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_install_has_the_serve_extra_and_the_compilers(name: str) -> None:
    runs = " ".join(_instructions(name, "RUN"))
    (extras,) = re.findall(r'pip install "\.\[([a-z,]+)\]"', runs)
    assert {"engine", "serve"} <= set(extras.split(",")) <= set(PYPROJECT["project"]["optional-dependencies"])
    packages = _apt_packages(name)
    assert {"g++", "ninja-build"} <= packages  # engine/kernels/cpp_build.py: the C++ CPU kernels
    if name == "Dockerfile.cuda":  # Triton compiles its launchers (C, including Python.h) at run time
        (base,) = _instructions(name, "FROM")
        assert "-devel" in base or {"gcc", "python3-dev"} <= packages, (base, packages)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_entrypoint_and_command_are_real(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (entrypoint,) = _instructions(name, "ENTRYPOINT")
    assert _json_list(entrypoint) == ["tokenmill"] and "tokenmill" in PYPROJECT["project"]["scripts"]
    args = _json_list(_instructions(name, "CMD")[0])
    command = assert_cli_accepts(args)
    config = _container_path(name, option(args, "--config") or "")
    assert_settings_take(settings_class(command), config, {}, monkeypatch)
    # the image's user owns TOKENMILL_HOME (kernel builds, GGUF cache) and /models
    (env,) = _instructions(name, "ENV")
    home = re.search(r"TOKENMILL_HOME=(\S+)", env)
    assert home is not None and f"--home-dir {home.group(1)} tokenmill" in " ".join(_instructions(name, "RUN"))
    assert _instructions(name, "USER") == ["tokenmill"]


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return compose


def _tokenmill_services() -> dict[str, dict[str, Any]]:
    return {name: service for name, service in _compose()["services"].items()
            if str(service.get("image", "")).startswith("tokenmill:")}


def test_compose_builds_every_tokenmill_image_from_a_real_dockerfile() -> None:
    services = _tokenmill_services()
    assert {"worker", "serve", "model-download"} <= set(services)
    for name, service in services.items():  # each has its build, so `up --build` never pulls a tokenmill image
        build = service["build"]
        assert (DOCKER / build["context"]).resolve() == ROOT, name
        assert (ROOT / build["dockerfile"]).is_file() and Path(build["dockerfile"]).name in DOCKERFILES, name


@pytest.mark.parametrize("name", ["worker", "serve"])
def test_compose_commands_are_real_and_their_settings_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = _tokenmill_services()[name]
    assert "entrypoint" not in service  # the image's: tokenmill
    args = [interpolate(arg, COMPOSE_ENV) for arg in command_line(service["command"])]
    command = assert_cli_accepts(args)
    assert command == name
    dockerfile_name = Path(service["build"]["dockerfile"]).name
    config = _container_path(dockerfile_name, option(args, "--config") or "")
    env = {key: interpolate(str(value), COMPOSE_ENV) for key, value in service["environment"].items()}
    settings = assert_settings_take(settings_class(command), config, env, monkeypatch)
    assert settings.redis.url == "redis://:secret@redis:6379/0" and settings.queue.name == "default"
    if name == "serve":  # it listens on every interface of its container, on the port compose publishes
        assert option(args, "--host") == "0.0.0.0"
        assert service["ports"] == [f"127.0.0.1:{option(args, '--port')}:{option(args, '--port')}"]


def test_compose_volumes_are_declared_and_bind_mounts_exist() -> None:
    compose = _compose()
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source}"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"


def _mount(service: dict[str, Any], volume: str) -> tuple[str, bool]:
    """Where ``volume`` is mounted in ``service`` and whether read-only."""
    (spec,) = [v for v in service["volumes"] if v.split(":")[0] == volume]
    _source, target, *mode = spec.split(":")
    return target, mode == ["ro"]


def test_compose_model_download_fills_the_volume_the_workers_read(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _tokenmill_services()
    worker, download = services["worker"], services["model-download"]
    # the default needs no download: an alias bundled in the image
    model = interpolate(worker["environment"]["TOKENMILL_ENGINE__MODEL__NAME"], COMPOSE_ENV)
    assert model in MODEL_ALIASES
    # a downloaded one: `hf download ID --local-dir /models/ID` into the volume the workers mount
    assert download["entrypoint"] == ["hf"] and download["profiles"] == ["download"]
    model_id = "HuggingFaceTB/SmolLM2-360M-Instruct"
    args = [interpolate(arg, {"TOKENMILL_MODEL_ID": model_id}) for arg in command_line(download["command"])]
    assert args == ["download", model_id, "--local-dir", f"/models/{model_id}"]
    assert _mount(download, "models") == ("/models", False)
    assert _mount(worker, "models") == ("/models", True)
    # and TOKENMILL_MODEL points the workers at it
    env = {key: interpolate(str(value), {**COMPOSE_ENV, "TOKENMILL_MODEL": f"/models/{model_id}"})
           for key, value in worker["environment"].items()}
    settings = assert_settings_take(settings_class("worker"), ROOT / "configs" / "cpu-small.toml", env, monkeypatch)
    assert settings.engine.model.name == f"/models/{model_id}"  # type: ignore[attr-defined]


def _image_env(name: str) -> dict[str, str]:
    """The image's ENV, as name -> value (``ENV A=1 B=2``)."""
    (env,) = _instructions(name, "ENV")
    return dict(pair.split("=", 1) for pair in env.split())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_a_published_metrics_port_reaches_the_worker(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``docker run -p 9100:9100`` (the header's) reaches the container's interface, never its loopback: the
    image makes the worker's /metrics listen on every interface of its container, on the port it exposes."""
    args = _json_list(_instructions(name, "CMD")[0])
    port = option(args, "--metrics-port")
    assert port is not None and port in _instructions(name, "EXPOSE")[0].split()
    assert re.search(rf"docker run .*-p {port}:{port}", " ".join((DOCKER / name).read_text().split("\\\n")))
    env = {key: value for key, value in _image_env(name).items() if key.startswith("TOKENMILL_WORKER__")}
    config = _container_path(name, option(args, "--config") or "")
    settings = assert_settings_take(settings_class("worker"), config, env, monkeypatch)
    assert settings.worker.metrics_host == "0.0.0.0"  # type: ignore[attr-defined]


def test_compose_publishes_every_port_on_the_host_loopback_only() -> None:
    """Redis, the API, Prometheus and Grafana (admin / admin) are reachable from the host alone, as the
    file's header says: no published port binds every interface."""
    published = {name: service["ports"] for name, service in _compose()["services"].items() if "ports" in service}
    assert {"redis", "serve", "prometheus", "grafana"} <= set(published)
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    header = " ".join(line.lstrip("# ") for line in (DOCKER / "compose.yaml").read_text().splitlines()
                      if line.startswith("#"))
    assert "Prometheus and Grafana are published on the host's loopback only" in header
