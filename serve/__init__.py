"""``tokenmill serve``: an OpenAI-compatible HTTP front (chat, completions, streaming, models, Files,
Batches) that feeds the queue like any other producer, so it scales by running more of it.

Imports producer, fastapi and uvicorn; never torch, the engine, the worker or the cli.
"""

if __name__ != "tokenmill.serve":  # the folder under its bare name would be a second copy of each module
    raise ImportError(f"{__file__} is tokenmill.serve: import it by that name, not as {__name__!r}",
                      name=__name__)
