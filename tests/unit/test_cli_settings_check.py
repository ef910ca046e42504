"""Client commands refuse a settings file the worker refuses, the way the worker does: every section
checked against the worker's schema (sections a client never reads too), the nearest known key
suggested, exit 1; without loading torch. No Redis: the check comes before any connect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenmill.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
DOWN_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
CLIENT_COMMANDS = [["status"], ["submit", "hi", "--no-wait"], ["result", "some-id"], ["cancel", "some-id"],
                   ["dead"], ["bulk", "in.jsonl", "out.jsonl"], ["demo"]]
TYPOS = [  # (file, the worker's suggestion)
    ("[worker]\nmax_wating = 3\n", "did you mean 'worker.max_waiting'?"),
    ("[engine.scheduler]\nmax_num_seq = 4\n", "did you mean 'engine.scheduler.max_num_seqs'?"),
    ("[engine.model]\ndevise = 'cpu'\n", "did you mean 'engine.model.device'?"),
    ("[engine.cache]\nkv_cache_memroy = '1GiB'\n", "did you mean 'engine.cache.kv_cache_memory'?"),
    ("[serve]\nprot = 8001\n", "did you mean 'serve.port'?"),
]


def _invoke(config: Path, command: list[str]) -> tuple[int, str]:
    outcome = runner.invoke(app, ["--config", str(config), "--redis-url", DOWN_URL, *command],
                            env={"COLUMNS": "200", "TOKENMILL_REDIS__CONNECT_RETRIES": "0"})
    return outcome.exit_code, outcome.output


@pytest.mark.parametrize("command", CLIENT_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize(("text", "suggestion"), TYPOS, ids=[s.split("'")[1] for _, s in TYPOS])
def test_a_client_command_refuses_a_typo_in_any_section_as_the_worker_does(
        command: list[str], text: str, suggestion: str, tmp_path: Path) -> None:
    config = tmp_path / "deploy.toml"
    config.write_text(text)
    code, output = _invoke(config, command)
    assert code == 1 and suggestion in output, output
    worker_code, worker_output = _invoke(config, ["worker", "--model", "echo"])
    assert (worker_code, worker_output) == (code, output)  # the same verdict, word for word


def test_a_bad_value_in_a_section_the_client_never_reads_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "deploy.toml"
    config.write_text("[engine.scheduler]\nmax_num_seqs = 0\n")
    code, output = _invoke(config, ["status"])
    assert code == 1 and "engine.scheduler.max_num_seqs" in output, output


def test_a_whole_valid_deployment_file_passes_to_the_redis_connect(tmp_path: Path) -> None:
    """configs/default.toml (every key) is fine for clients: the command gets as far as Redis."""
    code, output = _invoke(ROOT / "configs" / "default.toml", ["status"])
    assert code == 1 and "could not reach Redis" in output and "invalid" not in output, output


def test_the_check_loads_no_torch(tmp_path: Path) -> None:
    config = tmp_path / "deploy.toml"
    config.write_text("[engine.scheduler]\nmax_num_seq = 4\n")
    code = ("import sys; from typer.testing import CliRunner; from tokenmill.cli.app import app; "
            f"out = CliRunner().invoke(app, ['--config', {str(config)!r}, 'status']); "
            "print(out.exit_code, 'max_num_seqs' in out.output, "
            "sorted({'torch', 'transformers'} & set(sys.modules)))")
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert ran.stdout.strip().split(maxsplit=2) == ["1", "True", "[]"], ran.stdout + ran.stderr
