"""The CPU prefill attention kernel (kernels/cpu_prefill_attention.cpp): every chunk of a step in one call, against a
float64 softmax reference; a row's result independent of chunking and batch-mates (bit for bit); keys a row cannot
see never reach it, NaN included; refusals."""
import pytest
import torch

from kernels import cpu_paged_attention
from kernels.prefill_attention import (PrefillPlan, build_plan, native_supports, paged_prefill_attention_cpu,
                                       paged_prefix_attention_cpu, prefix_plan)
from shared.model.attention import PrefillChunk

pytestmark = pytest.mark.skipif(cpu_paged_attention.load() is None, reason="the C++ extension cannot be built here")


def reference(q, k, v, context_len, window, scale):
    """q: [q_len, H, D] at the last q_len positions; k, v: [context_len, KVH, D] → [q_len, H, D] in float64."""
    q_len, H = q.shape[:2]
    k, v = (x.double().repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(context_len - q_len, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= (q_pos - k_pos) < window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


class Sequences:
    """Random sequences whose K/V sit in a shared paged cache, blocks shuffled; unused slots hold NaN."""

    def __init__(self, lengths, H, KVH, D, BS, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.H, self.D, self.BS = H, D, BS
        self.k = [torch.randn(n, KVH, D, generator=g, dtype=torch.float64).to(dtype) for n in lengths]
        self.v = [torch.randn(n, KVH, D, generator=g, dtype=torch.float64).to(dtype) for n in lengths]
        self.q = [2 * torch.randn(n, H, D, generator=g, dtype=torch.float64).to(dtype) for n in lengths]
        blocks = [-(-n // BS) for n in lengths]
        order = torch.randperm(sum(blocks) + 3, generator=g)
        self.tables, at = [], 0
        for nb in blocks:
            self.tables.append(order[at:at + nb])
            at += nb
        self.k_cache = torch.full((sum(blocks) + 3, BS, KVH, D), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        for i, n in enumerate(lengths):
            slots = self.tables[i].repeat_interleave(BS)[:n] * BS + torch.arange(n) % BS
            self.k_cache.view(-1, KVH, D)[slots] = self.k[i]
            self.v_cache.view(-1, KVH, D)[slots] = self.v[i]

    def run(self, pieces, scale, window):
        """``pieces``: (sequence, first, last) position ranges, one chunk each, all in one call → outputs per piece."""
        q = torch.cat([self.q[s][a:b] for s, a, b in pieces])
        chunks, at = [], 0
        for s, a, b in pieces:
            chunks.append(PrefillChunk(at, at + b - a, b, self.tables[s]))
            at += b - a
        out = torch.zeros_like(q)
        assert native_supports(q, self.k_cache)
        paged_prefill_attention_cpu(q, self.k_cache, self.v_cache, out, build_plan(chunks, self.BS), scale, window)
        sizes = [b - a for _, a, b in pieces]
        return list(out.split(sizes))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,KVH,D,BS", [(9, 3, 64, 16), (4, 1, 80, 5), (2, 2, 16, 32)])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_every_chunk_of_a_step_matches_the_softmax_reference(dtype, tol, H, KVH, D, BS, window):
    lengths = [300, 37, 1, 130]
    seqs = Sequences(lengths, H, KVH, D, BS, dtype)
    pieces = [(0, 190, 300), (1, 0, 37), (2, 0, 1), (3, 64, 130)]  # over cached context, fresh, one token, tile-aligned
    for s, a, _ in pieces:  # keys no row of the chunk can see (before its first query's window) are never read
        if window and a - window + 1 > 0:
            hidden = seqs.tables[s].repeat_interleave(BS)[:a - window + 1] * BS + torch.arange(a - window + 1) % BS
            seqs.k_cache.view(-1, KVH, D)[hidden] = float("nan")
            seqs.v_cache.view(-1, KVH, D)[hidden] = float("nan")
    outs = seqs.run(pieces, D ** -0.5, window)
    for (s, a, b), out in zip(pieces, outs):
        expected = reference(seqs.q[s][a:b], seqs.k[s][:b], seqs.v[s][:b], b, window, D ** -0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_a_rows_result_does_not_depend_on_chunking_or_batch_mates(dtype, window):
    """What makes chunked prefill and prefix-cache hits bit-identical to one-shot prefill."""
    seqs = Sequences([260, 90], 6, 2, 64, 16, dtype, seed=3)
    whole = seqs.run([(0, 0, 260)], 0.125, window)[0]
    pieces = seqs.run([(0, 0, 1), (0, 1, 63), (0, 63, 64), (0, 64, 200), (0, 200, 260), (1, 0, 90)], 0.125, window)
    assert torch.equal(torch.cat(pieces[:5]), whole)
    alone = seqs.run([(1, 0, 90)], 0.125, window)[0]
    assert torch.equal(pieces[5], alone)


def test_rows_outside_the_chunks_are_left_alone():
    seqs = Sequences([40], 4, 2, 32, 8, torch.float32)
    q = torch.cat([torch.ones(3, 4, 32), seqs.q[0][30:40]])  # three decode rows first, then the chunk
    out = torch.full_like(q, 7.0)
    plan = build_plan([PrefillChunk(3, 13, 40, seqs.tables[0])], 8)
    paged_prefill_attention_cpu(q, seqs.k_cache, seqs.v_cache, out, plan, 0.2, None)
    assert torch.equal(out[:3], torch.full((3, 4, 32), 7.0))
    torch.testing.assert_close(out[3:].double(), reference(seqs.q[0][30:40], seqs.k[0], seqs.v[0], 40, 0, 0.2),
                               atol=3e-6, rtol=3e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-6), (torch.bfloat16, 1e-2)])
def test_shared_prefix_rows_see_exactly_the_prefix_with_its_log_sum_exp(dtype, tol):
    """Cascade decode's shared part: rows of other sequences (here random queries) behind two prefixes."""
    seqs = Sequences([96, 40], 6, 3, 32, 8, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(7, 6, 32, generator=g, dtype=torch.float64).to(dtype)  # 4 rows behind prefix 0, 3 behind 1
    plan = prefix_plan([4, 3], [seqs.tables[0], seqs.tables[1]], 8)
    out, lse = paged_prefix_attention_cpu(q, seqs.k_cache, seqs.v_cache, plan, 0.3)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (7, 6, 32) and lse.shape == (7, 6)
    for rows, s in ((slice(0, 4), 0), (slice(4, 7), 1)):
        n = len(seqs.k[s])
        k, v = (x[s].double().repeat_interleave(2, dim=1) for x in (seqs.k, seqs.v))  # [n, H, D]
        scores = torch.einsum("qhd,khd->qhk", q[rows].double(), k) * 0.3  # every row sees all n positions
        torch.testing.assert_close(out[rows].double(), torch.einsum("qhk,khd->qhd", scores.softmax(-1), v),
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(lse[rows].double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        assert n % 8 == 0  # whole blocks: the prefix is what the plan says, no more


def test_bad_calls_are_refused():
    seqs = Sequences([20], 4, 2, 32, 8, torch.float32)
    q, out = seqs.q[0], torch.empty_like(seqs.q[0])
    plan = build_plan([PrefillChunk(0, 20, 20, seqs.tables[0])], 8)
    ext = cpu_paged_attention.load()
    args = (plan.starts, plan.ends, plan.context_lens, plan.block_tables, 0.1, 0)
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.paged_prefill_(q.bfloat16(), seqs.k_cache, seqs.v_cache, out.bfloat16(), *args)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.paged_prefill_(q[..., :24].contiguous(), seqs.k_cache[..., :24], seqs.v_cache[..., :24],
                           out[..., :24].contiguous(), *args)
    with pytest.raises(RuntimeError, match="block id out of range"):
        bad = PrefillPlan(plan.starts, plan.ends, plan.context_lens, plan.block_tables + 100)
        paged_prefill_attention_cpu(q, seqs.k_cache, seqs.v_cache, out, bad, 0.1, None)
    with pytest.raises(RuntimeError, match="no more rows than its context"):
        bad = PrefillPlan(plan.starts, plan.ends, plan.context_lens - 5, plan.block_tables)
        paged_prefill_attention_cpu(q, seqs.k_cache, seqs.v_cache, out, bad, 0.1, None)
    assert not native_supports(q.double(), seqs.k_cache.double())  # float64 exactness runs take SDPA
    assert not native_supports(q[..., :24], seqs.k_cache[..., :24])
