"""The ``tokenmill`` typer app with every command registered (the console script's entry point)."""

from cli import bulk, client, redis_server, serve_command, worker_commands  # noqa: F401 - importing registers the commands
from cli.common import app

__all__ = ["app"]
