"""Fixtures for end-to-end tests: tiny model directories built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import FAMILIES, save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved float64 tiny model per family."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: save_tiny_model(family, root / family, dtype=torch.float64) for family in FAMILIES}
