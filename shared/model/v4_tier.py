"""A DeepSeek V4 state (``shared/model/v4_state.py``) as content-addressed blocks a cache tier stores: each block
its own compressed entries, and the block a stored state ends at also its *tail* (window rows, pending groups,
CSA overlap series at that boundary).

A tier block of ``block_size`` tokens is ``[1 + tail_rows, row_numel]`` (``block_shape``), rows in the packed-run
sense of ``shared/kv/block_pack.py``:
- row 0 (always stored): per compressor in layer order (a CSA layer's compressor then its indexer, an HCA layer's
  compressor), ``slots = ceil(block_size / ratio)`` entry rows of its width, the entries whose groups complete
  inside the block first, zeros after. Which entries those are is a function of the block's index alone (groups
  ``(j * bs) // ratio .. ((j + 1) * bs) // ratio``), and entry ``w`` depends on the tokens of groups ``w - 1``
  and ``w`` only, so a block's row 0 is the same in every context that shares its prefix: a growing agent
  context stores each block's entries once;
- rows ``1 ..`` (the *window rows* of the packed-run format, stored only for the block a state ends at): the
  state's non-entry parts at the block's end ``(j + 1) * bs``, in ``v4_state.layout`` order, zero-padded to
  ``tail_numel`` (the most those parts hold: ``v4_kv.fixed_bytes`` in numbers).

A hit at boundary ``(j + 1) * bs`` needs row 0 of blocks ``0 .. j`` and the tail of block ``j``; ``join`` builds
the state from them, equal to the state the model left at that boundary (``tests/model/test_deepseek_v4_tier.py``).
Padding: ``slots * ratio - block_size`` empty entry slots per block where ``block_size`` is not a multiple of a
ratio (HCA's 128 against 16-token blocks: one slot, filled every 8th block).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shared.model.config import ModelConfig
from shared.model.v4_state import V4SequenceState, assemble, reader


def _compressors(config: ModelConfig) -> list[tuple[int, int, int]]:
    """``(layer, ratio, width)`` of every compressor in row order: a CSA layer's compressor and indexer, an HCA
    layer's compressor."""
    v4, out = config.v4, []
    for i, kind in enumerate(v4.layer_types):
        if kind == "compressed_sparse_attention":
            out += [(i, v4.csa_ratio, config.head_dim), (i, v4.csa_ratio, v4.index_head_dim)]
        elif kind == "heavily_compressed_attention":
            out.append((i, v4.hca_ratio, config.head_dim))
    return out


def row_numel(config: ModelConfig, block_size: int) -> int:
    """Numbers in row 0 of a block (every compressor's entry slots)."""
    return max(1, sum(math.ceil(block_size / r) * d for _, r, d in _compressors(config)))


def tail_numel(config: ModelConfig) -> int:
    """The most numbers a state's non-entry parts hold at any boundary (a full window, the largest pending group,
    the overlap series), what every stored tail is padded to."""
    v4, hd, total = config.v4, config.head_dim, 0
    for kind in v4.layer_types:
        total += (v4.sliding_window - 1) * hd
        if kind == "compressed_sparse_attention":
            for d in (hd, v4.index_head_dim):
                total += 2 * (v4.csa_ratio - 1) * 2 * d + 2 * v4.csa_ratio * d
        elif kind == "heavily_compressed_attention":
            total += 2 * (v4.hca_ratio - 1) * hd
    return total


def block_shape(config: ModelConfig, block_size: int) -> list[int]:
    """``[1 + tail_rows, row_numel]``: a tier block (row 0: entries; the rest: the tail, stored at a state's end)."""
    width = row_numel(config, block_size)
    return [1 + -(-tail_numel(config) // width), width]


def tail_rows(config: ModelConfig, block_size: int) -> list[int]:
    """The tail's row indices in a block: the "window layers" of the packed-run format."""
    return list(range(1, block_shape(config, block_size)[0]))


def _tail_parts(state: V4SequenceState) -> list[torch.Tensor]:
    out = []
    for layer in state.layers:
        out.append(layer.window)
        for c in (layer.compressor, layer.indexer):
            if c is not None:
                out += [t for t in (c.pending_kv, c.pending_gate, c.overlap_kv, c.overlap_gate) if t is not None]
    return out


def _entries(state: V4SequenceState) -> list[torch.Tensor]:
    out = []
    for layer in state.layers:
        out += [c.entries for c in (layer.compressor, layer.indexer) if c is not None]
    return out


def split(state: V4SequenceState, config: ModelConfig, block_size: int, first: int) -> torch.Tensor:
    """The packed run of blocks ``first .. k - 1`` of a state over ``k * block_size`` tokens (``k > first``):
    ``[(k - first) + tail_rows, row_numel]``, each block's entry row, then block ``k - 1``'s tail rows (its
    ``has_window`` is the only True; one block: ``[1, *block_shape]``, as ``block_pack.packed_shape`` has a run
    whose blocks all carry their window rows). ``ValueError`` for a state not at a block boundary."""
    n = state.num_tokens
    if n % block_size or not first < n // block_size:
        raise ValueError(f"a state over {n} tokens is not past block {first} at a {block_size}-token boundary")
    k, width = n // block_size, row_numel(config, block_size)
    shape = block_shape(config, block_size)
    entries = _entries(state)
    dtype, device = entries[0].dtype if entries else state.layers[0].window.dtype, state.layers[0].window.device
    out = torch.zeros(k - first + shape[0] - 1, width, dtype=dtype, device=device)
    at = 0
    for (_, ratio, d), table in zip(_compressors(config), entries):
        slots = math.ceil(block_size / ratio)
        for j in range(first, k):
            lo, hi = j * block_size // ratio, (j + 1) * block_size // ratio
            out[j - first, at:at + (hi - lo) * d] = table[lo:hi].reshape(-1)
        at += slots * d
    tail = torch.cat([t.reshape(-1) for t in _tail_parts(state)])
    out[k - first:].view(-1)[:tail.numel()] = tail
    return out.view(1, *shape) if k - first == 1 else out


def join(run: torch.Tensor, has_window: Sequence[bool], config: ModelConfig, block_size: int,
         count: int) -> V4SequenceState | None:
    """The state at the end of the last of the run's first ``count`` blocks that carries its tail (the run holds
    blocks ``0 ..`` of a prompt, packed: ``[rows, row_numel]``), its tensors its own; None when none of them
    does. ``ValueError`` when the run's rows do not match ``has_window``; whole blocks ``[n, *block_shape]`` are
    taken too (each carries its tail)."""
    shape = block_shape(config, block_size)
    if run.dim() == 3 and list(run.shape[1:]) == shape:
        run, has_window = run.reshape(-1, shape[1]), [True] * int(run.shape[0])
    extra = shape[0] - 1
    starts, at = [], 0
    for present in has_window:
        starts.append(at)
        at += 1 + (extra if present else 0)
    if list(run.shape) != [at, shape[1]]:
        raise ValueError(f"a packed run of {len(has_window)} V4 tier blocks is [{at}, {shape[1]}], not "
                         f"{list(run.shape)}")
    ends = [j for j in range(min(count, len(has_window))) if has_window[j]]
    if not ends:
        return None
    last = ends[-1]
    n = (last + 1) * block_size
    rows = run[torch.tensor(starts[:last + 1])]   # [last + 1, row_numel]: the entry rows
    tables, at = [], 0
    for _, ratio, d in _compressors(config):
        used = [((j + 1) * block_size // ratio) - (j * block_size // ratio) for j in range(last + 1)]
        parts = [rows[j, at:at + u * d].reshape(u, d) for j, u in enumerate(used) if u]
        tables.append(torch.cat(parts) if parts else rows.new_zeros(0, d))
        at += math.ceil(block_size / ratio) * d
    flat = run[starts[last] + 1:starts[last] + 1 + extra].reshape(-1)
    return assemble(config, n, reader(flat), iter(tables))
