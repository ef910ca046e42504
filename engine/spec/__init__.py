"""Speculative decoding's proposers and policy (the core's :class:`Speculator`): draft tokens from a
request's own tokens (n-gram lookup), from earlier outputs (the suffix pool) or from a draft model,
and how many each request drafts this step, from its acceptance and the measured cost of a step.
No torch here (the draft model's proposer lives in engine/model/)."""

from tokenmill.engine.spec.speculator import build_speculator

__all__ = ["build_speculator"]
