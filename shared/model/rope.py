"""Rotary position embeddings (NeoX / HF "rotate_half" layout) with the scaling variants of Llama 3,
linear, static dynamic-NTK and YaRN (Qwen2's long-context option).
The rotation itself is ``kernels.layer_ops.rope_`` (in place, one pass on CPU).

The cos/sin table is precomputed once for ``max_position_embeddings`` positions, so every request sees
bit-identical rotations regardless of how it is batched. Angles are computed the way HF transformers and
vLLM do (float32 inverse frequencies and products) unless the model runs in float64, so greedy outputs
match theirs token for token; the scaling adjustments themselves are evaluated in float64.
"""
from __future__ import annotations

import math

import torch

from shared.model.config import ModelConfig


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [D/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    old_len = scaling.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _default_inv_freq(head_dim, theta)
    interpolation = extrapolation / factor
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    return inv_freq, yarn_attention_factor(scaling)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """The factor YaRN scales cos/sin by: ``attention_factor``, else DeepSeek's ``mscale / mscale_all_dim``
    ratio when both are given (1 for V3's 1.0 / 1.0), else ``yarn_mscale(factor)`` (as transformers)."""
    if scaling.get("attention_factor"):
        return scaling["attention_factor"]
    factor, mscale, all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def inv_frequencies(dim: int, theta: float, scaling: dict | None, max_positions: int,
                    angle_dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies [dim / 2] in angle_dtype, cos/sin scale)`` of a RoPE of ``dim`` dims, base ``theta``
    and ``scaling`` (HF's ``rope_scaling``; None: plain), for a context of ``max_positions`` tokens."""
    d, inv_freq, mscale = dim, _default_inv_freq(dim, theta), 1.0
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3" and scaling.get("freq_factors"):  # GGUF: llama.cpp's per-frequency divisors
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "dynamic":  # static NTK at the full context, as vLLM does
        factor, old_len = scaling["factor"], scaling.get("original_max_position_embeddings", max_positions)
        base = theta * ((factor * max_positions / old_len) - (factor - 1)) ** (d / (d - 2))
        inv_freq = _default_inv_freq(d, base)
    elif kind == "yarn":
        inv_freq, mscale = _yarn_inv_freq(d, theta, scaling)
    if kind in (None, "default") and angle_dtype == torch.float32:  # HF's exact float32 expression
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return inv_freq.to(angle_dtype), mscale


def build_rope_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)``, each ``[max_positions, dim]`` (halves duplicated, NeoX layout); ``dim`` defaults to
    ``head_dim`` (MLA rotates only ``qk_rope_head_dim`` dims)."""
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq, mscale = inv_frequencies(dim or config.head_dim, config.rope_theta, config.rope_scaling,
                                       config.max_position_embeddings, angle_dtype)
    positions = torch.arange(config.max_position_embeddings, dtype=angle_dtype)
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    cos, sin = emb.cos() * mscale, emb.sin() * mscale
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)
