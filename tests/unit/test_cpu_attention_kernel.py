"""The CPU paged decode attention extension against the float64 torch reference: partial blocks, blocks shared
between sequences (a common prefix), sliding windows, head dims with and without a compiled specialisation,
float32 (vectorised exp), bfloat16 (float accumulation) and float64 (libm exp)."""
import pytest
import torch

from kernels import cpu_paged_attention
from kernels.paged_attention import paged_decode_attention_reference

kernel = cpu_paged_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler: the engine uses the torch reference")


def case(B, H, KVH, D, BS, lens, shared_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_seq = max((n + BS - 1) // BS for n in lens)
    num_blocks = shared_blocks + B * per_seq + 1
    k = torch.randn(num_blocks, BS, KVH, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(num_blocks, BS, KVH, D, generator=g, dtype=torch.float64)
    bt = torch.zeros(B, per_seq, dtype=torch.int32)
    for b in range(B):
        own = torch.randperm(B * per_seq, generator=g)[:per_seq] + shared_blocks
        bt[b] = own
        bt[b, :min(shared_blocks, per_seq)] = torch.arange(min(shared_blocks, per_seq))
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64) * 2
    return q, k, v, bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("D", [64, 128, 40])
@pytest.mark.parametrize("BS,window", [(16, None), (8, None), (16, 37), (32, 5)])
def test_matches_the_float64_reference(D, BS, window):
    q, k, v, bt, lens = case(B=5, H=6, KVH=2, D=D, BS=BS, lens=[1, BS - 1, BS, 3 * BS + 5, 300], shared_blocks=3)
    scale = D ** -0.5
    ref = paged_decode_attention_reference(q, k, v, bt, lens, scale, window)
    out64 = cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, lens, scale, window)
    torch.testing.assert_close(out64, ref, atol=1e-12, rtol=0)
    out32 = cpu_paged_attention.paged_decode_attention_cpu(q.float(), k.float(), v.float(), bt, lens, scale, window)
    ref32 = paged_decode_attention_reference(q.float().double(), k.float().double(), v.float().double(), bt, lens,
                                             scale, window)
    torch.testing.assert_close(out32.double(), ref32, atol=2e-6, rtol=0)
    # bfloat16 storage, float accumulation, one rounding of the result: within half a bfloat16 ulp of the exact
    # attention over the same bfloat16 inputs (outputs here are below 4 in magnitude: ulp 2^-6)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out16 = cpu_paged_attention.paged_decode_attention_cpu(qb, kb, vb, bt, lens, scale, window)
    ref16 = paged_decode_attention_reference(qb.double(), kb.double(), vb.double(), bt, lens, scale, window)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), ref16, atol=2 ** -7 + 1e-5, rtol=2 ** -8)


def test_peaked_softmax_over_a_long_shared_prefix():
    """Scores far apart (exp of very negative numbers underflows) over 1,100 tokens, 64 sequences sharing
    their first 60 blocks: the float32 kernel is as close to the float64 result as torch's own float32
    attention is (scores in the hundreds carry ~1e-5 of float32 rounding into the softmax)."""
    q, k, v, bt, lens = case(B=64, H=9, KVH=3, D=64, BS=16, lens=[1100] * 64, shared_blocks=60, seed=1)
    q, k, v = (q * 8).float(), k.float(), v.float()  # the reference sees exactly the float32 inputs
    ref = paged_decode_attention_reference(q.double(), k.double(), v.double(), bt, lens, 0.125, None)
    out = cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, lens, 0.125, None)
    torch_fp32 = paged_decode_attention_reference(q, k, v, bt, lens, 0.125, None)
    kernel_err = (out.double() - ref).abs().max().item()
    assert kernel_err <= 1.5 * (torch_fp32.double() - ref).abs().max().item()


def test_store_kv_equals_the_reference_and_rejects_bad_slots():
    """Strided cache views (the engine's head-major layout), strided key/value (split from one QKV output),
    padding slots (-1) skipped, float32 and float64; a slot past the cache is an error, not a stray write."""
    from kernels.kv_store import store_kv_reference
    from shared.model.kv_cache import layer_kv
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(2)
        qkv = torch.randn(40, 6 * 8 + 2 * 2 * 8, generator=g, dtype=dtype)  # [T, q + 2kv]
        k, v = qkv[:, 48:64].view(40, 2, 8), qkv[:, 64:].view(40, 2, 8)  # [T, kvh, D], strided
        slots = torch.randperm(12 * 4, generator=g)[:40]
        slots[[0, 7]] = -1
        caches = [torch.zeros(12, 3, 2, 2, 4, 8, dtype=dtype) for _ in range(2)]  # [NB, L, 2, kvh, bs, D]
        store_kv_reference(k, v, *layer_kv(caches[0], 1), slots)
        kernel.store_kv(k, v, *layer_kv(caches[1], 1), slots)
        assert torch.equal(caches[0], caches[1]) and caches[1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.store_kv(k, v, *layer_kv(caches[1], 1), torch.full((40,), 12 * 4))
