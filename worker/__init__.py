"""The tokenmill worker: Redis Streams to one engine and back. Only the cli imports it, inside its commands."""
