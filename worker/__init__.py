"""The tokenmill worker: Redis Streams to one engine and back. Nothing imports this package."""
