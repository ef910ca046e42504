"""A real Chromium for the dashboard's browser tests: Debian's ``chromium`` driven through Playwright's Python API
(Playwright's own browser downloads are never used: fleets and CI run offline).

Outside CI a machine without chromium or playwright skips those tests, saying why; in CI (``CI=true``) it fails
them: the Makefile installs both, so their absence there is a broken install, not a reason to skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")
SCREENSHOTS_ENV = "TOKENMILL_SCREENSHOTS_DIR"  # also write each view's screenshot there (docs/ for the README)


def chromium_path() -> str:
    """The machine's chromium; skips (fails in CI) when there is none or playwright is missing."""
    path = next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)
    reason = None
    if path is None:
        reason = "no chromium on this machine (apt-get install chromium; `make install` does it)"
    try:
        import playwright.sync_api  # noqa: F401 - only whether it imports
    except ImportError:
        reason = "playwright is not installed (pip install 'tokenmill[dev]')"
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"browser tests must run in CI: {reason}")
        pytest.skip(reason)
    assert path is not None
    return path


def screenshot(page: Any, folder: Path, name: str) -> Path:
    """Save the page (whole) as ``folder/name.png``, and into ``$TOKENMILL_SCREENSHOTS_DIR`` when set."""
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    extra = os.environ.get(SCREENSHOTS_ENV)
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(extra) / path.name)
    return path
