"""Prefill-chunk attention (shared/model/attention.py) against a float64 softmax reference: a chunk with no earlier
context (the causal flash call on CPU), a chunk over cached context (the masked call), with and without a
sliding window, in float32 (the flash kernels) and float64 (SDPA)."""
import pytest
import torch

from shared.model.attention import AttentionMetadata, PrefillChunk, attend

H, KVH, D, BS = 6, 2, 16, 8


def reference(q, k, v, context_len, window, scale):
    """q: [q_len, H, D] at the last q_len positions; k, v: [context_len, KVH, D] → [q_len, H, D] in float64."""
    q_len = q.shape[0]
    k, v = k.double().repeat_interleave(H // KVH, dim=1), v.double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(context_len - q_len, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("cached", [0, 21])
@pytest.mark.parametrize("window", [None, 7])
def test_chunk_attention_matches_the_softmax_reference(dtype, tol, cached, window):
    g = torch.Generator().manual_seed(cached + (window or 0))
    q_len = 37
    n = cached + q_len
    num_blocks = -(-n // BS)
    k_all = torch.randn(n, KVH, D, generator=g, dtype=torch.float64).to(dtype)
    v_all = torch.randn(n, KVH, D, generator=g, dtype=torch.float64).to(dtype)
    q = torch.randn(q_len, H, D, generator=g, dtype=torch.float64).to(dtype)
    k_cache = torch.zeros(num_blocks + 2, BS, KVH, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.randperm(num_blocks + 2, generator=g)[:num_blocks]  # blocks anywhere in the cache
    slots = block_table.repeat_interleave(BS)[:n] * BS + torch.arange(n) % BS
    k_cache.view(-1, KVH, D)[slots[:cached]] = k_all[:cached]  # the earlier context, already cached
    v_cache.view(-1, KVH, D)[slots[:cached]] = v_all[:cached]
    meta = AttentionMetadata(slot_mapping=slots[cached:], num_decode=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32),
                             prefills=[PrefillChunk(0, q_len, n, block_table)], block_size=BS)
    out = attend(q, k_all[cached:], v_all[cached:], k_cache, v_cache, meta, D ** -0.5, window)
    torch.testing.assert_close(out.double(), reference(q, k_all, v_all, n, window, D ** -0.5), atol=tol, rtol=tol)
    assert torch.equal(k_cache.view(-1, KVH, D)[slots], k_all)  # the chunk's own K/V were stored
