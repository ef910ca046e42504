"""The ``tokenmill`` command line: thin typer commands over the producer and the worker.

Imports producer; imports worker only inside the ``worker`` and ``demo`` commands. Nothing imports cli.
"""
