"""``python -m cli``: the tokenmill command line (same as the ``tokenmill`` console script)."""

from cli.app import app

app()
