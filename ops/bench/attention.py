"""Paged-attention microbenchmark: the gather + SDPA path (engine/kernels/attention/reference.py) against
the C++ CPU kernel (engine/kernels/attention/cpu_kernel.py), per call, measured in the same run.

    python ops/bench/attention.py              # all shapes (~1 min on 2 cores, after the build)
    python ops/bench/attention.py --quick      # fewer shapes and repeats, for development

Shapes: decode batches of 1/4/16/64 single-token queries over ragged contexts (100-1200 tokens,
seeded) and prefill chunks (512 tokens over 0 and 1000 cached tokens, 64 tokens over 1000), for
SmolLM2-135M heads (9 query / 3 kv / head_dim 64) and 32/8/128 and 32/32/64; then the cache write
of T = 1/16/64/512 tokens: today's two ``index_copy_`` calls against the C++ ``reshape_and_cache``.

The reference is the engine's gather + SDPA path from before this kernel: for decodes
engine/kernels/attention/reference.py's ReferenceBackend (rows sorted longest first, gathered in groups of
a few MiB into reused buffers, one masked SDPA per group); for a prefill chunk SDPA ``is_causal``
on the chunk's own keys/values when nothing is cached, else gather + masked SDPA over the prefix.
Per-step metadata (block tables, masks) is built outside the timed calls, as the runner does.
Calls rotate over several layers of one pool so the KV bytes are not all cache-hot, as in a real
forward.
Timing alternates the two paths in rounds and reports the median per-call time of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import machine_info, print_table, write_json

HEAD_CONFIGS = {"9/3/64": (9, 3, 64), "32/8/128": (32, 8, 128), "32/32/64": (32, 32, 64)}
DECODE_BATCHES = (1, 4, 16, 64)
PREFILLS = ((512, 0), (512, 1000), (64, 1000))  # (chunk tokens, cached tokens)
CACHE_WRITES = (1, 16, 64, 512)  # tokens written per layer
POOL_BUDGET_BYTES = 1 << 30  # layers of pool allocated per shape, at most this many bytes


class Shape:
    """One benchmark case (decodes only, or one prefill chunk): its pool, metadata and inputs."""

    def __init__(self, torch: Any, heads: tuple[int, int, int], contexts: list[int], q_lens: list[int],
                 block_size: int, dtype: Any, seed: int) -> None:
        from tokenmill.engine.kernels.attention.metadata import AttentionMetadata

        num_heads, num_kv_heads, head_dim = heads
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [(c + block_size - 1) // block_size for c in contexts]
        num_blocks = sum(blocks_per_seq) + 8
        layer_bytes = 2 * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.num_layers = max(1, min(30, POOL_BUDGET_BYTES // layer_bytes))
        pool = torch.randn(self.num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        self.pool = pool.to(dtype)
        perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered over the pool
        self.block_ids: list[list[int]] = []
        at = 0
        for n in blocks_per_seq:
            self.block_ids.append(perm[at : at + n])
            at += n
        total = sum(q_lens)
        self.query = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)  # [T, heads, head_dim]
        self.key = torch.randn(1, total, num_kv_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
        self.value = torch.randn(1, total, num_kv_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
        self.scale = head_dim**-0.5
        # This step's keys/values are already in the cache (every layer), as after the cache write.
        token = 0
        for ids, context, q_len in zip(self.block_ids, contexts, q_lens):
            for pos in range(context - q_len, context):
                slot = (ids[pos // block_size], pos % block_size)
                self.pool[:, 0, slot[0], slot[1]] = self.key[0, :, token]
                self.pool[:, 1, slot[0], slot[1]] = self.value[0, :, token]
                token += 1
        # Metadata as ModelRunner.prepare builds it once per step (decode rows longest context first).
        width = max(blocks_per_seq)
        query_start = [0]
        for q_len in q_lens:
            query_start.append(query_start[-1] + q_len)
        self.meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long),
            block_tables=torch.tensor([ids + [0] * (width - len(ids)) for ids in self.block_ids], dtype=torch.int32),
            seq_lens=torch.tensor(contexts, dtype=torch.int32),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            num_decodes=sum(1 for q in q_lens if q == 1),
            max_seq_len=max(contexts),
            max_query_len=max(q_lens),
            seq_lens_host=list(contexts),
            query_start_host=query_start,
        )
        self.contexts, self.q_lens = contexts, q_lens
        # The prefix mask of a chunk over cached tokens (built once per step by the old runner).
        start = contexts[0] - q_lens[0]
        self.prefix_mask = None
        if q_lens[0] > 1 and start > 0:
            self.prefix_mask = torch.arange(contexts[0]).unsqueeze(0) <= torch.arange(start, contexts[0]).unsqueeze(1)

    def layer(self, i: int) -> tuple[Any, Any]:
        layer = i % self.num_layers
        return self.pool[layer, 0], self.pool[layer, 1]


def reference_call(shape: Shape) -> Callable[[int], Any]:
    """Today's per-layer gather + SDPA attention (after the cache write).

    Decodes: engine/kernels/attention/reference.py's ReferenceBackend (rows grouped by context, gathered
    into reused buffers, one masked SDPA per group: the engine's path before this kernel). A
    prefill chunk: SDPA ``is_causal`` on the chunk's own keys/values when nothing is cached, else
    its blocks gathered with index_select + SDPA under the prefix mask.
    """
    import torch
    import torch.nn.functional as F

    from tokenmill.engine.kernels.attention.reference import ReferenceBackend

    if shape.meta.num_decodes:
        backend = ReferenceBackend()

        def decodes(i: int) -> Any:
            return backend.attend(shape.query, *shape.layer(i), shape.meta, shape.scale)

        return decodes
    (context,), (_q_len,), (ids,) = shape.contexts, shape.q_lens, shape.block_ids
    q = shape.query.transpose(0, 1).unsqueeze(0)  # [1, heads, T, head_dim]
    block_ids = torch.tensor(ids)

    def prefill(i: int) -> Any:
        if shape.prefix_mask is None:  # first chunk: the context is exactly the chunk's own keys
            out = F.scaled_dot_product_attention(q, shape.key, shape.value, is_causal=True, scale=shape.scale,
                                                 enable_gqa=True)
        else:
            kv = []
            for pool in shape.layer(i):
                num_blocks, block_size = pool.shape[:2]
                rows = torch.index_select(pool.view(num_blocks, -1), 0, block_ids)
                kv.append(rows.view(-1, *pool.shape[2:])[:context].transpose(0, 1).unsqueeze(0))
            out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=shape.prefix_mask, scale=shape.scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1)

    return prefill


def kernel_call(shape: Shape) -> Callable[[int], Any]:
    from tokenmill.engine.kernels.attention import cpu_kernel

    meta = shape.meta

    def call(i: int) -> Any:
        return cpu_kernel.paged_attention(shape.query, *shape.layer(i), meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, shape.scale)

    return call


def cache_write_calls(shape: Shape) -> list[Callable[[int], Any]]:
    """Today's cache write (two index_copy_, as ReferenceBackend.write_kv) and the C++ one, for
    the shape's tokens at random distinct slots."""
    import torch

    from tokenmill.engine.kernels.attention import cpu_kernel

    num_blocks, block_size, num_kv_heads, head_dim = shape.pool.shape[2:]
    num_tokens = shape.key.shape[2]
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    key, value = shape.key[0].transpose(0, 1), shape.value[0].transpose(0, 1)  # [T, kv_heads, head_dim]

    def today(i: int) -> None:
        key_pool, value_pool = shape.layer(i)
        key_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
        value_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)

    def kernel(i: int) -> None:
        cpu_kernel.reshape_and_cache(key, value, *shape.layer(i), slots)

    return [today, kernel]


def time_pair(calls: list[Callable[[int], Any]], min_seconds: float, rounds: int) -> list[float]:
    """Median per-call seconds of each callable, alternating them round by round."""
    for call in calls:  # warm up (first-call allocations, page faults)
        for i in range(3):
            call(i)
    start = time.perf_counter()
    calls[0](0)
    calls[1](0)
    per_round = max(1, int(min_seconds / rounds / max(time.perf_counter() - start, 1e-6)))
    samples: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for c in order:
            start = time.perf_counter()
            for i in range(per_round):
                calls[c](i)
            samples[c].append((time.perf_counter() - start) / per_round)
    return [statistics.median(s) for s in samples]


def check(torch: Any, reference: Any, kernel: Any, dtype: Any) -> float:
    err = float((reference.float() - kernel.float()).abs().max())
    tolerance = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    if err > tolerance:
        raise SystemExit(f"kernel and reference differ by {err:.3g}")
    return err


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--heads", nargs="+", default=list(HEAD_CONFIGS), choices=list(HEAD_CONFIGS),
                        help="query/kv heads/head_dim configurations")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=1.0, help="measured time per path per shape")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="9/3/64 only, 0.3 s per path per shape")
    parser.add_argument("--json", help="also write a JSON report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from tokenmill.engine.kernels.attention import cpu_kernel

    torch.set_num_threads(args.threads)
    if args.quick:
        args.heads, args.seconds = ["9/3/64"], 0.3
    start = time.perf_counter()
    if not cpu_kernel.is_available():
        raise SystemExit("the C++ kernel is not available (see the log above)")
    print(f"kernel ready in {time.perf_counter() - start:.1f} s ({cpu_kernel.build_directory()})")
    dtype = getattr(torch, args.dtype)
    rng = torch.Generator().manual_seed(args.seed)
    cases: list[tuple[str, list[int], list[int]]] = []
    for batch in DECODE_BATCHES:
        contexts = torch.randint(100, 1201, (batch,), generator=rng).tolist()
        contexts.sort(reverse=True)  # the runner's decode order; the kernel does not care
        cases.append((f"decode x{batch} (ctx {min(contexts)}-{max(contexts)})", contexts, [1] * batch))
    for tokens, cached in PREFILLS:
        cases.append((f"prefill {tokens} over {cached}", [cached + tokens], [tokens]))

    rows, report = [], []
    for heads_name in args.heads:
        for label, contexts, q_lens in cases:
            shape = Shape(torch, HEAD_CONFIGS[heads_name], contexts, q_lens, args.block_size, dtype, args.seed)
            ref, ker = reference_call(shape), kernel_call(shape)
            err = check(torch, ref(0), ker(0), dtype)
            ref_s, ker_s = time_pair([ref, ker], args.seconds, args.rounds)
            rows.append([label, heads_name, f"{ref_s * 1e3:.3f}", f"{ker_s * 1e3:.3f}", f"{ref_s / ker_s:.2f}x"])
            report.append({"shape": label, "heads": heads_name, "reference_ms": ref_s * 1e3,
                           "kernel_ms": ker_s * 1e3, "speedup": ref_s / ker_s, "max_abs_err": err,
                           "layers_rotated": shape.num_layers})
            print(f"  {label:32s} {heads_name:9s} ref {ref_s * 1e3:8.3f} ms  kernel {ker_s * 1e3:8.3f} ms  "
                  f"{ref_s / ker_s:5.2f}x", flush=True)
            del shape
    for tokens in CACHE_WRITES:
        if args.quick and tokens != CACHE_WRITES[0]:
            continue
        shape = Shape(torch, HEAD_CONFIGS[args.heads[0]], [max(1200, tokens)], [tokens], args.block_size, dtype,
                      args.seed)
        ref_s, ker_s = time_pair(cache_write_calls(shape), args.seconds, args.rounds)
        label = f"cache write {tokens} tokens"
        rows.append([label, args.heads[0], f"{ref_s * 1e3:.3f}", f"{ker_s * 1e3:.3f}", f"{ref_s / ker_s:.2f}x"])
        report.append({"shape": label, "heads": args.heads[0], "reference_ms": ref_s * 1e3,
                       "kernel_ms": ker_s * 1e3, "speedup": ref_s / ker_s, "layers_rotated": shape.num_layers})
        print(f"  {label:32s} {args.heads[0]:9s} ref {ref_s * 1e3:8.3f} ms  kernel {ker_s * 1e3:8.3f} ms  "
              f"{ref_s / ker_s:5.2f}x", flush=True)
        del shape
    print_table(f"paged attention per call, {args.dtype}, block {args.block_size}, {args.threads} threads",
                ["shape", "heads q/kv/d", "today ms", "kernel ms", "speedup"], rows)
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "results": report})


if __name__ == "__main__":
    main()
