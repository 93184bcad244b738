"""Paged decode attention: one new query token per sequence over the paged KV cache.

Invariants (shared by reference and Triton kernel):
  * query: [B, H, D]; k_cache/v_cache: [num_blocks, block_size, kvh, D] with
    arbitrary strides (per-layer views of the block-major
    ``kv_cache[num_blocks, num_layers, 2, block_size, kvh, D]``).
  * block_tables: [B, max_blocks] int32; only the first
    ``ceil(context_len / block_size)`` entries of a row are read meaningfully,
    later entries must merely be valid block ids.
  * context_lens: [B] int32, >= 1, includes the new token (already stored);
    the query sits at position ``p = context_len - 1``.
  * GQA: query head h reads kv head ``h // (H // kvh)``; H % kvh == 0.
  * sliding_window W (None or > 0): position j is visible iff ``p - j < W``.
  * Output: [B, H, D] in query.dtype. Reference computes in query.dtype
    (float64 stays float64); the Triton kernel accumulates in fp32.

``TRITON_INTERPRET`` is read when kernels are decorated, i.e. at import.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from kernels import cpu_paged_attention

from kernels.triton_support import tl, triton, use_triton

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)   # what the C++ decode kernel takes


def paged_decode_attention_reference(
    query, k_cache, v_cache, block_tables, context_lens, scale,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Vectorised torch implementation (gather blocks + masked SDPA)."""
    B, H, D = query.shape
    _, block_size, kvh, _ = k_cache.shape
    assert H % kvh == 0, (H, kvh)
    if B == 0:
        return query.new_empty(B, H, D)
    ctx = context_lens.to(torch.long)  # ctx: [B]
    max_len = int(ctx.max())
    end_blk = (max_len + block_size - 1) // block_size
    first_blk = 0
    if sliding_window is not None:
        # Skip blocks no sequence in the batch can see.
        first_blk = int((ctx - sliding_window).clamp(min=0).min()) // block_size
    bt = block_tables[:, first_blk:end_blk].to(torch.long)  # bt: [B, nb]
    nb = bt.shape[1]
    L = nb * block_size
    idx = bt.reshape(-1)  # idx: [B*nb]
    # index_select on dim 0 copies whole blocks (contiguous inside a block);
    # noticeably faster than k_cache[bt] on strided views.
    # k, v: [B*nb, bs, kvh, D] -> [B, L, kvh, D] -> [B, kvh, L, D]
    k = k_cache.index_select(0, idx).reshape(B, L, kvh, D).transpose(1, 2).to(query.dtype)
    v = v_cache.index_select(0, idx).reshape(B, L, kvh, D).transpose(1, 2).to(query.dtype)
    pos = torch.arange(first_blk * block_size, first_blk * block_size + L,
                       device=query.device)  # pos: [L]
    mask = pos[None, :] < ctx[:, None]  # mask: [B, L]
    if sliding_window is not None:
        mask &= pos[None, :] >= (ctx - sliding_window)[:, None]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [B, H, 1, D]
        k, v,
        attn_mask=mask[:, None, None, :],  # [B, 1, 1, L]
        scale=scale,
        enable_gqa=(H != kvh),
    )  # out: [B, H, 1, D]
    return out[:, :, 0, :]


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_btb, stride_btn,
        stride_ob, stride_oh, stride_od,
        scale, head_dim, window,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr,
        D_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
    ):
        # One program per (sequence b, query head h); online softmax in fp32.
        b = tl.program_id(0)
        h = tl.program_id(1)
        kv_h = h // GROUP
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        start = 0
        if USE_WINDOW:
            start = tl.maximum(ctx - window, 0)

        d = tl.arange(0, D_PAD)  # d: [D_PAD]
        d_mask = d < head_dim
        s_off = tl.arange(0, BS_PAD)  # s_off: [BS_PAD]
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d * stride_qd,
                    mask=d_mask, other=0.0).to(tl.float32) * scale  # q: [D_PAD]

        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([D_PAD], dtype=tl.float32)  # acc: [D_PAD]
        for i in range(start // BLOCK_SIZE, tl.cdiv(ctx, BLOCK_SIZE)):
            blk = tl.load(bt_ptr + b * stride_btb + i * stride_btn).to(tl.int64)
            pos = i * BLOCK_SIZE + s_off  # pos: [BS_PAD]
            p_mask = (s_off < BLOCK_SIZE) & (pos >= start) & (pos < ctx)
            kv_mask = p_mask[:, None] & d_mask[None, :]  # [BS_PAD, D_PAD]
            k = tl.load(k_ptr + blk * stride_kb + s_off[:, None] * stride_ks
                        + kv_h * stride_kh + d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0).to(tl.float32)  # k: [BS_PAD, D_PAD]
            s = tl.sum(k * q[None, :], axis=1)  # s: [BS_PAD]
            s = tl.where(p_mask, s, -float("inf"))
            # Every visited block holds >= 1 visible position, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)  # p: [BS_PAD]
            v = tl.load(v_ptr + blk * stride_vb + s_off[:, None] * stride_vs
                        + kv_h * stride_vh + d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0).to(tl.float32)  # v: [BS_PAD, D_PAD]
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new

        out = acc / l_i
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention_triton(
    query, k_cache, v_cache, block_tables, context_lens, scale,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Triton implementation of :func:`paged_decode_attention_reference`."""
    B, H, D = query.shape
    _, block_size, kvh, _ = k_cache.shape
    assert H % kvh == 0, (H, kvh)
    assert sliding_window is None or sliding_window > 0, sliding_window
    out = torch.empty((B, H, D), dtype=query.dtype, device=query.device)
    if B == 0:
        return out
    _paged_decode_kernel[(B, H)](
        query, k_cache, v_cache, block_tables, context_lens, out,
        *query.stride(), *k_cache.stride(), *v_cache.stride(),
        *block_tables.stride(), *out.stride(),
        float(scale), D, int(sliding_window or 0),
        GROUP=H // kvh,
        BLOCK_SIZE=block_size,
        BS_PAD=triton.next_power_of_2(block_size),
        D_PAD=triton.next_power_of_2(D),
        USE_WINDOW=sliding_window is not None,
    )
    return out


def paged_decode_attention(
    query, k_cache, v_cache, block_tables, context_lens, scale,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Dispatch: Triton on CUDA tensors (or DEEPINFER_FORCE_TRITON=1); on CPU the C++ kernel for
    float32/bfloat16/float64 when it could be built, else the torch reference."""
    if use_triton(query):
        fn = paged_decode_attention_triton
    elif query.dtype in CPU_KERNEL_DTYPES and cpu_paged_attention.load() is not None:
        fn = cpu_paged_attention.paged_decode_attention_cpu
    else:
        fn = paged_decode_attention_reference
    return fn(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
