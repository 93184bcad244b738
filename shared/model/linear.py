"""Dense layers on the fastest kernel the device has.

On CPU in float32, weights are pre-packed once for oneDNN (the layout its GEMM wants), which runs this
model's decode-sized matmuls 10-30% faster than MKL via ``F.linear`` and the 49k-row LM head about 2x
faster (measured on 2 AVX2 cores; 2-3.9x on 2 AVX-512 cores). In bfloat16 they are packed where the CPU has
native bfloat16 dot products (AVX512_BF16 or AMX, ``bf16_packs``): 1.2-1.6x at 16-64 rows, level at 512, and
bit-identical to ``F.linear`` (which reorders the same weights for the same oneDNN kernel on every call).
Packed weights work for any number of rows. Everything else (float64 exactness runs, CUDA, builds without
oneDNN, bfloat16 on CPUs that emulate it) uses ``F.linear`` on the plain weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bf16_packs() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (what makes a packed bfloat16 weight pay)."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def _can_pack(w: torch.Tensor) -> bool:
    if w.device.type != "cpu" or not (torch.backends.mkldnn.is_available()
                                      and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and bf16_packs())


def prepare_weight(w: torch.Tensor, rows_hint: int = 64) -> torch.Tensor:
    """``w: [out, in]`` → the tensor ``linear`` expects (packed for oneDNN when that is faster)."""
    if not _can_pack(w):
        return w
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows_hint)
    except RuntimeError:  # an op signature this build lacks: plain weights still work
        return w


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x: [T, in]`` @ ``w.T`` (+ bias) → ``[T, out]``, whichever form ``w`` is in."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)
