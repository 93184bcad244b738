"""Cascade decode attention on CPU: decode rows that share a cached prefix read it once, together.

Sequences behind one system prompt hold the same physical blocks for it (prefix caching). Attending it row by
row reads those blocks once per sequence in matrix-vector products. Instead, each group's queries attend the
shared prefix together (matrix-matrix products, every key read once for the whole group: on CPU in float32 and
bfloat16 all groups in one call of kernels/prefill_attention.py's kernel, else one flash-attention call per group),
then the paged kernel attends each row's own tail and merges both parts by log-sum-exp. Same softmax, another
summation order: results equal the plain kernel's to rounding (float64 runs stay token-exact). In bfloat16 the
prefix part's output and log-sum-exp are kept in float32 (the C++ kernel's unrounded; the flash kernel's output
rounded to bfloat16 once, as its own result), and the merge rounds to bfloat16 once.

Invariants of a ``DecodeCascade`` (``find_shared_prefixes`` guarantees them):
  * every row of a group holds the group's ``blocks`` as the first entries of its block table (identical
    physical blocks, so identical keys and values);
  * the shared length ``len(blocks) * block_size`` is below every member's context length: each row keeps at
    least one position of its own (its newest token), so the tail attention is never empty;
  * ``starts[row]`` is the shared length for rows in a group, 0 elsewhere.
Layers with a sliding window do not use it (the window would cut each row's prefix differently).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_paged_attention
from kernels.prefill_attention import native_supports, paged_prefix_attention_cpu, prefix_plan

# Measured with benchmarks/cascade_attention.py (2 AVX2 cores, 9 heads / 3 kv heads, D 64, 100-token tails):
# 64 rows x 64 shared blocks 1.99x, 16 x 16 1.23x, 8 x 64 1.55x, 64 x 8 1.02x; 8 x 16 0.78x, 64 x 4 0.75x (the
# flash call costs ~0.2 ms however small its group). A group needs all three.
MIN_ROWS = 4
MIN_BLOCKS = 8
MIN_ROW_BLOCKS = 256  # rows x shared blocks

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class SharedPrefix:
    rows: torch.Tensor  # [n] int64: decode rows sharing the prefix
    blocks: torch.Tensor  # [nb] int64: the prefix's physical blocks, in order


@dataclass(slots=True)
class DecodeCascade:
    groups: list[SharedPrefix]
    starts: torch.Tensor  # [num_decode] int32: shared prefix length of each row (0 outside every group)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Cascade needs the CPU flash kernel and the C++ decode kernel (float32, float64 or bfloat16 on CPU)."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16) and _FLASH_CPU is not None
            and cpu_paged_attention.load() is not None)


def find_shared_prefixes(tables: np.ndarray, lens: np.ndarray, block_size: int, device: torch.device,
                         min_rows: int = MIN_ROWS, min_blocks: int = MIN_BLOCKS,
                         min_row_blocks: int = MIN_ROW_BLOCKS) -> DecodeCascade | None:
    """Group decode rows by the physical blocks they share at the start of their block tables.

    ``tables: [B, W]`` int32 (rows padded past their blocks), ``lens: [B]`` context lengths. Rows are grouped
    by their first ``min_blocks`` blocks; a group of at least ``min_rows`` rows shares the longest run of
    blocks common to all its rows and lying wholly before each row's newest position, and is kept when rows x
    shared blocks reaches ``min_row_blocks``. ``None`` when no group qualifies (the plain kernel then runs
    alone)."""
    lens = np.asarray(lens, dtype=np.int64)
    if len(lens) < min_rows or tables.shape[1] < min_blocks:
        return None
    visible = (lens - 1) // block_size  # full blocks before each row's newest position: [B]
    eligible = np.flatnonzero(visible >= min_blocks)
    if len(eligible) < min_rows:
        return None
    _, inverse, counts = np.unique(tables[eligible, :min_blocks], axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    starts = np.zeros(len(lens), dtype=np.int32)
    groups: list[SharedPrefix] = []
    for key in np.flatnonzero(counts >= min_rows):
        rows = eligible[inverse == key]
        width = int(visible[rows].min())
        same = (tables[rows, :width] == tables[rows[0], :width]).all(axis=0)  # [width]
        shared = width if same.all() else int(np.argmin(same))  # >= min_blocks: the grouping key is common
        if len(rows) * shared < min_row_blocks:
            continue
        starts[rows] = shared * block_size
        groups.append(SharedPrefix(torch.from_numpy(rows).to(device),
                                   torch.from_numpy(tables[rows[0], :shared].astype(np.int64)).to(device)))
    return DecodeCascade(groups, torch.from_numpy(starts).to(device)) if groups else None


def cascade_decode_attention(query: torch.Tensor,  # [B, H, D]
                             k_cache: torch.Tensor, v_cache: torch.Tensor,  # [num_blocks, block_size, kvh, D]
                             block_tables: torch.Tensor, context_lens: torch.Tensor,  # [B, max_blocks], [B]
                             scale: float, cascade: DecodeCascade) -> torch.Tensor:  # [B, H, D]
    """Decode attention (kernels/paged_attention.py's contract, no sliding window) with shared prefixes
    attended once per group."""
    B, H, _ = query.shape
    acc = torch.float32 if query.dtype == torch.bfloat16 else query.dtype  # the decode kernel's accumulator
    prefix_out = query.new_zeros(query.shape, dtype=acc)  # [B, H, D]: attention over each row's shared prefix
    prefix_lse = query.new_zeros(B, H, dtype=acc)  # [B, H]: its log-sum-exp
    if native_supports(query, k_cache):  # every group in one call of the C++ kernel, blocks read in place
        rows = torch.cat([group.rows for group in cascade.groups])  # [R]
        plan = prefix_plan([len(group.rows) for group in cascade.groups], [group.blocks for group in cascade.groups],
                           k_cache.shape[1])
        out, lse = paged_prefix_attention_cpu(query.index_select(0, rows), k_cache, v_cache, plan, scale)
        prefix_out.index_copy_(0, rows, out.to(acc))
        prefix_lse.index_copy_(0, rows, lse.to(acc))
        return cpu_paged_attention.paged_decode_attention_cpu(query, k_cache, v_cache, block_tables, context_lens,
                                                              scale, None, cascade.starts, prefix_out, prefix_lse)
    for group in cascade.groups:
        q = query.index_select(0, group.rows).transpose(0, 1)[None]  # [1, H, n, D]
        k = k_cache.index_select(0, group.blocks).flatten(0, 1).transpose(0, 1)[None]  # [1, kvh, P, D]
        v = v_cache.index_select(0, group.blocks).flatten(0, 1).transpose(0, 1)[None]
        out, lse = _FLASH_CPU(q, k, v, scale=scale)  # [1, H, n, D], [1, H, n]
        prefix_out.index_copy_(0, group.rows, out[0].transpose(0, 1).to(acc))
        prefix_lse.index_copy_(0, group.rows, lse[0].transpose(0, 1).to(acc))
    return cpu_paged_attention.paged_decode_attention_cpu(query, k_cache, v_cache, block_tables, context_lens,
                                                          scale, None, cascade.starts, prefix_out, prefix_lse)
