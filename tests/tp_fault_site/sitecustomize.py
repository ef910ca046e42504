"""Imported by every Python process started with this folder on PYTHONPATH (tests/tp_faults.py): a tensor-parallel
follower of a fault test installs the fault its environment names. Test-only; the engine never sees this folder."""

import os

if os.environ.get("TOKENMILL_TEST_TP_FAULT"):
    from tests.tp_faults import install_from_env

    install_from_env()
