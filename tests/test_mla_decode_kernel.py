"""The MLA absorbed decode kernel (kernels/mla_decode.py): Triton, run by Triton's CPU interpreter, equals the torch
reference, and the reference equals MLA written the expanded way (per-head K = W_UK c plus the shared RoPE key,
V = W_UV c: what transformers computes), on ragged batches over paged latent rows.

TRITON_INTERPRET must be set before ``triton`` (and thus ``kernels.*``) is imported."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kernels.mla_decode import (  # noqa: E402
    mla_decode_attention, mla_decode_attention_reference, mla_decode_attention_triton)

RANK, ROPE, HEADS, NOPE, V = 32, 16, 4, 12, 10   # latent 48: a row is K slot 24 + V slot 24


def paged(lens, block_size, dtype, seed=0):
    """A shuffled paged latent cache holding ``lens[b]`` rows per sequence: (k_cache, v_cache, tables, rows)."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(per) + 3, generator=g)[:sum(per)]
    num_blocks = sum(per) + 3
    half = (RANK + ROPE) // 2
    k_cache = torch.zeros(num_blocks, block_size, 1, half, dtype=dtype)
    v_cache = torch.zeros(num_blocks, block_size, 1, half, dtype=dtype)
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    rows, at = [], 0
    for b, n in enumerate(lens):
        r = torch.randn(n, RANK + ROPE, generator=g, dtype=torch.float64).to(dtype)
        rows.append(r)
        for j in range(n):
            blk = int(ids[at + j // block_size])
            k_cache[blk, j % block_size, 0], v_cache[blk, j % block_size, 0] = r[j, :half], r[j, half:]
        tables[b, :per[b]] = ids[at:at + per[b]].to(torch.int32)
        at += per[b]
    return k_cache, v_cache, tables, rows


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-5)])   # Triton sums in fp32
@pytest.mark.parametrize("lens,block_size", [([1, 7, 16, 33], 8), ([5, 64], 16)])
def test_triton_equals_the_reference(dtype, atol, lens, block_size):
    k_cache, v_cache, tables, _ = paged(lens, block_size, dtype)
    q = torch.randn(len(lens), HEADS, RANK + ROPE, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = mla_decode_attention_reference(q, k_cache, v_cache, tables, ctx, RANK, 0.3)
    got = mla_decode_attention_triton(q, k_cache, v_cache, tables, ctx, RANK, 0.3)
    assert got.shape == (len(lens), HEADS, RANK) and torch.allclose(got, ref, atol=atol, rtol=0), \
        (got - ref).abs().max()


def test_the_reference_equals_expanded_mla_in_float64():
    lens, dtype = [3, 20], torch.float64
    k_cache, v_cache, tables, rows = paged(lens, 8, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=g, dtype=dtype)
    w_uv = torch.randn(HEADS, V, RANK, generator=g, dtype=dtype)
    q_nope = torch.randn(len(lens), HEADS, NOPE, generator=g, dtype=dtype)
    q_pe = torch.randn(len(lens), HEADS, ROPE, generator=g, dtype=dtype)
    scale = (NOPE + ROPE) ** -0.5
    q_abs = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe], dim=-1)
    got = torch.einsum("bhr,hvr->bhv", mla_decode_attention(q_abs, k_cache, v_cache, tables,
                                                            torch.tensor(lens, dtype=torch.int32), RANK, scale), w_uv)
    for b, r in enumerate(rows):
        c, k_pe = r[:, :RANK], r[:, RANK:]
        k = torch.cat([torch.einsum("nr,hkr->hnk", c, w_uk), k_pe[None].expand(HEADS, -1, -1)], dim=-1)
        v = torch.einsum("nr,hvr->hnv", c, w_uv)
        q = torch.cat([q_nope[b], q_pe[b]], dim=-1)[:, None]                    # [H, 1, nope + rope]
        want = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1) @ v         # [H, 1, v]
        assert torch.allclose(got[b], want[:, 0], atol=1e-10)


def test_dispatcher_takes_triton_when_forced(monkeypatch):
    k_cache, v_cache, tables, _ = paged([9], 8, torch.float32)
    q = torch.randn(1, HEADS, RANK + ROPE)
    ctx = torch.tensor([9], dtype=torch.int32)
    monkeypatch.setenv("DEEPINFER_FORCE_TRITON", "1")
    forced = mla_decode_attention(q, k_cache, v_cache, tables, ctx, RANK, 0.5)
    assert torch.allclose(forced, mla_decode_attention_reference(q, k_cache, v_cache, tables, ctx, RANK, 0.5),
                          atol=1e-5)
