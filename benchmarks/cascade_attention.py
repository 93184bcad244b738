"""Decode attention with and without cascade (kernels/cascade_attention.py), side by side, per batch shape.

``python -m benchmarks.cascade_attention [--rows 2,4,8,64] [--prefix-blocks 4,8,64] [--tail 100]``: for each
(rows, shared prefix blocks) a batch of decode rows shares that many blocks and owns ``tail`` tokens more; it
prints milliseconds per call of the plain C++ kernel and of cascade, their ratio, and the largest difference
(float32). SmolLM2-135M's attention shape: 9 query heads, 3 kv heads, head dim 64, block 16.
"""
from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

from kernels import cascade_attention, cpu_paged_attention

logger = logging.getLogger("benchmarks.cascade_attention")


def _batch(rows: int, prefix_blocks: int, tail: int, bs: int, heads: int, kv_heads: int, dim: int):
    own_blocks = -(-(tail + 1) // bs)
    num_blocks = prefix_blocks + rows * own_blocks
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)  # [NB, bs, kvh, D]
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    tables = np.stack([np.concatenate([np.arange(prefix_blocks),
                                       prefix_blocks + r * own_blocks + np.arange(own_blocks)]) for r in range(rows)])
    lens = np.array([prefix_blocks * bs + tail - r % 7 for r in range(rows)], dtype=np.int32)  # [rows]
    query = torch.randn(rows, heads, dim, generator=gen)  # [rows, H, D]
    return query, k_cache, v_cache, tables.astype(np.int32), lens


def _ms_per_call(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) * 1000 / repeat


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4,8,16,64")
    ap.add_argument("--prefix-blocks", default="4,8,16,64")
    ap.add_argument("--tail", type=int, default=100)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cascade_attention.available(torch.device("cpu"), torch.float32):
        raise SystemExit("cascade needs the C++ decode kernel and torch's CPU flash attention")
    logger.info("%5s %7s %10s %12s %7s %9s", "rows", "prefix", "plain ms", "cascade ms", "ratio", "max diff")
    for rows in map(int, args.rows.split(",")):
        for prefix in map(int, args.prefix_blocks.split(",")):
            q, k, v, tables, lens = _batch(rows, prefix, args.tail, args.block_size, 9, 3, 64)
            bt, ctx = torch.from_numpy(tables), torch.from_numpy(lens)
            cascade = cascade_attention.find_shared_prefixes(tables, lens, args.block_size, torch.device("cpu"),
                                                             min_rows=1, min_blocks=1,
                                                             min_row_blocks=1)
            plain = lambda: cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, ctx, 0.125)  # noqa: E731
            both = lambda: cascade_attention.cascade_decode_attention(q, k, v, bt, ctx, 0.125, cascade)  # noqa: E731
            diff = (plain() - both()).abs().max().item()
            t_plain, t_cascade = _ms_per_call(plain, args.repeat), _ms_per_call(both, args.repeat)
            logger.info("%5d %7d %10.3f %12.3f %6.2fx %9.1e", rows, prefix, t_plain, t_cascade,
                        t_plain / t_cascade, diff)


if __name__ == "__main__":
    main()
