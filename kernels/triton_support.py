"""Optional Triton import shared by the kernels, and the one rule for when a kernel runs in Triton.

``TRITON_INTERPRET`` is read by Triton when kernels are decorated, i.e. at import: set it before importing
any kernel module (tests/conftest.py does so on machines without CUDA).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None
    tl = None


def use_triton(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors, or everywhere when ``DEEPINFER_FORCE_TRITON=1`` (tests, interpreter)."""
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("DEEPINFER_FORCE_TRITON") == "1"
