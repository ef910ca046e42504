"""The goodput rule's lengths as the greedy rule gives them, for tests that state them per request."""

from __future__ import annotations

from tokenmill.engine.spec.draft_length import StepCost, choose_draft_lengths


def draft_lengths(proposals: list[tuple[str, int, float]], num_tokens_left: int, num_scheduled_tokens: int,
                  num_decodes: int, cost: StepCost) -> dict[str, int]:
    """:func:`choose_draft_lengths` over ``(request id, draft tokens proposed, acceptance rate)`` triples, with its
    "every proposed token" (None) spelt out per request; drafts of no token are left out first, as the speculator
    never passes one."""
    drafted = [(request_id, num_proposed, rate) for request_id, num_proposed, rate in proposals if num_proposed > 0]
    chosen = choose_draft_lengths([request_id for request_id, _, _ in drafted], [n for _, n, _ in drafted],
                                  [rate for _, _, rate in drafted], num_tokens_left, num_scheduled_tokens, num_decodes,
                                  cost)
    return {request_id: num_proposed for request_id, num_proposed, _ in drafted} if chosen is None else chosen
