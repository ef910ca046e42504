"""The Makefile's browser step (``make chromium``, part of ``make install``): two checkouts installing at once on one
machine take turns on apt instead of the second failing on dpkg's lock, and the second finds the browser the first
installed. Run with a stand-in ``apt-get`` (on PATH before the real one) that records when it ran and "installs" a
``chromium`` after a pause; ``id`` answers root so the step runs as it does in CI."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ops_helpers import ROOT

FAKE_APT = """#!/bin/sh
echo "start $* $(date +%s.%N)" >> "{log}"
if [ -e "{bin}/apt.lock" ]; then echo "overlapping apt runs" >> "{log}"; exit 100; fi
touch "{bin}/apt.lock"
sleep 0.5
case "$*" in *install*) printf '#!/bin/sh\\n' > "{bin}/chromium"; chmod +x "{bin}/chromium";; esac
rm -f "{bin}/apt.lock"
echo "end $*" >> "{log}"
"""


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("flock") is None, reason="needs make and flock")
def test_two_installs_at_once_take_turns_on_apt_and_the_second_finds_the_browser(tmp_path: Path) -> None:
    bin_dir, log = tmp_path / "bin", tmp_path / "apt.log"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT.format(log=log, bin=bin_dir))
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    for tool in ("apt-get", "id"):
        (bin_dir / tool).chmod(0o755)
    for tool in ("sh", "flock", "make", "date", "sleep", "touch", "rm", "chmod", "printf", "cat"):
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    # NOTE: only the stand-ins and the tools the recipe runs: no real chromium, no real apt-get on this PATH
    env = {**os.environ, "PATH": str(bin_dir)}
    lock = tmp_path / "apt-turns.lock"
    makefile = (ROOT / "Makefile").read_text().replace("/tmp/tokenmill-apt.lock", str(lock))
    (tmp_path / "Makefile").write_text(makefile)
    runs = [subprocess.Popen(["make", "-s", "chromium"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=60)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    lines = log.read_text().splitlines()
    assert "overlapping apt runs" not in lines
    # one checkout updated and installed; the other waited its turn and found chromium there
    assert sum(line.startswith("end") and line.endswith("install -y --no-install-recommends chromium")
               for line in lines) == 1
    assert "DPkg::Lock::Timeout=600" in lines[0]
