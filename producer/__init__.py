"""tokenmill's client library: Producer / AsyncProducer, and the names a caller of them needs (the wire schema,
the key layout, the settings, the errors, ``connect`` / ``aconnect``), lent from their homes in protocol/ where they
live there (``RedisUnavailable`` is protocol.errors', the connection factory protocol.connection's).

Never imports torch, transformers, the engine or the worker.
"""

if __name__ != "tokenmill.producer":  # the folder under its bare name would be a second copy of each module
    raise ImportError(f"{__file__} is tokenmill.producer: import it by that name, not as {__name__!r}",
                      name=__name__)

from tokenmill.producer.aio import AsyncProducer
from tokenmill.producer.client import Producer
from tokenmill.producer.config import ProducerConfig
from tokenmill.producer.errors import JobFailed, ResultTimeout, SubmitUncertain
from tokenmill.producer.submit_options import SubmitOptions
from tokenmill.protocol.config import QueueConfig, RedisConfig
from tokenmill.protocol.connection import aconnect, connect
from tokenmill.protocol.errors import ProducerError, RedisUnavailable, SchemaError
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationRequest, GenerationResult, Message

__all__ = [
    "AsyncProducer",
    "GenerationRequest",
    "GenerationResult",
    "JobFailed",
    "Keys",
    "Message",
    "Producer",
    "ProducerConfig",
    "ProducerError",
    "QueueConfig",
    "RedisConfig",
    "RedisUnavailable",
    "ResultTimeout",
    "SchemaError",
    "SubmitOptions",
    "SubmitUncertain",
    "aconnect",
    "connect",
]
