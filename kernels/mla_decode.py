"""MLA decode attention in the absorbed form: one query token per sequence over the paged latent cache
(DeepSeek V3; ``shared/model/mla_attention.py`` says how latents are laid out and absorbed).

Invariants (shared by the torch reference and the Triton kernel):
  * q_abs: [B, H, latent] — absorbed queries ``[q_nope @ W_UK, rotated q_pe]``, ``latent = rank + rope``.
  * k_cache / v_cache: [num_blocks, block_size, 1, latent / 2] (per-layer strided views): a token's latent row is
    its K slot (first half) followed by its V slot (second half).
  * block_tables: [B, max_blocks] int32 (entries past ``ceil(context_len / block_size)`` must be valid ids);
    context_lens: [B] int32 >= 1, the new token's row already stored.
  * Scores ``q_abs . row * scale`` over all ``latent`` dims; values are the first ``rank`` dims of each row (the
    latent ``c``). Output: [B, H, rank] in q_abs.dtype; softmax in float32 (the Triton kernel accumulates in
    float32 online, block by block).

``TRITON_INTERPRET`` is read when kernels are decorated, i.e. at import.
"""
from __future__ import annotations

import torch

from kernels.triton_support import tl, triton, use_triton


def mla_decode_attention_reference(q_abs, k_cache, v_cache, block_tables, context_lens, rank: int,
                                   scale: float) -> torch.Tensor:
    """Vectorised torch version: gather every sequence's rows, mask past its length, softmax, values."""
    b, heads, latent = q_abs.shape
    if b == 0:
        return q_abs.new_empty(0, heads, rank)
    tables = block_tables.long()  # [B, max_blocks]
    rows = torch.cat([k_cache[tables], v_cache[tables]], dim=-1).view(b, -1, latent).to(q_abs.dtype)  # [B, n, lat]
    seen = torch.arange(rows.shape[1], device=rows.device)[None, :] < context_lens.long()[:, None]  # [B, n]
    scores = torch.matmul(q_abs, rows.transpose(1, 2)) * scale  # [B, H, n]
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_abs.dtype)
    return torch.matmul(probs, rows[:, :, :rank])  # [B, H, rank]


if triton is not None:

    @triton.jit
    def _mla_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kd,
        stride_vb, stride_vs, stride_vd,
        stride_btb, stride_btn,
        stride_ob, stride_oh, stride_od,
        scale, half, rank,
        BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    ):
        # One program per (sequence b, head h); online softmax in fp32 over the latent rows.
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        d = tl.arange(0, HALF_PAD)  # d: [HALF_PAD]
        d_mask = d < half
        s_off = tl.arange(0, BS_PAD)  # s_off: [BS_PAD]
        q_base = q_ptr + b * stride_qb + h * stride_qh
        q_k = tl.load(q_base + d * stride_qd, mask=d_mask, other=0.0).to(tl.float32) * scale  # first half
        q_v = tl.load(q_base + (half + d) * stride_qd, mask=d_mask, other=0.0).to(tl.float32) * scale
        v_rank = d < (rank - half)  # the second half's dims that are values (the rest is the RoPE key)
        m_i = -float("inf")
        l_i = 0.0
        acc_k = tl.zeros([HALF_PAD], dtype=tl.float32)  # output dims [0, half)
        acc_v = tl.zeros([HALF_PAD], dtype=tl.float32)  # output dims [half, rank)
        for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
            blk = tl.load(bt_ptr + b * stride_btb + i * stride_btn).to(tl.int64)
            pos = i * BLOCK_SIZE + s_off
            p_mask = (s_off < BLOCK_SIZE) & (pos < ctx)
            m2 = p_mask[:, None] & d_mask[None, :]  # [BS_PAD, HALF_PAD]
            rk = tl.load(k_ptr + blk * stride_kb + s_off[:, None] * stride_ks + d[None, :] * stride_kd,
                         mask=m2, other=0.0).to(tl.float32)
            rv = tl.load(v_ptr + blk * stride_vb + s_off[:, None] * stride_vs + d[None, :] * stride_vd,
                         mask=m2, other=0.0).to(tl.float32)
            s = tl.sum(rk * q_k[None, :], axis=1) + tl.sum(rv * q_v[None, :], axis=1)  # s: [BS_PAD]
            s = tl.where(p_mask, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc_k = acc_k * alpha + tl.sum(p[:, None] * rk, axis=0)
            acc_v = acc_v * alpha + tl.sum(p[:, None] * rv, axis=0)
            m_i = m_new
        o_base = out_ptr + b * stride_ob + h * stride_oh
        tl.store(o_base + d * stride_od, (acc_k / l_i).to(out_ptr.dtype.element_ty), mask=d_mask & (d < rank))
        tl.store(o_base + (half + d) * stride_od, (acc_v / l_i).to(out_ptr.dtype.element_ty),
                 mask=d_mask & v_rank)


def mla_decode_attention_triton(q_abs, k_cache, v_cache, block_tables, context_lens, rank: int,
                                scale: float) -> torch.Tensor:
    """Triton implementation of :func:`mla_decode_attention_reference` (same contract)."""
    b, heads, latent = q_abs.shape
    block_size, half = k_cache.shape[1], k_cache.shape[-1]
    assert latent == 2 * half and half <= rank <= latent, (latent, half, rank)
    out = torch.empty(b, heads, rank, dtype=q_abs.dtype, device=q_abs.device)
    if b == 0:
        return out
    k, v = k_cache[:, :, 0], v_cache[:, :, 0]  # [num_blocks, bs, half]
    _mla_decode_kernel[(b, heads)](
        q_abs, k, v, block_tables, context_lens, out,
        *q_abs.stride(), *k.stride(), *v.stride(), *block_tables.stride(), *out.stride(),
        float(scale), half, rank,
        BLOCK_SIZE=block_size, BS_PAD=triton.next_power_of_2(block_size), HALF_PAD=triton.next_power_of_2(half),
    )
    return out


def mla_decode_attention(q_abs, k_cache, v_cache, block_tables, context_lens, rank: int,
                         scale: float) -> torch.Tensor:
    """Dispatch: Triton on CUDA tensors (or ``DEEPINFER_FORCE_TRITON=1``), else the torch reference."""
    fn = mla_decode_attention_triton if use_triton(q_abs) else mla_decode_attention_reference
    return fn(q_abs, k_cache, v_cache, block_tables, context_lens, rank, scale)
