"""``python -m worker``: the tokenmill CLI (same as the ``tokenmill`` console script)."""

from worker.cli import app

app()
