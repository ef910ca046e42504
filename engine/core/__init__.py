"""The engine's torch-free core: requests and their states, the scheduler (its step plan, ordering
policy, preemption and queues), what a step runs and returns, statistics, clock and limits.
Imports the standard library, pydantic, protocol/ and engine/kv only; never torch or a tokenizer."""
