"""Attention over the paged KV cache for one flattened batch of variable-length chunks.

Token order in a batch (built by the model runner): first ``num_decode`` single-token sequences, then the
prefill chunks, each contiguous. Every layer first stores the batch's new K/V into the cache, then attends,
so a sequence whose prefix blocks are being computed in this very step by another sequence (a prefix hit
on a block scheduled in the same step) reads them correctly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cascade_attention import DecodeCascade, cascade_decode_attention
from kernels.kv_store import store_kv
from kernels.paged_attention import paged_decode_attention
from kernels.prefill_attention import PrefillPlan, build_plan, native_supports, paged_prefill_attention_cpu


@dataclass(slots=True)
class PrefillChunk:
    """One multi-token chunk: tokens ``[start, end)`` of the batch are positions
    ``[context_len - (end - start), context_len)`` of the sequence."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefills: list[PrefillChunk]
    block_size: int
    masks: dict = field(default_factory=dict)  # (q_len, context_len, window, dtype) -> additive mask, per step
    decode_cascade: DecodeCascade | None = None  # decode rows sharing prefix blocks (CPU; windowless layers)
    prefill_plan: PrefillPlan | None = None  # the prefills as the CPU prefill kernel reads them (built on first use)


def _chunk_mask(q_len: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean mask [q_len, context_len]: query i (position context_len-q_len+i) sees key j iff causal
    and inside the sliding window."""
    q_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _masked_chunk_attention(qc, kc, vc, q_len: int, context_len: int, sliding_window: int | None, scale: float,
                            masks: dict) -> torch.Tensor:
    """``qc: [H, q_len, D]`` over ``kc, vc: [kvh, n, D]`` with the chunk's causal (and window) mask.

    On CPU in float32/bfloat16 this calls the flash kernel with an additive mask (GQA native): with a mask,
    ``scaled_dot_product_attention`` falls back to the math path, about 3x slower for a chunk over a long cached
    prefix. The additive mask of one (q_len, context_len, window) is built once per step (``masks``) and shared
    by every layer. Elsewhere (float64 exactness runs, CUDA) the boolean mask goes through SDPA."""
    if _FLASH_CPU is not None and qc.device.type == "cpu" and qc.dtype in (torch.float32, torch.bfloat16):
        key = (q_len, context_len, sliding_window, qc.dtype)
        additive = masks.get(key)
        if additive is None:
            allowed = _chunk_mask(q_len, context_len, sliding_window, qc.device)
            additive = torch.zeros(allowed.shape, dtype=qc.dtype).masked_fill_(~allowed, float("-inf"))[None, None]
            masks[key] = additive
        return _FLASH_CPU(qc[None], kc[None], vc[None], attn_mask=additive, scale=scale)[0][0]
    mask = _chunk_mask(q_len, context_len, sliding_window, qc.device)
    return F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)


def _causal_chunk_attention(qc, kc, vc, scale: float) -> torch.Tensor:
    """``qc: [H, q_len, D]`` over its own ``kc, vc: [kvh, q_len, D]``, causal. On CPU in float32/bfloat16 the flash
    kernel is called directly (GQA native): ``scaled_dot_product_attention`` with ``enable_gqa`` takes the math
    path there, 7x slower for a 1,002-token chunk and 2.4x for 160 tokens (9 heads over 3, D 64, 2 cores)."""
    if _FLASH_CPU is not None and qc.device.type == "cpu" and qc.dtype in (torch.float32, torch.bfloat16):
        return _FLASH_CPU(qc[None], kc[None], vc[None], is_causal=True, scale=scale)[0][0]
    return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # q: [T, H, D]; k, v: [T, kvh, D]
    k_cache: torch.Tensor, v_cache: torch.Tensor,  # [num_blocks, block_size, kvh, D] (strided views)
    meta: AttentionMetadata, scale: float, sliding_window: int | None,
) -> torch.Tensor:  # [T, H, D]
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd and meta.decode_cascade is not None and sliding_window is None:
        out[:nd] = cascade_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, scale, meta.decode_cascade)
    elif nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, scale, sliding_window)
    if meta.prefills and native_supports(q, k_cache):
        if meta.prefill_plan is None:
            meta.prefill_plan = build_plan(meta.prefills, k_cache.shape[1])
        paged_prefill_attention_cpu(q, k_cache, v_cache, out, meta.prefill_plan, scale, sliding_window)
        return out
    for chunk in meta.prefills:
        q_len = chunk.end - chunk.start
        qc = q[chunk.start:chunk.end].transpose(0, 1)  # [H, q_len, D]
        if chunk.context_len == q_len:  # no earlier context: attend within the chunk itself
            kc, vc = k[chunk.start:chunk.end], v[chunk.start:chunk.end]  # [q_len, kvh, D]
        else:
            n = chunk.context_len
            kc = k_cache[chunk.block_table].flatten(0, 1)[:n]  # [n, kvh, D]
            vc = v_cache[chunk.block_table].flatten(0, 1)[:n]
        kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)  # [kvh, n, D]
        if sliding_window is None and chunk.context_len == q_len:
            o = _causal_chunk_attention(qc, kc, vc, scale)
        else:
            o = _masked_chunk_attention(qc, kc, vc, q_len, chunk.context_len, sliding_window, scale, meta.masks)
        out[chunk.start:chunk.end] = o.transpose(0, 1)
    return out
