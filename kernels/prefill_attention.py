"""Prefill attention over the paged KV cache: every multi-token chunk of a step, each query over its own chunk and
the sequence's earlier context, causal (and within a sliding window).

Invariants:
  * q: [T, H, D]; k_cache/v_cache: [num_blocks, block_size, kvh, D] strided per-layer views, rows contiguous; every
    chunk's own K/V are already stored in the cache (``attend`` stores before it attends).
  * chunk c is batch rows ``[start, end)``, the last ``end - start`` positions of a context of ``context_len``
    tokens whose blocks are ``block_table`` (the first ``ceil(context_len / block_size)`` entries are read).
  * query at position p sees key j iff ``j <= p`` and, with a sliding window W, ``p - j < W``.

On CPU in float32/bfloat16 (head dim a multiple of 16, at most 512) the C++ kernel (kernels/cpu_prefill_attention.cpp)
takes all chunks of a step in one call, reading K/V in place through the block tables; a query row's result there
depends only on its position and the keys it sees, so chunked, prefix-hit and one-shot prefill agree bit for bit.
Elsewhere (float64 exactness runs, CUDA, other head dims, no compiler) shared/model/attention.py gathers each chunk's
context and runs SDPA (torch's CPU flash kernel in float32/bfloat16). ``paged_prefix_attention_cpu`` is cascade
decode's shared part (kernels/cascade_attention.py) through the same kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_paged_attention

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One step's chunks as the kernel reads them, built once per step and shared by every layer of a KV group."""

    starts: torch.Tensor  # [C] int64
    ends: torch.Tensor  # [C] int64
    context_lens: torch.Tensor  # [C] int64
    block_tables: torch.Tensor  # [C, max_blocks] int32, rows padded with block 0


def build_plan(chunks, block_size: int) -> PrefillPlan:
    """``chunks``: objects with ``start``, ``end``, ``context_len`` and ``block_table`` (shared/model/attention.py's
    ``PrefillChunk``)."""
    tables = _padded([c.block_table[:-(-c.context_len // block_size)] for c in chunks])
    return PrefillPlan(torch.tensor([c.start for c in chunks], dtype=torch.long),
                       torch.tensor([c.end for c in chunks], dtype=torch.long),
                       torch.tensor([c.context_len for c in chunks], dtype=torch.long), tables)


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Block-id rows as one ``[len(rows), longest]`` int32 table, padded with block 0 (never read)."""
    tables = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int32)
    for i, r in enumerate(rows):
        tables[i, :len(r)] = r
    return tables


def prefix_plan(row_counts: list[int], blocks: list[torch.Tensor], block_size: int) -> PrefillPlan:
    """Chunks of ``row_counts[i]`` consecutive rows, each over the whole of its ``blocks[i]`` (``[nb_i]`` block ids;
    context ``nb_i * block_size``), for ``paged_prefix_attention_cpu``."""
    ends = torch.tensor(row_counts, dtype=torch.long).cumsum(0)
    return PrefillPlan(ends - torch.tensor(row_counts, dtype=torch.long), ends,
                       torch.tensor([len(b) * block_size for b in blocks], dtype=torch.long), _padded(blocks))


def native_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill_attention_cpu`` takes these tensors (and the extension is built)."""
    return (q.device.type == "cpu" and q.dtype in NATIVE_DTYPES and k_cache.dtype == q.dtype
            and q.shape[-1] % 16 == 0 and q.shape[-1] <= 512 and k_cache.stride(-1) == 1
            and cpu_paged_attention.load() is not None)


def paged_prefill_attention_cpu(q, k_cache, v_cache, out, plan: PrefillPlan, scale: float,
                                sliding_window: int | None) -> None:
    """Writes the chunks' rows of ``out`` ([T, H, D], q's dtype) in place."""
    cpu_paged_attention.load().paged_prefill_(q.contiguous(), k_cache, v_cache, out, plan.starts, plan.ends,
                                              plan.context_lens, plan.block_tables, float(scale),
                                              int(sliding_window or 0))


def paged_prefix_attention_cpu(q, k_cache, v_cache, plan: PrefillPlan, scale: float):
    """Every row of chunk c attends exactly positions ``[0, context_lens[c])`` of its blocks, unmasked (cascade
    decode's shared part: rows of different sequences behind one cached prefix) → ``(out [T, H, D], lse [T, H])``
    in float32, the decode kernel's accumulator for both float32 and bfloat16."""
    return cpu_paged_attention.load().paged_prefix_attention(q.contiguous(), k_cache, v_cache, plan.starts, plan.ends,
                                                             plan.context_lens, plan.block_tables, float(scale))
