"""Turns one step's logits into next tokens: penalties, structured-output masks and min_tokens
(engine/sample/logits_processors.py), then greedy, temperature, top-k, top-p, per-request seeds, and raw
logprobs. Imports torch; nothing from the scheduler side.
NOTE: measurements behind these choices: ops/bench/README.md, "Figures behind the kernels' comments"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.errors import SamplingError
from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.logits_processors import LogitsProcessors

_MASK_64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    """One sampled token per row, plus the logprobs the rows asked for."""

    token_ids: list[int]  # one per row, in row order
    logprobs: list[dict[int, float] | None]  # per row: sampled token first, then the top `params.logprobs`


def mix_seed(seed: int, num_output_tokens: int) -> int:
    """Derives the generator seed for one (request seed, output position) pair.

    A splitmix64 finalizer over both values, so neighbouring seeds and positions give
    unrelated streams. Depends on nothing else, so re-sampling a position after a
    recompute preemption draws exactly the same token.

    Args:
        seed: the request's seed, in [0, 2**63).
        num_output_tokens: tokens generated before this one.

    Returns:
        A seed in [0, 2**63), valid for ``torch.Generator.manual_seed``.
    """
    z = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Sampler over a batch of logits rows; per-request state lives in each row's SamplingState.

    NOTE: returned logprobs are those of the *raw* model distribution (``log_softmax`` of the
    unmodified logits, before penalties, grammar masks, temperature, top-k, top-p and min_tokens),
    as vLLM does by default. They describe what the model believed, independently of how we chose to sample.

    Randomness uses the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which is
    equivalent to drawing from ``p``. Unseeded rows draw ``q`` from the global torch RNG in one
    batched call; seeded rows draw their own row from a generator seeded with
    ``mix_seed(seed, num_output_tokens)``, so their token depends only on their own logits row
    (and on the device and compute dtype: torch's generators differ between CPU and CUDA).

    Args:
        grammars: compiles structured-output grammars; None = the engine admits no structured requests.
        argmax: the greedy choice (:func:`greedy_token_ids`; the CPU's native decoder brings a
            one-pass C++ version with the same results).
    """

    def __init__(self, grammars: GrammarCompiler | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.processors = LogitsProcessors(grammars)
        self.argmax = argmax or greedy_token_ids
        self._generators: dict[torch.device, torch.Generator] = {}  # seeded rows' draws, reseeded per row

    def __call__(self, logits: torch.Tensor, contexts: list[SamplingContext]) -> SamplerOutput:
        """Samples one token per row.

        Args:
            logits: ``[num_rows, vocab_size]`` scores of any float dtype; not modified.
                Computation is in float32 (float64 if given float64).
            contexts: one per row, in row order.

        Returns:
            The sampled token ids and requested logprobs, one entry per row.

        Raises:
            ValueError: if ``logits`` is not 2-D or its row count differs from ``len(contexts)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(contexts):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(contexts)} contexts")
        is_plain_greedy = all(
            c.params.is_greedy and c.params.logprobs is None and not self.processors.needs_processing(c)
            for c in contexts
        )
        if is_plain_greedy:  # the common case: one argmax, no copies, no per-row work
            token_ids = self.argmax(logits)
            _check_chosen(logits, token_ids)
            return SamplerOutput(token_ids.tolist(), [None] * len(contexts))

        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        raw = logits.to(dtype)
        processed = self.processors.apply(raw, contexts)
        token_ids = self.argmax(processed)
        _check_chosen(processed, token_ids)
        random_rows = [i for i, c in enumerate(contexts) if not c.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            row_contexts = [contexts[i] for i in random_rows]
            token_ids[rows] = _sample_random(processed[rows], row_contexts, random_rows, self._generator(logits.device))
        token_id_list: list[int] = token_ids.tolist()
        return SamplerOutput(token_id_list, _gather_logprobs(raw, token_id_list, contexts))

    def _generator(self, device: torch.device) -> torch.Generator:
        """This sampler's generator on ``device`` (one per sampler: engines on other threads have their own)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def _check_chosen(scores: torch.Tensor, token_ids: torch.Tensor) -> None:
    """The guard every greedy choice passes: the chosen token's score is finite.

    A row holding a NaN chooses it (argmax's NaN rule), a row whose every token is masked chooses a
    -inf, and an overflowed row an infinity; each would otherwise come back as token 0 or garbage.
    It costs one gather of a value per row.

    Raises:
        SamplingError: naming the bad rows.
    """
    _check_rows(torch.isfinite(_chosen(scores, token_ids)))


def _chosen(values: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return values.gather(1, token_ids.unsqueeze(1)).squeeze(1)


def _check_rows(is_ok: torch.Tensor, row_ids: list[int] | None = None) -> None:
    """Raise :class:`SamplingError` for the rows where ``is_ok`` is False (``row_ids`` maps them to the batch's)."""
    if not bool(is_ok.all()):
        bad = torch.nonzero(~is_ok).squeeze(1).tolist()
        rows = [row_ids[i] for i in bad] if row_ids is not None else bad
        raise SamplingError(rows, "the scores admit no valid token (NaN, infinite, or every token masked)")


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the first index of each row's maximum (NaN counts as the maximum).

    NOTE: computed by ``max(dim=-1)``, which torch defines with the same first-index and NaN rules
    and which is faster on CPU for bfloat16 rows (float32 is the same either way). Tests compare
    the two.
    """
    return logits.max(dim=-1).indices


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks to -inf what top-k and top-p drop, row-wise, for the whole batch at once.

    Both filters become one per-row threshold value; tokens below it are dropped. Top-k keeps
    the tokens scoring at least the k-th largest value (ties at the boundary are all kept, so the
    result never depends on tie order or on neighbours). Top-p keeps the smallest set of most
    likely tokens whose mass reaches ``p`` (within what top-k kept); the top token always stays.
    It costs one ``topk(max k)`` when every row has a k, else one full sort of the batch.

    Args:
        logits: ``[rows, vocab]`` temperature-scaled logits.
        top_k: per row; 0 (or >= vocab) disables.
        top_p: per row; 1.0 disables.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    k = torch.tensor([kk if 0 < kk < vocab_size else vocab_size for kk in top_k], device=device)
    num_top = int(k.max())
    if all(pp >= 1.0 for pp in top_p):
        top_values = logits.topk(num_top, dim=-1).values
        threshold = top_values.gather(1, (k - 1).clamp(max=num_top - 1).unsqueeze(1))
        threshold = threshold.masked_fill((k == vocab_size).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < threshold, float("-inf"))
    # Only the top max-k values can survive top-k, so sort just those when every row has a k.
    if num_top < vocab_size:
        sorted_logits = logits.topk(num_top, dim=-1).values
    else:
        sorted_logits = logits.sort(dim=-1, descending=True).values
    kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    probs = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    # NOTE: p = 1.0 becomes 2.0 so float rounding in the cumsum can never drop a token of a
    # row that disabled top-p just because a neighbour enabled it.
    p = torch.tensor([pp if pp < 1.0 else 2.0 for pp in top_p], dtype=logits.dtype, device=device)
    # NOTE: at least the top token even for p below float's smallest value (0 < p rounds to 0)
    num_kept = (mass_before < p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = torch.maximum(kth_value, sorted_logits.gather(1, num_kept - 1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _sample_random(logits: torch.Tensor, contexts: list[SamplingContext], row_ids: list[int],
                   generator: torch.Generator) -> torch.Tensor:
    """Draws one token per row from the processed distribution (all rows have temperature >= the
    greedy floor, so ``logits / temperature`` stays finite).

    Args:
        row_ids: each row's index in the step's batch (named by a :class:`SamplingError`).
        generator: reseeded for each seeded row (a new one per row per step cost a CUDA allocation each).

    Returns:
        ``[rows]`` int64 token ids.
    """
    temperature = torch.tensor([c.params.temperature for c in contexts], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperature.unsqueeze(1)
    top_k = [c.params.top_k for c in contexts]
    top_p = [c.params.top_p for c in contexts]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    q = torch.empty_like(probs)
    row_to_seed = {i: c.params.seed for i, c in enumerate(contexts) if c.params.seed is not None}
    if len(row_to_seed) < len(contexts):
        q.exponential_()  # global RNG, one call for the whole batch
    for i, seed in row_to_seed.items():  # NOTE: the only per-row loop; each seeded row owns its stream
        generator.manual_seed(mix_seed(seed, contexts[i].num_output_tokens))  # a full reset: the row's own stream
        q[i].exponential_(generator=generator)
    # NOTE: clamp so q == 0 cannot turn a zero-probability token into 0/0 = NaN (argmax picks NaN).
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    token_ids = (probs / q).argmax(dim=-1)
    _check_rows(_chosen(probs, token_ids) > 0, row_ids)  # NOTE: NaN probabilities fail it too
    return token_ids


def _gather_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], contexts: list[SamplingContext]
) -> list[dict[int, float] | None]:
    """Raw-model logprobs of the sampled token and the top ``params.logprobs`` tokens per row."""
    rows = [i for i, c in enumerate(contexts) if c.params.logprobs is not None]
    result: list[dict[int, float] | None] = [None] * len(contexts)
    if not rows:
        return result
    row_tensor = torch.tensor(rows, device=raw_logits.device)
    logprobs = raw_logits[row_tensor].log_softmax(dim=-1)
    num_top = min(max(contexts[i].params.logprobs or 0 for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    sampled = torch.tensor([token_ids[i] for i in rows], device=raw_logits.device)
    sampled_values: list[float] = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    top_value_list: list[list[float]] = top_values.tolist()
    top_id_list: list[list[int]] = top_ids.tolist()
    for j, i in enumerate(rows):
        num_wanted = contexts[i].params.logprobs or 0
        entry = {token_ids[i]: sampled_values[j]}
        for token_id, value in zip(top_id_list[j][:num_wanted], top_value_list[j][:num_wanted]):
            entry.setdefault(token_id, value)
        result[i] = entry
    return result
