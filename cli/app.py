"""The ``tokenmill`` typer app with every command registered (the console script's entry point)."""

# NOTE: importing each command module registers its commands on ``app``.
from tokenmill.cli import bulk, client, redis_server, serve_command, worker_commands  # noqa: F401 - see NOTE
from tokenmill.cli.common import app

__all__ = ["app"]
