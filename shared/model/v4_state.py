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

from collections.abc import Callable, Iterator
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


def _compressor_shapes(d: int, ratio: int, overlap: bool, n: int) -> list[tuple[int, int]]:
    """Shapes of a compressor state's parts over ``n`` tokens, in the order ``CompressorState`` lists them:
    entries, pending kv and gate, and (overlapping groups, once a group completed) the overlap kv and gate."""
    width = 2 * d if overlap else d
    shapes = [(n // ratio, d), (n % ratio, width), (n % ratio, width)]
    return shapes + ([(ratio, d), (ratio, d)] if overlap and n >= ratio else [])


def layout(config: ModelConfig, num_tokens: int) -> list[list[tuple[int, int]]]:
    """Per layer, the shapes of its state's parts over ``num_tokens`` tokens in their canonical order: the window,
    then the compressor's parts and the indexer's (``_compressor_shapes``). A function of the config and the
    token count alone: what a packed state is read back with (``pack`` / ``unpack``)."""
    v4, hd, n = config.v4, config.head_dim, num_tokens
    layers = []
    for kind in v4.layer_types:
        parts = [(min(n, v4.sliding_window - 1), hd)]
        if kind == "compressed_sparse_attention":
            parts += _compressor_shapes(hd, v4.csa_ratio, True, n)
            parts += _compressor_shapes(v4.index_head_dim, v4.csa_ratio, True, n)
        elif kind == "heavily_compressed_attention":
            parts += _compressor_shapes(hd, v4.hca_ratio, False, n)
        layers.append(parts)
    return layers


def context_numel(config: ModelConfig, num_tokens: int) -> int:
    """Numbers a V4 sequence state over ``num_tokens`` tokens holds (``layout``'s parts)."""
    return sum(rows * cols for parts in layout(config, num_tokens) for rows, cols in parts)


def context_bytes(config: ModelConfig, num_tokens: int, element_bytes: int) -> int:
    """Bytes a V4 sequence state over ``num_tokens`` tokens holds (what ``V4SequenceState.nbytes`` measures),
    computed from the config alone (for contexts too long to build: 77K, 1M tokens)."""
    return context_numel(config, num_tokens) * element_bytes


def _parts(state: V4SequenceState) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for layer in state.layers:
        out.append(layer.window)
        for c in (layer.compressor, layer.indexer):
            if c is not None:
                out += [c.entries, c.pending_kv, c.pending_gate, c.overlap_kv, c.overlap_gate]
    return out


def pack(state: V4SequenceState, config: ModelConfig, page_numel: int) -> torch.Tensor:
    """``[pages, page_numel]``: the state's parts flattened in ``layout`` order, zero-padded to whole pages (the
    wire form of a hand-off or migration: fewer than one page of padding). Raises ``ValueError`` when a part's
    shape is not ``layout``'s for the state's token count (a state that broke its invariants)."""
    shapes = [shape for parts in layout(config, state.num_tokens) for shape in parts]
    present = [t for t in _parts(state) if t is not None]
    if [tuple(t.shape) for t in present] != shapes:
        raise ValueError(f"a DeepSeek V4 state over {state.num_tokens} tokens has parts "
                         f"{[tuple(t.shape) for t in present]}, not {shapes}")
    total = sum(r * c for r, c in shapes)
    pages = max(1, -(-total // page_numel))
    flat = present[0].new_zeros(pages * page_numel)
    if total:
        torch.cat([t.reshape(-1) for t in present], out=flat[:total])
    return flat.view(pages, page_numel)


def unpack(pages: torch.Tensor, config: ModelConfig, num_tokens: int) -> V4SequenceState:
    """The state ``pack`` wrote for ``num_tokens`` tokens (its parts own their memory: copies of ``pages``).
    ``ValueError`` when ``pages`` holds fewer numbers than ``layout`` needs."""
    flat = pages.reshape(-1)
    need = context_numel(config, num_tokens)
    if flat.numel() < need:
        raise ValueError(f"{flat.numel()} numbers cannot hold a DeepSeek V4 state over {num_tokens} tokens ({need})")
    return assemble(config, num_tokens, reader(flat))


def reader(flat: torch.Tensor) -> Callable[[tuple[int, int]], torch.Tensor]:
    """``take(shape)``: the next ``rows x cols`` numbers of ``flat`` as a tensor of its own."""
    at = 0

    def take(shape: tuple[int, int]) -> torch.Tensor:
        nonlocal at
        rows, cols = shape
        part = flat[at:at + rows * cols].view(rows, cols).clone()
        at += rows * cols
        return part
    return take


def assemble(config: ModelConfig, num_tokens: int, take: Callable[[tuple[int, int]], torch.Tensor],
             entries: Iterator[torch.Tensor] | None = None) -> V4SequenceState:
    """A state over ``num_tokens`` tokens from its parts in ``layout`` order, each ``take(shape)``; with
    ``entries``, every compressor's entries come from it instead (in layout order: a CSA layer's compressor, then
    its indexer), the other parts from ``take`` (``v4_tier.join``)."""
    def compressor(shapes: list[tuple[int, int]]) -> CompressorState:   # 3 parts, or 5 with the overlap
        first = next(entries) if entries is not None else take(shapes[0])
        return CompressorState(first, *(take(shape) for shape in shapes[1:]))

    layers = []
    for kind, parts in zip(config.v4.layer_types, layout(config, num_tokens)):
        layer = LayerState(take(parts[0]))
        if kind == "compressed_sparse_attention":
            half = (len(parts) - 1) // 2
            layer.compressor = compressor(parts[1:1 + half])
            layer.indexer = compressor(parts[1 + half:])
        elif kind == "heavily_compressed_attention":
            layer.compressor = compressor(parts[1:])
        layers.append(layer)
    return V4SequenceState(layers, num_tokens)
