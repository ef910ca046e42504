"""``python -m tokenmill.cli``: the tokenmill command line (same as the ``tokenmill`` console script)."""

from tokenmill.cli.app import app

app()
