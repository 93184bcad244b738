"""Cascade decode attention (kernels/cascade_attention.py): grouping rows by shared prefix blocks, the merged
result against the float64 reference, and the engine's greedy tokens with cascade on equal to each request
run alone."""
import numpy as np
import pytest
import torch

from kernels import cascade_attention, cpu_paged_attention
from kernels.paged_attention import paged_decode_attention_reference
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.tiny_model import tiny_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not cascade_attention.available(CPU, torch.float64),
                                reason="no C++ compiler: the engine uses the torch reference, without cascade")


def find(tables, lens, bs=4, **limits):
    limits = {"min_rows": 2, "min_blocks": 2, "min_row_blocks": 1, **limits}
    return cascade_attention.find_shared_prefixes(np.array(tables, dtype=np.int32), np.array(lens), bs, CPU,
                                                  **limits)


def groups_of(cascade):
    return sorted((g.rows.tolist(), g.blocks.tolist()) for g in cascade.groups)


def test_rows_group_by_their_common_leading_blocks():
    tables = [[1, 2, 3, 9, 0], [1, 2, 3, 8, 0], [5, 6, 7, 7, 0], [1, 2, 4, 4, 0], [5, 6, 7, 10, 11]]
    cascade = find(tables, [16, 16, 16, 16, 20])
    # rows 0, 1, 3 share blocks 1, 2 (row 3 diverges at the third); rows 2, 4 share 5, 6, 7
    assert groups_of(cascade) == [([0, 1, 3], [1, 2]), ([2, 4], [5, 6, 7])]
    assert cascade.starts.tolist() == [8, 8, 12, 8, 12]


def test_the_newest_position_always_stays_outside_the_shared_prefix():
    # both rows share 3 blocks, but row 1's newest token sits in the third (context 12 at block size 4 ends
    # it): only 2 blocks may be shared, or row 1 would have no position of its own left
    cascade = find([[1, 2, 3, 4], [1, 2, 3, 0]], [16, 12])
    assert groups_of(cascade) == [([0, 1], [1, 2])]


def test_small_groups_and_short_prefixes_stay_on_the_plain_kernel():
    tables = [[1, 2, 3, 9], [1, 2, 3, 8], [7, 2, 3, 8]]
    assert find(tables, [16, 16, 16], min_rows=3) is None  # only two rows share
    assert find(tables, [16, 16, 16], min_blocks=4) is None  # longer than any row's visible blocks
    assert find(tables, [16, 16, 16], min_row_blocks=7) is None  # 2 rows x 3 blocks
    assert find(tables, [16, 16, 16], min_row_blocks=6) is not None
    assert find([[1, 2, 3], [1, 2, 3]], [9, 9]) is not None
    assert find([[1, 2, 3], [1, 2, 3]], [8, 8]) is None  # newest token in block 2: one visible block each


def paged_case(dtype, seed=0, bs=8, heads=6, kv_heads=2, dim=16):
    """Ten rows: seven behind a 5-block prefix (two of them also sharing 2 blocks after it), three alone;
    the last two of the seven are one request verifying a draft (same table, consecutive context lengths)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(80, bs, kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)  # [NB, bs, kvh, D]
    v = torch.randn(80, bs, kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)
    prefix = [3, 17, 4, 40, 9]
    tables = [prefix + [50 + 3 * r, 51 + 3 * r, 52 + 3 * r] for r in range(5)]
    tables += [prefix + [20, 21, 22], prefix + [20, 21, 22]]  # one request: rows for a verified draft
    tables += [[60 + 3 * r, 61 + 3 * r, 62 + 3 * r, 0, 0, 0, 0, 0] for r in range(3)]
    lens = [41, 47, 55, 64, 50, 60, 61, 3, 20, 24]
    q = torch.randn(len(lens), heads, dim, generator=g, dtype=torch.float64).to(dtype)  # [B, H, D]
    return q, k, v, np.array(tables, dtype=np.int32), np.array(lens)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_cascade_equals_the_reference(dtype, tol):
    q, k, v, tables, lens = paged_case(dtype)
    cascade = cascade_attention.find_shared_prefixes(tables, lens, 8, CPU, min_rows=2, min_blocks=2,
                                                     min_row_blocks=1)
    assert [len(g.rows) for g in cascade.groups] == [7] and cascade.starts.tolist()[:7] == [40] * 7
    bt, ctx = torch.from_numpy(tables), torch.from_numpy(lens).int()
    out = cascade_attention.cascade_decode_attention(q, k, v, bt, ctx, 0.25, cascade)
    ref = paged_decode_attention_reference(q.double(), k.double(), v.double(), bt, ctx, 0.25, None)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    plain = cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, ctx, 0.25)
    assert not torch.equal(out[:7], plain[:7])  # a different summation order: cascade really ran
    assert torch.equal(out[7:], plain[7:])  # rows outside every group take the plain kernel's path


def test_kernel_rejects_prefix_parts_of_the_wrong_shape():
    q, k, v, tables, lens = paged_case(torch.float32)
    bt, ctx = torch.from_numpy(tables), torch.from_numpy(lens).int()
    starts = torch.zeros(len(lens), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="prefix_out"):
        cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, ctx, 0.25, None, starts, q[:3], q[:, :, 0])
    lse = q[:, :, 0].contiguous()
    with pytest.raises(RuntimeError, match="newest position"):
        cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, ctx, 0.25, None, ctx.clone(), q, lse)
    with pytest.raises(RuntimeError, match="sliding window"):
        cpu_paged_attention.paged_decode_attention_cpu(q, k, v, bt, ctx, 0.25, 8, starts, q, lse)
    half = [t.to(torch.bfloat16) for t in (q, k, v)]  # bfloat16 queries take their prefix parts in float32 only
    with pytest.raises(RuntimeError, match="accumulator"):
        cpu_paged_attention.paged_decode_attention_cpu(*half, bt, ctx, 0.25, None, starts, half[0],
                                                       lse.to(torch.bfloat16))


@pytest.mark.parametrize("overrides", [{}, {"layer_sliding_windows": (None, 12)}], ids=["llama", "one-window-layer"])
def test_engine_with_cascade_equals_each_request_alone(monkeypatch, overrides):
    """Eight requests behind one 300-token prefix (37 blocks of 8): their decode steps attend it by cascade,
    and every token equals the request's tokens generated alone without a cache (float64 random model)."""
    calls = []
    real = cascade_attention.cascade_decode_attention
    monkeypatch.setattr("shared.model.attention.cascade_decode_attention",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    model = tiny_model(seed=3, **overrides)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, model.config.vocab_size, (300,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, model.config.vocab_size, (5 + 3 * i,), generator=gen).tolist()
               for i in range(8)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=48, enable_prefix_caching=False,
                                           max_num_batched_tokens=512)).generate([p], greedy)[0] for p in prompts]
    engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=160, max_num_batched_tokens=512))
    assert engine.generate(prompts, greedy) == alone
    assert calls and max(calls) == 8  # all eight decoding together went through cascade
