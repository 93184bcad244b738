"""Triton kernels vs torch references, run through the Triton CPU interpreter.

TRITON_INTERPRET must be set before ``triton`` (and thus ``kernels.*``) is
imported: ``@triton.jit`` reads it at decoration time.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kernels.kv_store import store_kv, store_kv_reference, store_kv_triton  # noqa: E402
from kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)

NUM_LAYERS = 3
LAYER = 1
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_kv_cache(num_blocks, block_size, kvh, D, dtype, seed=0):
    """Block-major engine layout; returns (kv_cache, k_view, v_view)."""
    g = torch.Generator().manual_seed(seed)
    # kv_cache: [num_blocks, num_layers, 2, block_size, kvh, D]
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, kvh, D,
                           generator=g, dtype=torch.float64).to(dtype)
    k_cache = kv_cache[:, LAYER, 0]  # [num_blocks, block_size, kvh, D], strided
    v_cache = kv_cache[:, LAYER, 1]
    assert not k_cache.is_contiguous()
    return kv_cache, k_cache, v_cache


def make_block_tables(context_lens, block_size, num_blocks, max_blocks, seed=0):
    """Each sequence gets distinct shuffled blocks; unused entries are 0."""
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(context_lens):
        nb = math.ceil(n / block_size)
        bt[b, :nb] = perm[nxt:nxt + nb].to(torch.int32)
        nxt += nb
    assert nxt <= num_blocks
    return bt


def naive_decode_attention(query, k_cache, v_cache, block_tables, context_lens,
                           scale, sliding_window=None):
    """Per-sequence, per-head loop: the ground truth for the reference."""
    B, H, D = query.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    for b in range(B):
        n = int(context_lens[b])
        p = n - 1
        js = [j for j in range(n) if sliding_window is None or p - j < sliding_window]
        ks = torch.stack([k_cache[int(block_tables[b, j // block_size]), j % block_size] for j in js])
        vs = torch.stack([v_cache[int(block_tables[b, j // block_size]), j % block_size] for j in js])
        # ks, vs: [len(js), kvh, D]
        for h in range(H):
            kh = h // (H // kvh)
            s = (ks[:, kh] @ query[b, h]) * scale  # s: [len(js)]
            w = torch.softmax(s, dim=0)
            out[b, h] = w @ vs[:, kh]
    return out


# (B, H, kvh, D, block_size, context_lens, sliding_window)
ATTN_CASES = [
    (1, 2, 2, 16, 8, [1], None),  # context_len=1
    (3, 4, 2, 16, 8, [5, 17, 8], None),  # GQA 2:1, non-multiples of bs
    (3, 4, 1, 32, 16, [33, 1, 16], None),  # MQA
    (2, 4, 2, 16, 8, [21, 9], 6),  # sliding window, spans blocks
    (3, 4, 1, 16, 16, [40, 3, 16], 16),  # window == block_size
    (2, 2, 2, 64, 32, [45, 70], 50),  # window across 3 blocks
    (2, 4, 4, 128, 8, [12, 3], 1),  # window=1: only the token itself
]


def _setup(case, dtype, seed=0):
    B, H, kvh, D, bs, lens, window = case
    max_blocks = max(math.ceil(n / bs) for n in lens) + 1
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 3
    _, k_cache, v_cache = make_kv_cache(num_blocks, bs, kvh, D, dtype, seed)
    bt = make_block_tables(lens, bs, num_blocks, max_blocks, seed)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, v_cache, bt, ctx, 1.0 / math.sqrt(D), window


@pytest.mark.parametrize("case", ATTN_CASES)
def test_reference_matches_naive_float64(case):
    args = _setup(case, torch.float64)
    ref = paged_decode_attention_reference(*args)
    exp = naive_decode_attention(*args)
    assert ref.dtype == torch.float64 and ref.shape == exp.shape
    torch.testing.assert_close(ref, exp, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_paged_attention_triton_matches_reference(case, dtype):
    q, k_cache, v_cache, bt, ctx, scale, window = _setup(case, dtype, seed=3)
    out = paged_decode_attention_triton(q, k_cache, v_cache, bt, ctx, scale, window)
    # Compare against the reference in fp32 (fp16 SDPA on CPU would add its
    # own rounding error on top of the kernel's).
    ref = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(),
                                           bt, ctx, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=ATOL[dtype], rtol=0)
    # The reference in the low-precision dtype itself also stays close.
    ref_lp = paged_decode_attention_reference(q, k_cache, v_cache, bt, ctx, scale, window)
    assert ref_lp.dtype == dtype
    torch.testing.assert_close(ref_lp.float(), ref, atol=4 * ATOL[dtype], rtol=0)


def test_paged_attention_dispatcher(monkeypatch):
    args = _setup(ATTN_CASES[1], torch.float32)
    monkeypatch.delenv("DEEPINFER_FORCE_TRITON", raising=False)
    cpu = paged_decode_attention(*args)
    monkeypatch.setenv("DEEPINFER_FORCE_TRITON", "1")
    forced = paged_decode_attention(*args)
    torch.testing.assert_close(forced, cpu, atol=1e-5, rtol=0)


def _store_inputs(dtype, T, kvh, D, bs, num_blocks, with_pad, seed=0):
    g = torch.Generator().manual_seed(seed + 4)
    key = torch.randn(T, kvh, D, generator=g, dtype=torch.float64).to(dtype)
    value = torch.randn(T, kvh, D, generator=g, dtype=torch.float64).to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T].to(torch.int64)
    if with_pad:
        slots[::3] = -1
    return key, value, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_pad", [False, True])
@pytest.mark.parametrize("kvh,D,bs", [(2, 16, 8), (1, 32, 16), (3, 8, 8)])
def test_store_kv_triton_matches_reference(dtype, with_pad, kvh, D, bs):
    num_blocks, T = 5, 11
    key, value, slots = _store_inputs(dtype, T, kvh, D, bs, num_blocks, with_pad)
    kv_ref, k_ref, v_ref = make_kv_cache(num_blocks, bs, kvh, D, dtype, seed=7)
    kv_tri, k_tri, v_tri = make_kv_cache(num_blocks, bs, kvh, D, dtype, seed=7)
    before = kv_ref.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(kv_ref, kv_tri)  # bit-identical, whole cache (other layers too)
    # Reference semantics: written slots hold key/value, everything else untouched.
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // bs, LAYER, 0, s % bs] = key[t]
            expected[s // bs, LAYER, 1, s % bs] = value[t]
    assert torch.equal(kv_ref, expected)


def test_store_kv_all_padding_and_dispatcher(monkeypatch):
    kvh, D, bs, num_blocks = 2, 16, 8, 3
    key, value, _ = _store_inputs(torch.float32, 4, kvh, D, bs, num_blocks, False)
    slots = torch.full((4,), -1, dtype=torch.int64)
    kv, k, v = make_kv_cache(num_blocks, bs, kvh, D, torch.float32)
    before = kv.clone()
    store_kv_reference(key, value, k, v, slots)
    store_kv_triton(key, value, k, v, slots)
    assert torch.equal(kv, before)
    slots = torch.tensor([3, -1, 17, 8])
    for force in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_FORCE_TRITON", force)
        kv2, k2, v2 = make_kv_cache(num_blocks, bs, kvh, D, torch.float32)
        store_kv(key, value, k2, v2, slots)
        assert torch.equal(k2[0, 3], key[0]) and torch.equal(v2[2, 1], value[2])
        assert torch.equal(k2[1, 0], key[3]) and torch.equal(kv2[:, 0], before[:, 0])
