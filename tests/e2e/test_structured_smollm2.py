"""Structured output on the real SmolLM2-135M-Instruct: 200 generations under a JSON schema (typed
fields and an enum), greedy, in one batch: every one parses and validates with ``jsonschema``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.engine_helpers import build_engine
from tokenmill.engine import ChatPrompt
from tokenmill.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_GENERATIONS = 200
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "angry", "calm"]},
        "likes_tea": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "likes_tea"],
    "additionalProperties": False,
}
_PEOPLE = ["a pirate", "a tired nurse", "a chess champion", "a shy baker", "an astronaut", "a grumpy cat owner",
           "a retired teacher", "a street musician", "a young gardener", "a night-shift guard"]
_PLACES = ["in Lisbon", "on a train", "at a wedding", "in the rain", "after a long exam",
           "on a mountain", "at the market", "in a library", "at midnight", "by the sea"]


@pytest.mark.timeout(900)  # ~2 min on an idle 2-core machine; shared CI machines are slower
def test_200_generations_follow_the_json_schema() -> None:
    engine = build_engine("smollm2-135m", device="cpu", kv_cache_memory="1GiB", max_num_seqs=NUM_GENERATIONS,
                          max_num_batched_tokens=2048, max_prefill_chunk=2048)
    prompts = [ChatPrompt([{"role": "user", "content": f"{verb} {person} {place} as a JSON object with their "
                                                        "name, age, mood and whether they like tea."}])
               for verb in ("Describe", "Invent") for person in _PEOPLE for place in _PLACES]
    params = SamplingParams(max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    outputs = engine.generate(prompts, params, progress=False)
    assert len(outputs) == NUM_GENERATIONS
    for out in outputs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in outputs}) > NUM_GENERATIONS // 4  # the prompts shape the answers
