"""The OpenAI API's request and response shapes over the tokenmill wire schema, shared by bulk jobs
and ``tokenmill serve``. Pure translation: no I/O; never imports torch, the engine or the worker."""

from tokenmill.producer.openai_compat.bodies import ENDPOINTS, Endpoint, ParsedBody, parse_body
from tokenmill.producer.openai_compat.errors import BodyError
from tokenmill.producer.openai_compat.objects import completion_object, error_object, result_error

__all__ = ["ENDPOINTS", "BodyError", "Endpoint", "ParsedBody", "completion_object", "error_object", "parse_body",
           "result_error"]
