"""The C++ layer ops (kernels/cpu_layer_ops.cpp) against their torch references: RMSNorm alone and after the
residual add, SiLU-gated product (both signs, large magnitudes), RoPE in place (bit-identical) on a strided
view of the QKV output; the fallbacks for what the extension does not take; the model with and without them."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_paged_attention, layer_ops
from tests.tiny_model import all_logits, tiny_model

kernel = cpu_paged_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler: the engine uses the torch references")


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-14)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_add_rms_norm_match_the_reference(dtype, tol, rows):
    x, w, d = rand(rows, 576, dtype=dtype, scale=3), rand(576, dtype=dtype, seed=1), rand(rows, 576, dtype=dtype, seed=2)
    out = layer_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, layer_ops.rms_norm_reference(x, w, 1e-5), atol=tol, rtol=tol)
    strided = torch.cat([x, d], dim=1)[:, :576]  # rows not adjacent: the kernel reads through the row stride
    torch.testing.assert_close(layer_ops.rms_norm(strided, w, 1e-5), out, atol=0, rtol=0)
    h = x.clone()
    normed = layer_ops.add_rms_norm_(h, d, w, 1e-5)
    assert torch.equal(h, x + d)  # the residual add is exact and in place
    torch.testing.assert_close(normed, layer_ops.rms_norm_reference(x + d, w, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-7), (torch.float64, 1e-15)])
def test_silu_mul_matches_the_reference_over_both_signs_and_large_magnitudes(dtype, tol):
    gate = torch.cat([rand(5, 64, dtype=dtype, scale=4), torch.tensor([[-200.0, -88.0, -30.0, 0.0, 30.0, 88.0, 200.0,
                                                                         -1e-30] * 8] * 5, dtype=dtype)], dim=1)
    up = rand(5, 128, dtype=dtype, seed=3)
    out = layer_ops.silu_mul(torch.cat([gate, up], dim=1))
    ref = F.silu(gate.double()) * up.double()
    assert out.shape == (5, 128) and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_in_place_is_bit_identical_to_the_reference_on_the_qkv_view(dtype):
    T, H, KVH, D = 9, 6, 2, 64
    qkv = rand(T, (H + 2 * KVH) * D, dtype=dtype, scale=2)
    cos, sin = rand(T, D, dtype=dtype, seed=4).cos(), rand(T, D, dtype=dtype, seed=4).sin()
    view = qkv[:, :(H + KVH) * D].view(T, H + KVH, D)  # q and k of the QKV output: rows strided by the v part
    expected = layer_ops.rope_reference(view, cos, sin)
    untouched = qkv[:, (H + KVH) * D:].clone()
    out = layer_ops.rope_(view, cos, sin)
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(view, expected)
    assert torch.equal(qkv[:, (H + KVH) * D:], untouched)  # v is not touched


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 values apart ``a`` and ``b`` are, elementwise (same sign: their bit patterns' distance)."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    return (ia - ib).abs()


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_bfloat16_norms_round_where_the_reference_rounds(rows):
    """The bfloat16 kernel equals torch's bfloat16 ops (widen, normalise, round, scale, round) on all but a few
    elements, and those by one bfloat16 step: the float32 sums of squares differ only in their order. A kernel
    scaling in float32 before its one rounding (no intermediate rounding) differs on ~26% of the elements."""
    x, w, d = (rand(rows, 576, dtype=torch.bfloat16, scale=3), rand(576, dtype=torch.bfloat16, seed=1),
               rand(rows, 576, dtype=torch.bfloat16, seed=2))
    out, ref = layer_ops.rms_norm(x, w, 1e-5), layer_ops.rms_norm_reference(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    steps = _bf16_steps(out, ref)
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01
    h = x.clone()
    normed = layer_ops.add_rms_norm_(h, d, w, 1e-5)
    assert torch.equal(h, x + d)  # the residual add rounds as torch's bfloat16 add does
    steps = _bf16_steps(normed, layer_ops.rms_norm_reference(x + d, w, 1e-5))
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01


def test_bfloat16_silu_mul_and_rope_round_as_torch_does():
    gate = torch.cat([rand(5, 64, dtype=torch.bfloat16, scale=4),
                      torch.tensor([[-200.0, -88.0, -30.0, 0.0, 30.0, 88.0, 200.0, -1e-30] * 8] * 5,
                                   dtype=torch.bfloat16)], dim=1)
    up = rand(5, 128, dtype=torch.bfloat16, seed=3)
    out = layer_ops.silu_mul(torch.cat([gate, up], dim=1))
    ref = F.silu(gate) * up  # torch: silu rounded to bfloat16, then the product rounded
    assert torch.isfinite(out).all()
    steps = _bf16_steps(out[:, :64], ref[:, :64])  # ordinary gates: one rounding step at most, rarely
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01
    torch.testing.assert_close(out[:, 64:], ref[:, 64:], atol=1e-35, rtol=0.02)  # below -87: the clamped exp
    T, H, KVH, D = 9, 6, 2, 64
    qkv = rand(T, (H + 2 * KVH) * D, dtype=torch.bfloat16, scale=2)
    angles = rand(T, D, seed=4)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    view = qkv[:, :(H + KVH) * D].view(T, H + KVH, D)
    expected = layer_ops.rope_reference(view, cos, sin)
    assert torch.equal(layer_ops.rope_(view, cos, sin), expected)  # every product and the sum rounded as torch's


def test_other_dtypes_and_layouts_take_the_torch_path():
    x = rand(4, 32, dtype=torch.float16)
    w = rand(32, dtype=torch.float16, seed=1)
    assert torch.equal(layer_ops.rms_norm(x, w, 1e-6), layer_ops.rms_norm_reference(x, w, 1e-6))
    gu = rand(4, 64, dtype=torch.float16)
    assert torch.equal(layer_ops.silu_mul(gu), F.silu(gu[:, :32]) * gu[:, 32:])
    heads = rand(4, 3, 8)  # a 3-D norm (Qwen3's per-head q/k norm) uses the reference
    assert torch.equal(layer_ops.rms_norm(heads, w[:8].float(), 1e-6), layer_ops.rms_norm_reference(heads, w[:8].float(), 1e-6))


@pytest.mark.parametrize("bad", [
    lambda: kernel.rms_norm(rand(3, 8), rand(7), 1e-5),                    # weight of the wrong width
    lambda: kernel.add_rms_norm_(rand(3, 8), rand(2, 8), rand(8), 1e-5),   # delta of another shape
    lambda: kernel.silu_mul(rand(3, 7)),                                    # odd width: no gate/up halves
    lambda: kernel.rope_(rand(3, 2, 8), rand(3, 6), rand(3, 6)),           # cos/sin of the wrong width
    lambda: kernel.rms_norm(rand(3, 8).half(), rand(8).half(), 1e-5),       # a dtype the kernel does not take
    lambda: kernel.rms_norm(rand(3, 8), rand(8).to("meta"), 1e-5),          # a weight off the CPU
    lambda: kernel.rope_(rand(3, 8).as_strided((3, 2, 8), (8, 4, 1)), rand(3, 8), rand(3, 8)),  # heads overlap
    lambda: (lambda h: kernel.add_rms_norm_(h, h, rand(8), 1e-5))(rand(3, 8)),  # delta is h itself
])
def test_the_kernel_rejects_malformed_input(bad):
    with pytest.raises(RuntimeError):
        bad()


def test_model_outputs_agree_with_and_without_the_extension(monkeypatch):
    model = tiny_model(seed=2, dtype=torch.float32, num_layers=3, hidden_size=64, intermediate_size=96)
    tokens = [5, 9, 3, 77, 12, 8, 100, 41]
    fast = all_logits(model, tokens)
    monkeypatch.setattr(layer_ops, "_native", lambda x: None)
    slow = all_logits(model, tokens)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=2e-5)
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
