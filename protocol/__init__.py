"""The vocabulary every part of tokenmill speaks: sampling parameters and response formats, finish
reasons, error codes, token logprobs, worker heartbeats, the log line. Pydantic and msgpack only, so the engine,
the worker, the producer, serve and the CLI can all import it (it imports none of them).
"""

if __name__ != "tokenmill.protocol":  # the folder under its bare name would be a second copy of each module
    raise ImportError(f"{__file__} is tokenmill.protocol: import it by that name, not as {__name__!r}",
                      name=__name__)

from tokenmill.protocol.heartbeat import STALE_AFTER_S, Heartbeat
from tokenmill.protocol.outcomes import ErrorCode, FinishReason, TokenLogprob, TopLogprob
from tokenmill.protocol.sampling import MAX_SAMPLES, JsonSchemaSpec, ResponseFormat, SamplingParams

__all__ = [
    "MAX_SAMPLES",
    "STALE_AFTER_S",
    "ErrorCode",
    "FinishReason",
    "Heartbeat",
    "JsonSchemaSpec",
    "ResponseFormat",
    "SamplingParams",
    "TokenLogprob",
    "TopLogprob",
]
