"""The echo model: the real engine (scheduler, block manager, prefix cache, output processor, stop
rules) over a step runner that needs no weights. Each request's output repeats its prompt.

For queue tests, benchmarks of the queue and smoke tests of a deployment: the worker drives it
exactly as it drives a model, so what they exercise is the scheduler production runs. Served as
``echo``, or ``echo:step_delay_s=0.004`` to sleep that long per step, standing in for a forward.
``echo:crash_on=TEXT`` is a test hook: a step that runs a prompt containing TEXT exits the process
(``os._exit(1)``, a crash no engine can contain); a name without it never crashes.

Token ids are the prompt's UTF-8 bytes (0..255); 256 is EOS. At output position ``i`` the runner
"samples" prompt byte ``i``; once the prompt has been echoed it samples EOS, so a request stops
after one echo, unless ``ignore_eos`` (or ``min_tokens`` not yet reached) makes it go round again,
up to ``max_tokens``. Stop strings, stop ids, ``min_tokens``, ``n``, priorities, preemption and
aborts all behave as they do on a model; a structured ``response_format`` is accepted and not
enforced (the answer is the prompt, which a test writes to match). Standard library only: no torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.clock import Clock
from tokenmill.engine.core.length_predictor import build_length_predictor
from tokenmill.engine.core.limits import ModelLimits
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.step_io import ModelOutput, ScheduledChunk, SchedulerOutput
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.kv.prefix_cache import PrefixCache
from tokenmill.engine.spec import build_speculator
from tokenmill.engine.spec.verification import accept_drafts
from tokenmill.protocol.sampling import ResponseFormat

ECHO_MODEL = "echo"
EOS_TOKEN_ID = 256
VOCAB_SIZE = 257
DEFAULT_MAX_MODEL_LEN = 2048


def is_echo_model(name: str) -> bool:
    """Whether a model name selects the echo model (``echo`` or ``echo:options``)."""
    return name == ECHO_MODEL or name.startswith(ECHO_MODEL + ":")


@dataclass(frozen=True)
class EchoOptions:
    """The echo model's options, from ``echo:step_delay_s=S`` (and the test hook ``crash_on=TEXT``)."""

    step_delay_s: float = 0.0  # sleep per step, standing in for a forward pass
    crash_on: str = ""  # test hook: a step running a prompt with this text exits the process; "" = never

    @classmethod
    def parse(cls, name: str) -> EchoOptions:
        """Options of an echo model name.

        Raises:
            ValueError: not an echo name, or an unknown or malformed option.
        """
        if not is_echo_model(name):
            raise ValueError(f"{name!r} is not an echo model")
        step_delay_s, crash_on = 0.0, ""
        for item in filter(None, name.removeprefix(ECHO_MODEL).removeprefix(":").split(",")):
            key, _, text = item.partition("=")
            if key == "step_delay_s":
                step_delay_s = float(text)
            elif key == "crash_on" and text:
                crash_on = text
            else:
                raise ValueError(f"unknown echo option {key!r} (the echo model takes step_delay_s, crash_on)")
        options = cls(step_delay_s, crash_on)
        if options.step_delay_s < 0:
            raise ValueError("echo options must be >= 0")
        return options


class ByteTokenizer:
    """The part of a Hugging Face tokenizer the engine uses, over UTF-8 bytes.

    Chat messages are their contents, one per line (the "chat template" of the echo model). The
    template takes ``tools`` and writes nothing of them, so a request with tools echoes what its
    messages say (a test writes the call it wants back) rather than a tools preamble.
    """

    eos_token_id = EOS_TOKEN_ID
    all_special_ids = [EOS_TOKEN_ID]
    added_tokens_decoder: dict[int, Any] = {EOS_TOKEN_ID: "</s>"}
    # NOTE: mentions "tools": engine/output/prompts.py then passes tools to the template (renders_tools)
    chat_template = "the contents of the messages, one per line; tools are taken and not written"

    def __call__(self, texts: list[str], add_special_tokens: bool = True, **kwargs: Any) -> dict[str, Any]:
        return {"input_ids": [list(text.encode()) for text in texts]}

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return "\n".join(str(m.get("content", "")) for m in messages)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        if EOS_TOKEN_ID not in token_ids:  # NOTE: every id a byte: one C call (decoded every step of a stream)
            return bytes(token_ids).decode("utf-8", errors="replace")
        eos = b"" if skip_special_tokens else b"</s>"
        return b"".join(bytes([t]) if t != EOS_TOKEN_ID else eos for t in token_ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token_id: int) -> str:
        """A byte's piece in SentencePiece's byte-fallback form (engine/output/logprobs.py reads it back)."""
        return "</s>" if token_id == EOS_TOKEN_ID else f"<0x{token_id:02X}>"


class EchoRunner:
    """Executes a step without a model: every chunk that samples gets its next echo token.

    Args:
        options: the pace, and the crash hook.
    """

    def __init__(self, options: EchoOptions) -> None:
        self.options = options
        self._crash_on = options.crash_on.encode()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        output = ModelOutput()
        if not scheduler_output.chunks:
            return output
        if self._crash_on and any(self._crash_on in _bytes(_prompt_of(chunk)) for chunk in scheduler_output.chunks):
            os._exit(1)  # NOTE: the test hook (crash_on): a crash that takes every request of the step along
        if self.options.step_delay_s:
            time.sleep(self.options.step_delay_s)
        sampled = output.sampled_token_ids
        for chunk in scheduler_output.chunks:
            if not chunk.needs_sample:
                continue
            # NOTE: with draft tokens, one "sampled" row per position, kept as a model's would be; a draft the
            # echo continues whole (one C comparison) is all kept, as accept_drafts would say.
            num_drafts = chunk.num_draft_tokens
            token_ids = echo_tokens(chunk, 1 + num_drafts)
            if num_drafts:
                draft_token_ids = chunk.token_ids[-num_drafts:]
                if token_ids[:num_drafts] != draft_token_ids:
                    token_ids = token_ids[:accept_drafts(draft_token_ids, token_ids)]
            sampled[chunk.request_id] = token_ids
            if chunk.sampling_params.logprobs is not None:
                # certain: each its own only alternative
                output.logprobs[chunk.request_id] = [{token_id: 0.0} for token_id in token_ids]
        return output


class AnyGrammar:
    """Structured output on the echo model: every ``response_format`` is accepted and not enforced."""

    def compile(self, response_format: ResponseFormat) -> None:
        """Nothing to compile: the echo model's answer is its prompt."""


def echo_tokens(chunk: ScheduledChunk, num_rows: int) -> list[int]:
    """The tokens at the chunk's next ``num_rows`` output positions: :func:`echo_token` of each, the prompt's
    bytes taken by a slice while the prompt lasts (the echo stands in for a device: its own time should not
    count as the engine's)."""
    state = chunk.sampling_state
    prompt = state.prompt_token_ids if state is not None else _prompt_of(chunk)  # NOTE: _prompt_of raises there
    start, num_prompt = chunk.num_output_tokens, len(prompt)
    if start + num_rows <= num_prompt:
        return prompt[start:start + num_rows]
    if num_rows <= num_prompt and chunk.sampling_params.ignore_eos:  # round the prompt again, and again
        offset = start % num_prompt
        end = offset + num_rows
        return prompt[offset:end] if end <= num_prompt else prompt[offset:] + prompt[:end - num_prompt]
    return [echo_token(chunk, position) for position in range(start, start + num_rows)]


def echo_token(chunk: ScheduledChunk, position: int) -> int:
    """The token at an output position of the chunk's request: the prompt's byte there, or EOS once
    it was echoed."""
    prompt = _prompt_of(chunk)
    params = chunk.sampling_params
    if position < len(prompt) or params.ignore_eos or params.is_min_tokens_active(position):
        return prompt[position % len(prompt)]
    return EOS_TOKEN_ID


def _prompt_of(chunk: ScheduledChunk) -> list[int]:
    if chunk.sampling_state is None:
        raise ValueError(f"{chunk.request_id}: the echo runner needs the request's tokens (sampling_state)")
    return chunk.sampling_state.prompt_token_ids


def _bytes(token_ids: list[int]) -> bytes:
    return bytes(t % 256 for t in token_ids)  # NOTE: EOS (256) may be given in a prompt of token ids


@dataclass
class EchoParts:
    """What the echo model's engine is made of (the torch-free counterpart of model_setup's parts)."""

    scheduler: Scheduler
    runner: EchoRunner
    tokenizer: ByteTokenizer
    limits: ModelLimits
    grammars: AnyGrammar


def build_echo_parts(config: EngineConfig, clock: Clock) -> EchoParts:
    """The engine's parts for an echo model name.

    The block pool holds every running request at full length (``max_num_seqs`` x ``max_model_len``),
    so the echo model never preempts for memory unless ``[engine.cache] kv_cache_memory`` is set: then
    it counts one byte per token, a way to exercise preemption (and swap, into a host pool as large)
    without a model.

    Raises:
        ValueError: a malformed echo name.
    """
    options = EchoOptions.parse(config.model.name)
    max_model_len = config.model.max_model_len or DEFAULT_MAX_MODEL_LEN
    block_size = config.cache.block_size
    blocks_per_request = -(-max_model_len // block_size)
    budget = config.cache.kv_cache_bytes
    num_gpu_blocks = (budget // block_size if budget is not None
                      else config.scheduler.max_num_seqs * blocks_per_request + 1)
    prefix_cache = PrefixCache(block_size) if config.cache.enable_prefix_caching else None
    block_manager = BlockManager(num_gpu_blocks, num_gpu_blocks, block_size, prefix_cache)  # NOTE: a swap pool as large
    if config.speculative.method == "draft":
        raise ValueError("the echo model has no draft model: [engine.speculative] method 'draft' needs a real model")
    scheduler = Scheduler(config.scheduler, block_manager, clock, frozenset({EOS_TOKEN_ID}), max_model_len,
                          prefix_cache, build_speculator(config.speculative), build_length_predictor(config.length))
    num_tokens = num_gpu_blocks * block_size
    limits = ModelLimits(model_name=ECHO_MODEL, source=ECHO_MODEL, vocab_size=VOCAB_SIZE,
                         max_request_tokens=min(max_model_len, num_tokens), is_cache_bound=num_tokens < max_model_len,
                         kv_block_bytes=block_size)  # NOTE: one byte per token
    return EchoParts(scheduler, EchoRunner(options), ByteTokenizer(), limits, AnyGrammar())
