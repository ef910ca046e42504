"""Which tokens of a verified draft a request keeps: the acceptance rule of speculative decoding.

A decoding request with draft tokens ``d1..dk`` runs one chunk ``[x, d1..dk]`` (``x`` its newest
token): one forward writes their KV and gives a next-token distribution after each of them. The
runner samples every one of those rows exactly as it samples a plain decode (the same sampler, the
same per-position seeds), and the request keeps the rows' tokens up to the first that differs from
the draft. For greedy rows this is the longest prefix whose argmax matches plus the bonus token; for
sampled rows it is rejection sampling of a deterministic draft: the draft token is accepted with
probability ``p(d)``, and a rejected position keeps a token drawn from ``p`` without ``d`` -- so
every kept token follows the target distribution, whatever the draft. Standard library only.
"""

from __future__ import annotations


def accept_drafts(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many rows' tokens a request keeps: the sampled rows up to and including the first that is
    not the draft's token there (all ``k + 1`` when every draft token matched).

    Args:
        draft_token_ids: the ``k`` draft tokens the chunk ran.
        sampled_token_ids: the ``k + 1`` tokens sampled after ``x, d1, .., dk``.
    """
    if len(sampled_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"{len(sampled_token_ids)} sampled rows for {len(draft_token_ids)} draft tokens")
    if sampled_token_ids[:-1] == draft_token_ids:  # NOTE: every draft token kept (one C comparison)
        return len(sampled_token_ids)
    for i, draft_token_id in enumerate(draft_token_ids):
        if sampled_token_ids[i] != draft_token_id:
            return i + 1
    return len(sampled_token_ids)
