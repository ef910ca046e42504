"""``tokenmill serve``: an OpenAI-compatible HTTP front (chat, completions, streaming, models, Files,
Batches) that feeds the queue like any other producer, so it scales by running more of it.

Imports producer, fastapi and uvicorn; never torch, the engine, the worker or the cli.
"""
