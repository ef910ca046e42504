"""The ``tokenmill`` typer app with every command registered (the console script's entry point)."""

# NOTE: importing each command module registers its commands on ``app``.
from tokenmill.cli import (  # noqa: F401 - see NOTE
    bulk,
    client,
    dashboard_command,
    redis_server,
    serve_command,
    worker_commands,
)
from tokenmill.cli.common import app

__all__ = ["app"]
