"""A DeepSeek V4 sequence's attention state, per layer: what its next tokens attend to and what its compressors
carry across a chunk boundary (``shared/model/deepseek_v4.py`` computes with it).

Per layer:
- ``window``: the shared K=V rows of the last ``sliding_window - 1`` tokens (RoPE applied), the only per-token
  KV a V4 layer keeps: a new token sees those and itself;
- per compressor (the CSA / HCA compressor, and the CSA indexer's): ``entries`` (one row per complete group of
  ``ratio`` tokens, normed, RoPE at the group's first position: the compressed KV), ``pending_kv`` /
  ``pending_gate`` (projections of the tokens after the last complete group, fewer than ``ratio``), and for
  CSA's overlapping groups ``overlap_kv`` / ``overlap_gate`` (the last complete group's first-half series, which
  the next group's entry mixes in).

Invariants:
- Entry ``w`` is a function of the tokens of groups ``w - 1`` and ``w`` only, and the state after any split of a
  sequence into chunks equals the state after one chunk: chunked prefill, decode and one-shot prefill compute the
  same entries (``tests/model/test_deepseek_v4_tiny.py``).
- ``num_tokens`` counts the tokens every layer's state covers; ``len(entries) == num_tokens // ratio`` and
  ``len(pending) == num_tokens % ratio`` for each compressor; ``len(window) == min(num_tokens, sliding_window - 1)``.
- Bytes of a context of ``n`` tokens (``context_bytes``): ``head_dim`` numbers per ``ratio`` tokens per compressed
  layer (plus the indexer's ``index_head_dim`` per CSA group), and a window, pending and overlap part bounded
  whatever ``n``; ``V4SequenceState.nbytes`` of a state over ``n`` tokens is exactly that.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.model.config import ModelConfig


@dataclass(slots=True)
class CompressorState:
    entries: torch.Tensor  # [n, d]
    pending_kv: torch.Tensor  # [r < ratio, W]: W = 2 d with overlap (CSA), d without (HCA)
    pending_gate: torch.Tensor  # [r, W]
    overlap_kv: torch.Tensor | None = None  # [ratio, d]: the last complete group's first-half series (CSA)
    overlap_gate: torch.Tensor | None = None  # [ratio, d]

    @classmethod
    def empty(cls, d: int, width: int, dtype: torch.dtype, device: torch.device) -> CompressorState:
        return cls(torch.zeros(0, d, dtype=dtype, device=device), torch.zeros(0, width, dtype=dtype, device=device),
                   torch.zeros(0, width, dtype=dtype, device=device))


    def detached(self) -> CompressorState:
        """This state with its pending part in tensors of its own (entries and overlap already are)."""
        return CompressorState(self.entries, self.pending_kv.clone(), self.pending_gate.clone(), self.overlap_kv,
                               self.overlap_gate)


@dataclass(slots=True)
class LayerState:
    window: torch.Tensor  # [w <= sliding_window - 1, head_dim]
    compressor: CompressorState | None = None  # CSA / HCA layers
    indexer: CompressorState | None = None  # CSA layers

    def detached(self) -> LayerState:
        """A copy that later steps of this sequence never change and that holds no more memory than it counts
        (``V4SequenceState.nbytes``): the model replaces state tensors and never writes into them, so only the
        window and pending rows, views into a step's larger tensors, are copied."""
        return LayerState(self.window.clone(), self.compressor and self.compressor.detached(),
                          self.indexer and self.indexer.detached())


@dataclass(slots=True)
class V4SequenceState:
    """One sequence's state across every layer (see the module docstring); ``num_tokens`` tokens covered."""
    layers: list[LayerState] = field(default_factory=list)
    num_tokens: int = 0

    def snapshot(self) -> V4SequenceState:
        """The state as it stands (``LayerState.detached`` per layer): a prefix-cache entry, and the start of any
        sequence that continues from it (``restored``)."""
        return V4SequenceState([layer.detached() for layer in self.layers], self.num_tokens)

    def restored(self) -> V4SequenceState:
        """A new sequence's state continuing from this snapshot (which stays as it is)."""
        return V4SequenceState([LayerState(layer.window, layer.compressor and layer.compressor.detached(),
                                           layer.indexer and layer.indexer.detached()) for layer in self.layers],
                               self.num_tokens)

    def nbytes(self) -> int:
        """Bytes the state holds now (window rows, entries, pending and overlap parts)."""
        total = 0
        for layer in self.layers:
            parts = [layer.window]
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    parts += [c.entries, c.pending_kv, c.pending_gate]
                    parts += [t for t in (c.overlap_kv, c.overlap_gate) if t is not None]
            total += sum(t.numel() * t.element_size() for t in parts)
        return total


def context_bytes(config: ModelConfig, num_tokens: int, element_bytes: int) -> int:
    """Bytes a V4 sequence state over ``num_tokens`` tokens holds (what ``V4SequenceState.nbytes`` measures),
    computed from the config alone (for contexts too long to build: 77K, 1M tokens)."""
    v4, hd, n = config.v4, config.head_dim, num_tokens

    def compressor(d: int, ratio: int, overlap: bool) -> int:
        width = 2 * d if overlap else d
        kept = (n // ratio) * d + 2 * (n % ratio) * width   # entries, pending kv + gate
        return kept + (2 * ratio * d if overlap and n >= ratio else 0)   # the last group's series, kv + gate

    numbers = 0
    for kind in v4.layer_types:
        numbers += min(n, v4.sliding_window - 1) * hd
        if kind == "compressed_sparse_attention":
            numbers += compressor(hd, v4.csa_ratio, True) + compressor(v4.index_head_dim, v4.csa_ratio, True)
        elif kind == "heavily_compressed_attention":
            numbers += compressor(hd, v4.hca_ratio, False)
    return numbers * element_bytes
