"""The per-token ops between a decoder layer's matmuls: RMSNorm (alone and fused with the residual add), the
SiLU-gated product of the MLP, and RoPE applied in place.

On CPU in float32/float64/bfloat16 each runs as one pass of the C++ extension (kernels/cpu_layer_ops.cpp),
instead of torch's 2-5 passes with temporaries; everywhere else (CUDA, float16, no compiler, or
``DEEPINFER_DISABLE_CPP_KERNELS=1``) the torch reference below runs. Both compute the same math: RoPE is
bit-identical; the norm and SiLU differ from torch in the last bits (summation order, a polynomial exp whose
argument is clamped at -87, so a gate below -87 gives a product within ~1e-36 of torch's, not equal to it).
In bfloat16 the kernel rounds to bfloat16 wherever the reference's ops do (the normalised row before the scale,
SiLU before the product, each RoPE product, the residual sum), so a result differs from torch's by at most one
bfloat16 rounding step, where the float32 sums behind it differed in their last bits.
The kernels refuse (``RuntimeError``) tensors off the CPU, overlapping rows, and a ``delta`` overlapping ``h``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_paged_attention


def _native(x: torch.Tensor):
    """The extension when ``x`` can use it, else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return None
    return cpu_paged_attention.load()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-exact RMSNorm: normalise in float32 (or wider), then scale in the model dtype."""
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, weight.shape, weight, eps)  # fused; same math in the input's precision
    compute = x.float()
    var = compute.pow(2).mean(-1, keepdim=True)
    return weight * (compute * torch.rsqrt(var + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x: [..., N]`` → ``x / sqrt(mean(x²) + eps) * weight``, same shape."""
    ext = _native(x)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1:
        return rms_norm_reference(x, weight, eps)
    return ext.rms_norm(x, weight, float(eps))


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add then the next norm: ``h += delta`` in place (``h: [T, N]`` contiguous, ``delta: [T, N]``),
    returns ``rms_norm(h, weight, eps)``."""
    ext = _native(h)
    if ext is None or not h.is_contiguous() or delta.stride(-1) != 1:
        h += delta
        return rms_norm_reference(h, weight, eps)
    return ext.add_rms_norm_(h, delta, weight, float(eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up: [T, 2F]`` (gate columns, then up) → ``silu(gate) * up: [T, F]``."""
    ext = _native(gate_up)
    if ext is None or gate_up.stride(-1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ext.silu_mul(gate_up)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, heads, D]`` by per-token ``cos/sin: [T, D]`` (already indexed by position)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_reference`` written into ``x`` itself (a view whose last dimension is contiguous); returns ``x``."""
    ext = _native(x)
    if ext is None or x.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        x.copy_(rope_reference(x, cos, sin))
        return x
    ext.rope_(x, cos, sin)
    return x
