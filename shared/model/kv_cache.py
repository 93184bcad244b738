"""Physical layout of the paged KV cache (one tensor per worker).

``kv_cache: [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]``

- Block-major: one block (all layers, K and V) is contiguous, so a hand-off copies whole blocks.
- Head-major inside a block: the ``block_size`` rows of one KV head are contiguous (block_size * head_dim
  elements), which is what decode attention streams through; on CPU this reads 2.4x faster than
  token-major rows interleaved across heads.

Kernels never see this layout directly: ``layer_kv`` hands them strided ``[num_blocks, block_size, kv_heads,
head_dim]`` views (their documented contract), whatever the physical order.
"""
from __future__ import annotations

import torch

from shared.model.config import ModelConfig


def allocate(num_blocks: int, config: ModelConfig, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    return torch.zeros(num_blocks, config.num_layers, 2, config.num_kv_heads, block_size, config.head_dim,
                       dtype=dtype, device=device)


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` views of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]`` (strided)."""
    return kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2)
