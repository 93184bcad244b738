"""Greedy sampling's row argmax: the C++ extension's two-pass vector scan (kernels/cpu_sampling_ops.cpp) on CPU
float32/bfloat16 logits, ``torch.argmax`` everywhere else (CUDA, float16/float64, no compiler,
``DEEPINFER_DISABLE_CPP_KERNELS=1``). Both give the lowest index of each row's maximum, a row's first NaN where
it holds one: the same token ids.
"""
from __future__ import annotations

import torch

from kernels import cpu_paged_attention


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """``logits: [R, V]`` -> ``[R]`` int64."""
    return logits.argmax(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits: [R, V]`` -> ``[R]`` int64: each row's greedy token."""
    if (logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2
            or logits.shape[1] == 0 or logits.stride(-1) != 1):
        return argmax_reference(logits)
    ext = cpu_paged_attention.load()
    return argmax_reference(logits) if ext is None else ext.argmax_rows(logits)
