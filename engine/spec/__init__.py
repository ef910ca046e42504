"""Speculative decoding: the proposers and the policy behind the core's :class:`Speculator`, and the rule
that verifies a draft. Draft tokens come from a request's own tokens (n-gram lookup), from earlier outputs
(the suffix pool), from what a structured request's grammar forces, or from a draft model; how many each
request drafts this step follows from its acceptance and the measured cost of a step; a verified draft keeps
the tokens up to the first the model did not sample (verification.py).

The draftless proposers, the goodput rule and the verification rule load without torch; the draft model's
proposer (draft_model.py) and the grammar-forced one (grammar_drafts.py, through the sampler's grammar
matchers) import torch, and are built by engine/model/model_setup.py, which hands in the loaded models."""

from tokenmill.engine.spec.speculator import build_speculator

__all__ = ["build_speculator"]
