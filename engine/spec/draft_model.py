"""Drafts from a smaller model that shares the target's tokenizer (``[engine.speculative] method =
"draft"``): greedy tokens from the draft model over the request's tokens, proposed through the same
interface as the draftless proposers (engine/spec/speculator.py).

The model layer hands in what the proposer runs: the loaded draft and target models and the draft's block
shape (:class:`DraftModel`, :class:`DraftBlockShape`: engine/model/model_setup.py builds the proposer; spec/
does not import the model layer). Imports torch and transformers.

The draft model's keys and values live in a pool of its own, allocated once (its size is part of the KV
budget: engine/model/model_setup.py sizes both pools together, the draft's after its weights are loaded),
in blocks of :data:`BLOCK_TOKENS` tokens; each request keeps the blocks of the tokens it has fed. A step
keeps the longest prefix still true of the request (a rejected draft's tokens go) and feeds the rest. When
the pool is full, whole requests' caches go, least recently drafted first: such a request re-feeds its
tokens the next time it drafts, and drafts the same tokens. A request that finishes, is aborted or is
preempted (it is no longer running when the next drafts are made) gives its blocks back.

All the requests of one :meth:`DraftModelProposer.propose` call draft together: one batched forward per
draft position (rows of unequal lengths, each over its own blocks, gathered into a batch as its keys and
values by position and masked causally by position), greedy argmax on the device feeding the next
position, and one transfer of every draft to the host at the end. The host therefore waits for the
device once per call, not once per token per request. A request with many tokens to feed (new, or
evicted) feeds all but its last few alone first (:data:`FEED_TOKENS`), so one long prompt does not pad
every row of the batch. :class:`SequentialDraftProposer` is the plain reference (one request and one
token at a time, a Hugging Face ``DynamicCache`` per request): the tests check both draft the same tokens.

The draft model's whole work happens inside ``propose``: the speculator times that call and charges it
to the step's cost (engine/spec/draft_length.py).
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.output.no_tokenizer import NoTokenizer

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # tokens per block of the draft model's pool
FEED_TOKENS = 8  # most tokens a request feeds in the batched forwards; the rest of a longer feed goes first, alone
CATCH_UP_CHUNK = 512  # tokens per forward of that feed
MAX_BATCH_TOKENS = 1 << 16  # rows x longest row of one batch of draft forwards (its keys and values are gathered)
PAD_TOKEN_ID = 0


class DraftModel(Protocol):
    """What the proposers read of a loaded model (engine/model/model_loader.py's ``LoadedModel``)."""

    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # its Hugging Face tokenizer, or a NoTokenizer (a random-weight model)
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    source: str  # for errors


class DraftBlockShape(Protocol):
    """The shape of one block of the draft model's cache (engine/model/kv_cache.py's ``KVCacheSpec``)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def bytes_per_block(self) -> int: ...

    def zeroed_blocks(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """``[layers, 2 (key, value), num_blocks, block_size, kv_heads, head_dim]`` zeros on ``device``."""
        ...


def draft_kv_bytes_per_token(spec: DraftBlockShape) -> int:
    """Bytes of the draft model's keys and values per token (``spec``: its block shape)."""
    return spec.bytes_per_block // spec.block_size


def draft_working_bytes(spec: DraftBlockShape, num_heads: int, vocab_size: int = 0, max_rows: int = 0,
                        max_batch_tokens: int = MAX_BATCH_TOKENS) -> int:
    """An estimate of the device memory a batch of draft forwards needs beside the pool and the weights: one
    layer's keys and values gathered for the batch and their copies expanded to ``num_heads`` query heads
    (grouped-query attention), and a float32 row of logits for each of ``max_rows`` requests. NOTE: estimated
    from the shapes, not profiled (no GPU has run it yet); the other activations are small beside it at a
    draft model's size."""
    per_layer_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    expanded = 2 * num_heads * spec.head_dim * spec.dtype.itemsize
    return max_batch_tokens * (per_layer_token + expanded) + max_rows * vocab_size * 4


@dataclass
class _Entry:
    """A request's cache in the pool: the KV of its first ``num_cached`` tokens, token ``p`` at slot
    ``blocks[p // BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS``."""

    request: Request | None
    blocks: list[int] = field(default_factory=list)
    verified: int = 0  # the first this many cached tokens were the request's own (a request's tokens only grow)
    anchor: int = -1  # the last of them, checked each call
    tail: list[int] = field(default_factory=list)  # cached tokens after them (the draft tokens fed last call)

    @property
    def num_cached(self) -> int:
        return self.verified + len(self.tail)


@dataclass
class _Row:
    """A request of one ``propose`` call."""

    request_id: str
    entry: _Entry
    token_ids: Sequence[int]
    num_tokens: int  # draft tokens to make
    keep: int  # cached tokens still true of the request; the rest are fed

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Tokens whose KV the pool holds after the call (the last draft token is never fed)."""
        return self.length + self.num_tokens - 1


class _PoolCache(Cache):
    """The Hugging Face cache of one batched forward over the pool: each layer writes its new keys and values
    to ``write_slots`` and reads every row's, by position, at ``read_index`` (``[rows, positions]``)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], write_slots: torch.Tensor,
                 read_index: torch.Tensor) -> None:
        super().__init__(layer_class_to_replicate=DynamicLayer)
        self.pool_keys, self.pool_values = keys, values
        self.write_slots, self.read_index = write_slots, read_index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, num_queries, head_dim = key_states.shape
        keys, values = self.pool_keys[layer_idx], self.pool_values[layer_idx]  # [slots, heads, head_dim]
        keys.index_copy_(0, self.write_slots, key_states.transpose(1, 2).reshape(rows * num_queries, heads, head_dim))
        values.index_copy_(0, self.write_slots,
                           value_states.transpose(1, 2).reshape(rows * num_queries, heads, head_dim))
        return keys[self.read_index].transpose(1, 2), values[self.read_index].transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.read_index.shape[1])


class DraftModelProposer:
    """Greedy drafts from ``draft`` for requests of ``target`` (a :class:`Proposer`), batched across requests.

    Args:
        draft: the draft model.
        target: the engine's model (for the tokenizer check).
        spec: the draft model's block shape (``kv_cache_spec(draft, BLOCK_TOKENS)``).
        cache_tokens: tokens the pool holds in all (rounded down to whole blocks, at least one).
        max_batch_tokens: most rows x longest row of one batch of forwards (more rows go in further batches).

    Raises:
        ModelLoadError: the two models' tokenizers differ (draft token ids would mean other text), or the
            draft model does not run over the pool.
    """

    name = "draft"

    def __init__(self, draft: DraftModel, target: DraftModel, spec: DraftBlockShape, cache_tokens: int,
                 max_batch_tokens: int = MAX_BATCH_TOKENS) -> None:
        check_draft_model(draft, target)
        self.draft = draft
        self.block_size = spec.block_size
        self.num_blocks = max(1, cache_tokens // spec.block_size)
        self.max_batch_tokens = max_batch_tokens
        self._forward_kwargs = _forward_kwargs(draft.model)
        self._mask_min = torch.finfo(draft.dtype).min
        self._trash_block = self.num_blocks  # NOTE: one block more: the slot every padding row writes to
        shape = (spec.num_layers, 2, (self.num_blocks + 1) * spec.block_size, spec.num_kv_heads, spec.head_dim)
        # NOTE: zeros, never uninitialised memory: a masked key is still multiplied (0 x NaN is NaN)
        pool = spec.zeroed_blocks(self.num_blocks + 1, draft.device).view(shape)
        self.pool = pool
        self._keys = [pool[layer, 0] for layer in range(spec.num_layers)]
        self._values = [pool[layer, 1] for layer in range(spec.num_layers)]
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently drafted first
        self.num_evictions = 0
        self._check()

    @property
    def cache_bytes(self) -> int:
        """Bytes of the pool (its extra padding block included)."""
        return self.pool.numel() * self.pool.element_size()

    @property
    def num_cached_requests(self) -> int:
        return len(self._entries)

    @property
    def num_cached_tokens(self) -> int:
        return sum(entry.num_cached for entry in self._entries.values())

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        self._release_gone({request.request_id for request, _, _ in wanted})
        rows = self._place(wanted)
        if not rows:
            return {}
        for row in rows:
            if row.length - row.keep > FEED_TOKENS:
                self._catch_up(row)
        groups = self._groups(rows)
        outputs = [self._draft_group(group) for group in groups]
        width = max(output.shape[1] for output in outputs)
        tokens = torch.cat([torch.nn.functional.pad(output, (0, width - output.shape[1])) for output in outputs])
        host = tokens.tolist()  # NOTE: the call's one wait for the device
        drafts = {}
        for row, row_tokens in zip([row for group in groups for row in group], host, strict=True):
            draft = row_tokens[:row.num_tokens]
            drafts[row.request_id] = draft
            entry = row.entry
            entry.verified, entry.anchor = row.length, row.token_ids[row.length - 1]
            entry.tail = draft[:-1]  # NOTE: the last draft token was not fed: its KV is not in the pool
        return drafts

    def finished(self, request: Request) -> None:
        self._release(request.request_id)

    # ------------------------------------------------------------------------------------------ the pool

    def _release(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._free.extend(entry.blocks)
            entry.blocks = []

    def _release_gone(self, wanted: set[str]) -> None:
        """Give back the blocks of requests no longer running (preempted: swapped out or to recompute; or
        finished without :meth:`finished`)."""
        gone = [request_id for request_id, entry in self._entries.items()
                if request_id not in wanted and entry.request is not None
                and entry.request.status is not RequestStatus.RUNNING]
        for request_id in gone:
            self._release(request_id)

    def _place(self, wanted: list[tuple[Request, Sequence[int], int]]) -> list[_Row]:
        """The rows of this call, each with blocks for every token it will hold; a request the pool cannot
        hold (after evicting the caches of requests not asked for, least recent first) drafts nothing."""
        max_len = self.draft.max_model_len
        protected = {request.request_id for request, _, _ in wanted}
        rows = []
        for request, token_ids, num_tokens in wanted:
            length = len(token_ids)
            num_tokens = min(num_tokens, max_len - length + 1)  # NOTE: positions past the draft model's context
            if length < 1 or num_tokens < 1:
                continue
            request_id = request.request_id
            entry = self._entries.get(request_id)
            if entry is None:
                entry = self._entries[request_id] = _Entry(request)
            else:
                self._entries.move_to_end(request_id)
            row = _Row(request_id, entry, token_ids, num_tokens, _kept(entry, token_ids))
            if not self._reserve(entry, -(-row.end // self.block_size), protected):
                self._release(request_id)
                continue
            _hold(row, row.keep)  # NOTE: what the pool is sure to hold while the call writes past it
            rows.append(row)
        return rows

    def _reserve(self, entry: _Entry, num_blocks: int, protected: set[str]) -> bool:
        blocks = entry.blocks
        if len(blocks) > num_blocks:
            self._free.extend(blocks[num_blocks:])
            del blocks[num_blocks:]
        missing = num_blocks - len(blocks)
        if missing > len(self._free):
            for request_id in [r for r in self._entries if r not in protected]:
                self._release(request_id)
                self.num_evictions += 1
                if missing <= len(self._free):
                    break
        if missing > len(self._free):
            return False
        blocks.extend(self._free.pop() for _ in range(missing))
        return True

    # ------------------------------------------------------------------------------------------ forwards

    def _catch_up(self, row: _Row) -> None:
        """Feed all but the last token of a long feed, one request alone, in chunks (nothing read back)."""
        stop = row.length - 1
        num_blocks = -(-stop // self.block_size)
        blocks, token_ids = self._upload([row.entry.blocks[:num_blocks]], [list(row.token_ids[row.keep:stop])])
        table = self._slots(blocks)
        for start in range(row.keep, stop, CATCH_UP_CHUNK):
            end = min(stop, start + CATCH_UP_CHUNK)
            positions = torch.arange(start, end, device=table.device).unsqueeze(0)
            read_index = table[:, :end]
            self._forward(token_ids[:, start - row.keep:end - row.keep], positions,
                          read_index.gather(1, positions).view(-1), read_index)
        _hold(row, stop)

    def _groups(self, rows: list[_Row]) -> list[list[_Row]]:
        """Rows in batches of at most ``max_batch_tokens`` rows x longest row, shortest rows together."""
        groups: list[list[_Row]] = []
        for row in sorted(rows, key=lambda r: r.end):
            if groups and (len(groups[-1]) + 1) * row.end <= self.max_batch_tokens:
                groups[-1].append(row)
            else:
                groups.append([row])
        return groups

    def _draft_group(self, rows: list[_Row]) -> torch.Tensor:
        """Greedy draft tokens of a batch of rows, ``[rows, most draft tokens]`` on the device: the fed
        tokens (left-padded), then one forward per further draft position, each row's query at its own
        position; a row past its own draft length writes to the padding block (its tokens are dropped).
        Everything it needs from the host goes to the device in one copy, before the first forward."""
        trash, trash_slot = self._trash_block, self._trash_block * self.block_size
        length = max(row.end for row in rows)
        num_blocks = -(-length // self.block_size)
        width = max(row.length - row.keep for row in rows)
        most = max(row.num_tokens for row in rows)
        table, input_ids, positions, real, step_positions, step_real = [], [], [], [], [], []
        for row in rows:
            blocks = row.entry.blocks[:num_blocks]
            table.append(blocks + [trash] * (num_blocks - len(blocks)))
            pad = width - (row.length - row.keep)
            input_ids.append([PAD_TOKEN_ID] * pad + list(row.token_ids[row.keep:row.length]))
            positions.append([0] * pad + list(range(row.keep, row.length)))
            real.append([0] * pad + [1] * (row.length - row.keep))
            step_positions.append([min(row.length + s, row.end - 1) for s in range(most)])
            step_real.append([int(s < row.num_tokens - 1) for s in range(most)])
        table_t, input_ids_t, positions_t, real_t, step_positions_t, step_real_t = self._upload(
            table, input_ids, positions, real, step_positions, step_real)
        read_index = self._slots(table_t)[:, :length]
        writes = torch.where(real_t != 0, read_index.gather(1, positions_t), trash_slot)
        step_writes = torch.where(step_real_t != 0, read_index.gather(1, step_positions_t), trash_slot)
        token = self._forward(input_ids_t, positions_t, writes.view(-1), read_index)
        tokens = [token]
        for s in range(most - 1):
            token = self._forward(token.unsqueeze(1), step_positions_t[:, s:s + 1], step_writes[:, s], read_index)
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    def _upload(self, *arrays: list[list[int]]) -> list[torch.Tensor]:
        """Host lists of lists as int64 tensors on the draft model's device; on CUDA in one copy from pinned
        memory, which does not wait for the device (a copy from pageable memory would)."""
        tensors = [torch.tensor(array, dtype=torch.long) for array in arrays]
        device = self.draft.device
        if device.type == "cpu":
            return tensors
        flat = torch.cat([t.view(-1) for t in tensors])
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
        parts = torch.split(flat, [t.numel() for t in tensors])
        return [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]

    def _slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """Each row's slot of each position, ``[rows, blocks x block size]``, from its block table."""
        offsets = torch.arange(self.block_size, device=blocks.device)
        return (blocks.unsqueeze(-1) * self.block_size + offsets).view(blocks.shape[0], -1)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                 read_index: torch.Tensor) -> torch.Tensor:
        """One forward of ``[rows, queries]`` tokens at ``positions``; each query attends to its row's
        positions up to its own. Returns the greedy token after each row's last query, ``[rows]``.

        NOTE: the mask is the model's whole mask (a 4-D mask is taken as given): a draft model with
        sliding-window layers attends over the whole context here, so its drafts past the window are not
        its own (verification keeps the output exact all the same)."""
        rows, num_queries = input_ids.shape
        num_keys = read_index.shape[1]
        keys = torch.arange(num_keys, device=input_ids.device)
        allowed = keys.view(1, 1, 1, num_keys) <= positions.view(rows, 1, num_queries, 1)
        mask = torch.zeros(allowed.shape, dtype=self.draft.dtype, device=input_ids.device)
        mask.masked_fill_(~allowed, self._mask_min)
        cache = _PoolCache(self._keys, self._values, write_slots, read_index)
        kwargs = dict(self._forward_kwargs)
        kwargs[kwargs.pop("cache")] = cache
        logits: torch.Tensor = self.draft.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                                use_cache=True, **kwargs).logits
        return logits[:, -1].argmax(dim=-1)

    def _check(self) -> None:
        """Run one short draft through the pool, so a model it does not fit fails at load, not in a step."""
        probe = _Entry(None)
        try:
            vocab_size = self.draft.model.config.vocab_size
            row = _Row("probe", probe, [vocab_size // 2, vocab_size // 3], 2, 0)  # NOTE: not a padding id (zeros)
            if not self._reserve(probe, -(-row.end // self.block_size), set()):
                raise ModelLoadError("the draft model's cache holds no block")
            with torch.inference_mode():
                self._draft_group([row]).tolist()
                slots = self._slots(torch.tensor(probe.blocks, device=self.draft.device).unsqueeze(0))[0, :row.end]
                if not bool(self._keys[0][slots].any()):
                    raise ModelLoadError(f"draft model {self.draft.source} does not keep its keys and values in the "
                                         "cache it is given (its attention does not call the cache's update)")
        except ModelLoadError:
            raise
        except Exception as error:
            raise ModelLoadError(f"draft model {self.draft.source} does not run over its paged cache: {error}") \
                from error
        finally:
            self._free.extend(probe.blocks)


class SequentialDraftProposer:
    """The plain reference of :class:`DraftModelProposer`: one request after another, one token at a time
    (a host wait per token), a Hugging Face ``DynamicCache`` per request cropped back to the longest prefix
    still true of the request. Unbounded (a cache per live request): tests only, not the engine's."""

    name = "draft"

    def __init__(self, draft: DraftModel, target: DraftModel) -> None:
        check_draft_model(draft, target)
        self.draft = draft
        self._cache_kwarg = _forward_kwargs(draft.model)["cache"]
        self._caches: dict[str, tuple[DynamicCache, list[int]]] = {}  # request id -> (cache, its tokens)

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        return {request.request_id: self._draft(request.request_id, token_ids, num_tokens)
                for request, token_ids, num_tokens in wanted}

    def finished(self, request: Request) -> None:
        self._caches.pop(request.request_id, None)

    def _draft(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        cache, cached = self._caches.get(request_id) or (DynamicCache(), [])
        token_ids = list(token_ids)
        keep = _common_prefix(cached, token_ids, limit=len(token_ids) - 1)
        if keep < len(cached):  # NOTE: a negative count (tokens to remove) means that in every transformers
            cache.crop(keep - len(cached))
        feed = token_ids[keep:]
        draft: list[int] = []
        for _ in range(num_tokens):
            logits = self.draft.model(input_ids=torch.tensor([feed], device=self.draft.device), use_cache=True,
                                      **{self._cache_kwarg: cache}).logits
            token_id = int(logits[0, -1].argmax())
            draft.append(token_id)
            feed = [token_id]
        self._caches[request_id] = (cache, token_ids + draft[:-1])  # NOTE: the last draft token was not fed
        return draft


def _hold(row: _Row, keep: int) -> None:
    """Mark the row's first ``keep`` tokens (the request's own) as what its entry holds."""
    row.keep = keep
    entry = row.entry
    entry.verified, entry.anchor, entry.tail = keep, row.token_ids[keep - 1] if keep else -1, []


def _kept(entry: _Entry, token_ids: Sequence[int]) -> int:
    """Cached tokens still true of the request (at most all but its last token: that one is always fed)."""
    limit = len(token_ids) - 1
    verified = entry.verified
    if verified > len(token_ids) or (verified and token_ids[verified - 1] != entry.anchor):
        return 0  # NOTE: not the tokens cached (a request's tokens only grow): feed them all again
    keep = min(verified, limit)
    if keep == verified:
        keep += _common_prefix(entry.tail, token_ids[verified:verified + len(entry.tail)], limit - verified)
    return keep


def _common_prefix(cached: Sequence[int], token_ids: Sequence[int], limit: int) -> int:
    length = 0
    for a, b in zip(cached[:limit], token_ids[:limit]):
        if a != b:
            break
        length += 1
    return length


def _forward_kwargs(model: Any) -> dict[str, Any]:
    """Keyword arguments of a forward over a cache: ``cache`` names the model's cache argument (``cache``;
    ``past_key_values`` before transformers renamed it); ``logits_to_keep=1`` where the model takes it (the
    logits of the last position only)."""
    parameters = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"cache": "cache" if "cache" in parameters else "past_key_values"}
    if "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    return kwargs


def check_draft_model(draft: DraftModel, target: DraftModel) -> None:
    """Raises:
        ModelLoadError: the two models' tokenizers differ (draft token ids would mean other text).
    """
    if not _same_vocabulary(draft, target):
        raise ModelLoadError(f"draft model {draft.source} does not share the tokenizer of {target.source}")


def _same_vocabulary(draft: DraftModel, target: DraftModel) -> bool:
    if isinstance(draft.tokenizer, NoTokenizer) or isinstance(target.tokenizer, NoTokenizer):
        return bool(draft.model.config.vocab_size == target.model.config.vocab_size)
    return bool(draft.tokenizer.get_vocab() == target.tokenizer.get_vocab())
