"""The ``tokenmill`` command line: thin typer commands over the producer and the worker.

Imports producer; imports worker only inside the ``worker`` and ``demo`` commands. Nothing imports cli.
"""

if __name__ != "tokenmill.cli":  # the folder under its bare name would be a second copy of each module
    raise ImportError(f"{__file__} is tokenmill.cli: import it by that name, not as {__name__!r}",
                      name=__name__)
