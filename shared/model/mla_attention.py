"""Multi-head latent attention (DeepSeek V2/V3) over the paged KV cache, in the absorbed form.

The cache holds one latent row per token and layer, ``L = [c (kv_lora_rank, normed), k_pe (qk_rope_head_dim,
rotated)]``, written across the paged layout's K slot (its first half) and V slot (its second half):
``k_cache, v_cache: [num_blocks, block_size, 1, latent_dim / 2]`` (``ModelConfig.kv_cache_dim``). Nothing is
expanded into per-head K/V, in prefill or decode: with ``W_UK: [H, nope, r]`` and ``W_UV: [H, v, r]`` the two
halves of ``kv_b_proj``, a query ``q = [q_nope, q_pe]`` becomes ``q_abs = [q_nope @ W_UK, q_pe]: [H, latent_dim]``;
attention is then multi-query over the latent rows (scores ``q_abs . L_j``, values ``c_j``), and the output
``o_lat: [H, r]`` goes through ``W_UV``. Mathematically equal to transformers' expanded
``softmax(q . k^T * scale) v`` with ``k = [W_UK c, k_pe]``, ``v = W_UV c`` (summation order differs: fp32
logits agree to ~1e-6).

Batch layout and metadata are ``shared/model/attention.py``'s (decode rows first, then prefill chunks; every
layer stores the batch's rows before attending). Decode rows go through ``kernels/mla_decode.py`` (a torch
reference on CPU, a Triton kernel on CUDA, checked against each other under ``TRITON_INTERPRET=1``); prefill
chunks attend in torch.
"""
from __future__ import annotations

import torch

from kernels.kv_store import store_kv
from kernels.mla_decode import mla_decode_attention
from shared.model.attention import AttentionMetadata


def store_latent(latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write ``latent: [T, latent_dim]`` into the cache slots ``slot_mapping: [T]`` (first half K, second V)."""
    half = latent.shape[-1] // 2
    store_kv(latent[:, None, :half], latent[:, None, half:], k_cache, v_cache, slot_mapping)


def gather_latent(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The latent rows of the blocks ``block_table: [n_blocks]`` in order: ``[n_blocks * block_size, latent_dim]``."""
    k, v = k_cache[block_table], v_cache[block_table]  # [n_blocks, bs, 1, half] each
    return torch.cat([k, v], dim=-1).flatten(0, 2)


def _attend_rows(q: torch.Tensor, rows: torch.Tensor, rank: int, scale: float,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """``q: [H, q_len, latent_dim]`` over ``rows: [n, latent_dim]`` (``mask: [q_len, n]`` bool, True = seen) →
    ``[q_len, H, rank]``. Softmax in float32, as transformers' eager attention."""
    scores = torch.matmul(q, rows.T) * scale  # [H, q_len, n]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, rows[:, :rank]).transpose(0, 1)  # [q_len, H, rank]


def attend_latent(q_abs: torch.Tensor, latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rank: int, scale: float) -> torch.Tensor:
    """Store the batch's ``latent: [T, latent_dim]`` rows, then attend with its absorbed queries ``q_abs: [T, H,
    latent_dim]``: the latent outputs ``[T, H, rank]`` (decode rows by ``kernels.mla_decode``, prefill chunks
    causal over their sequence's rows)."""
    store_latent(latent, k_cache, v_cache, meta.slot_mapping)
    out = q_abs.new_empty(q_abs.shape[0], q_abs.shape[1], rank)
    nd = meta.num_decode
    if nd:
        out[:nd] = mla_decode_attention(q_abs[:nd], k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_context_lens, rank, scale)
    for chunk in meta.prefills:
        q_len, n = chunk.end - chunk.start, chunk.context_len
        rows = gather_latent(k_cache, v_cache, chunk.block_table.long())[:n]  # [n, latent]
        q_pos = torch.arange(n - q_len, n, device=rows.device)[:, None]
        mask = torch.arange(n, device=rows.device)[None, :] <= q_pos  # [q_len, n] causal
        out[chunk.start:chunk.end] = _attend_rows(q_abs[chunk.start:chunk.end].transpose(0, 1), rows, rank,
                                                  scale, mask)
    return out
