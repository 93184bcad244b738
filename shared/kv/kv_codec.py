"""KV blocks stored compressed in the cache tier: FP8 (e4m3) or int8 values with one float32 scale per layer, K/V
half, head and token, i.e. per ``head_dim`` numbers (``--tier-kv-format fp8 | int8``; none: the model's dtype).
Per token rather than per block and head: on SmolLM2 a scale per block and head let 32-token greedy runs from
compressed prompts match the uncompressed run in 13 / 15 of 24 bench prompts (fp8 / int8), per token in 16 / 21,
for 6% more bytes (head_dim 64); ``benchmarks/tier_kv_codec.py`` measures the whole bench set.

Layout: a layer row of a block (``[2, kv_heads, block_size, head_dim]`` numbers) becomes ``row_bytes`` bytes: the
``2 * kv_heads * block_size`` scales (float32, little-endian), then the values, one byte each, in the row's order. A block of
``[L, 2, kv_heads, block_size, head_dim]`` is stored as ``uint8 [L, row_bytes]`` (``encoded_shape``), so every
mover that works on layer rows (window packing, the tier's per-block rows) carries it unchanged. The stored
dtype names the format (``wire_dtype``: ``kv-fp8`` / ``kv-int8``): a tier serves a block only to a get naming
the same dtype and shape, so an engine never reads blocks of another format (it misses instead).

Invariants (``tests/unit/test_kv_codec.py``):
- ``decode(encode(x))`` has the model dtype and shape of ``x``; per element ``|x - x'| <= |x| / 16 + s / 2 ** 9``
  for fp8 (3 mantissa bits; ``s = amax / 448``, the subnormal step) and ``<= s / 2`` for int8 (``s = amax / 127``),
  ``amax`` the largest ``|x|`` of the element's ``head_dim`` numbers (its layer, half, head and token); an
  all-zero row decodes to zeros;
- bytes per block: ``L * 2 * kvh * bs * (D + 4)``: ``(D + 4) / 4D`` of float32, ``(D + 4) / 2D`` of bf16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from shared.errors import invalid

if TYPE_CHECKING:  # torch is imported where blocks are coded: the wire modules read the names without it
    import torch

FORMATS = ("fp8", "int8")
COMPRESSED_DTYPES = tuple(f"kv-{name}" for name in FORMATS)  # the stored dtype names (wire, tier, transports)
_FP8_MAX = 448.0   # largest finite float8_e4m3fn
_INT8_MAX = 127.0


@dataclass(frozen=True, slots=True)
class KVCodec:
    """One format's encoder / decoder (see the module docstring)."""
    name: str

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise invalid(f"tier KV format must be one of {', '.join(FORMATS)}, got {self.name!r}")

    @property
    def wire_dtype(self) -> str:
        return f"kv-{self.name}"

    @staticmethod
    def row_bytes(block_shape: Sequence[int]) -> int:
        """Bytes of one encoded layer row of a ``[L, 2, kvh, bs, D]`` block."""
        return 4 * math.prod(block_shape[1:4]) + math.prod(block_shape[1:])

    def encoded_shape(self, block_shape: Sequence[int]) -> list[int]:
        return [block_shape[0], self.row_bytes(block_shape)]

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows: [..., 2, kvh, bs, D]`` (any float dtype) → ``uint8 [..., row_bytes]``."""
        import torch

        lead, (halves, heads, bs, d) = rows.shape[:-4], rows.shape[-4:]
        x = rows.reshape(-1, halves * heads * bs, d).float()  # [R, 2 kvh bs, D]
        amax = x.abs().amax(dim=-1)  # [R, 2 kvh bs]
        scale = amax / (_FP8_MAX if self.name == "fp8" else _INT8_MAX)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = x / safe[..., None]
        if self.name == "fp8":
            values = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            values = scaled.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8).view(torch.uint8)
        scales = scale.contiguous().view(torch.uint8).view(-1, halves * heads * bs * 4)  # float32 bytes
        out = torch.cat([scales, values.reshape(values.shape[0], -1)], dim=1)  # [R, row_bytes]
        return out.view(*lead, out.shape[-1])

    def decode(self, encoded: torch.Tensor, block_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``uint8 [..., row_bytes]`` → ``[..., 2, kvh, bs, D]`` of ``dtype`` (``block_shape``: ``[L, 2, kvh, bs,
        D]``)."""
        import torch

        halves, heads, bs, d = block_shape[1:]
        lead = encoded.shape[:-1]
        flat = encoded.reshape(-1, encoded.shape[-1]).contiguous()
        n = halves * heads * bs
        scale = flat[:, :4 * n].contiguous().view(torch.float32)  # [R, 2 kvh bs]
        raw = flat[:, 4 * n:].contiguous().view(-1, n, d)
        values = raw.view(torch.float8_e4m3fn) if self.name == "fp8" else raw.view(torch.int8)
        x = values.float() * scale[..., None]
        return x.to(dtype).view(*lead, halves, heads, bs, d)


def codec_for(name: str) -> KVCodec | None:
    """The codec of a ``--tier-kv-format`` value (``""``: none, blocks stored in the model's dtype)."""
    return KVCodec(name) if name else None
