"""The tokenmill worker: Redis Streams to one engine and back. Only the cli imports it, inside its commands."""

if __name__ != "tokenmill.worker":  # the folder under its bare name would be a second copy of each module
    raise ImportError(f"{__file__} is tokenmill.worker: import it by that name, not as {__name__!r}",
                      name=__name__)
