"""tokenmill's client library: wire schema, key layout, Producer / AsyncProducer, embedded Redis.

Never imports torch, transformers, the engine or the worker.
"""

from producer.aio import AsyncProducer
from producer.client import Producer
from producer.common import SubmitOptions
from producer.config import ProducerConfig, QueueConfig, RedisConfig
from producer.connection import aconnect, connect
from producer.errors import JobFailed, ProducerError, RedisUnavailable, ResultTimeout, SchemaError, SubmitUncertain
from producer.keys import Keys
from producer.schema import GenerationRequest, GenerationResult, Message, SamplingParams

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
    "SamplingParams",
    "SchemaError",
    "SubmitOptions",
    "SubmitUncertain",
    "aconnect",
    "connect",
]
