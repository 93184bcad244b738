"""Physical layout of the paged KV cache (one tensor per worker).

``kv_cache: [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]``

- Block-major: one block (all layers, K and V) is contiguous, so a hand-off copies whole blocks.
- SWA-aware KV keeps one pool per KV group (``KVGroups``); ``allocate_pools``, ``gather``, ``scatter``, ``stage``
  and ``layer_view`` are the layout-independent operations (the engine never asks which layout it has).
- Head-major inside a block: the ``block_size`` rows of one KV head are contiguous (block_size * head_dim
  elements), which is what decode attention streams through; on CPU this reads 2.4x faster than
  token-major rows interleaved across heads.

Kernels never see this layout directly: ``layer_kv`` hands them strided ``[num_blocks, block_size, kv_heads,
head_dim]`` views (their documented contract), whatever the physical order.
"""
from __future__ import annotations

import torch

from shared.kv.block_pack import pack
from shared.model.config import ModelConfig


def allocate(num_blocks: int, config: ModelConfig, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    return torch.zeros(num_blocks, config.num_layers, 2, config.kv_cache_heads, block_size, config.kv_cache_dim,
                       dtype=dtype, device=device)


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` views of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]`` (strided)."""
    return kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2)


class KVGroups:
    """SWA-aware KV (``shared/engine/hybrid_kv.py``): one pool per attention type.

    ``full: [num_full_blocks, L_full, 2, kvh, block_size, D]`` holds the full-attention layers,
    ``window: [num_window_blocks + 1, L_window, 2, kvh, block_size, D]`` the sliding-window layers; window block 0
    is the null block (never written, stays zero). ``groups[layer] = (group, index in group)``, group 0 = full.
    A logical block ``[L, 2, kvh, block_size, D]`` (the wire format) is one full row and one window row put back
    in layer order; a released window row reads as zeros.
    """

    def __init__(self, num_full: int, num_window: int, config: ModelConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        windows = config.layer_sliding_windows
        self.full_layers = [i for i, w in enumerate(windows) if w is None]
        self.window_layers = [i for i, w in enumerate(windows) if w is not None]
        shape = (2, config.kv_cache_heads, block_size, config.kv_cache_dim)
        self.full = torch.zeros(num_full, len(self.full_layers), *shape, dtype=dtype, device=device)
        self.window = torch.zeros(num_window + 1, len(self.window_layers), *shape, dtype=dtype, device=device)
        self.groups = [(0, self.full_layers.index(i)) if w is None else (1, self.window_layers.index(i))
                       for i, w in enumerate(windows)]
        self.block_shape = [config.num_layers, *shape]
        self._fl = torch.tensor(self.full_layers, dtype=torch.long, device=device)
        self._wl = torch.tensor(self.window_layers, dtype=torch.long, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def device(self) -> torch.device:
        return self.full.device

    def gather(self, full_ids: list[int], window_ids: list[int]) -> torch.Tensor:
        """``[n, L, 2, kvh, bs, D]``: logical blocks from one full and one window block each (0: zeros)."""
        dev = self.full.device
        out = torch.zeros(len(full_ids), *self.block_shape, dtype=self.full.dtype, device=dev)
        out[:, self._fl] = self.full[torch.tensor(full_ids, dtype=torch.long, device=dev)]
        wid = torch.tensor(window_ids, dtype=torch.long, device=dev)
        rows = self.window[wid]  # [n, L_window, ...]: the null block's rows are zeros
        out[:, self._wl] = rows
        return out

    def gather_packed(self, full_ids: list[int], window_ids: list[int]) -> tuple[torch.Tensor, list[bool]]:
        """``(packed, has_window)``: the blocks as a packed run (``shared/kv/block_pack.py``): window rows only
        for the blocks whose window id is not the null block."""
        has_window = [w != 0 for w in window_ids]
        return pack(self.gather(full_ids, window_ids), has_window, self.window_layers), has_window

    def scatter(self, full_ids: list[int], window_ids: list[int], blocks: torch.Tensor) -> None:
        """Write logical blocks ``blocks: [n, L, ...]``: row ``j``'s full layers into ``full_ids[j]`` and its
        window layers into ``window_ids[j]``; an id of -1 (or the null block 0 for windows) skips that part.
        A logical run is the packed run whose every block carries its window rows (``scatter_packed``)."""
        self.scatter_packed(full_ids, window_ids, blocks.reshape(-1, *blocks.shape[2:]), [True] * len(blocks))

    def scatter_packed(self, full_ids: list[int], window_ids: list[int], packed: torch.Tensor,
                       has_window: list[bool]) -> None:
        """``scatter`` from a packed run (``shared/kv/block_pack.py``: ``[rows, 2, kvh, bs, D]``, block ``j``'s
        ``L`` rows in layer order when ``has_window[j]``, else its full layers' rows only) without unpacking it:
        block by block, straight into the pools (no temporaries the size of the run). A block without window rows
        writes no window block."""
        packed = packed.to(device=self.full.device, dtype=self.full.dtype)
        start, nf, nl = 0, len(self.full_layers), self.block_shape[0]
        for f, w, carried in zip(full_ids, window_ids, has_window):
            rows = packed[start:start + (nl if carried else nf)]
            start += nl if carried else nf
            if f >= 0 and nf:
                if carried:
                    torch.index_select(rows, 0, self._fl, out=self.full[f])
                else:
                    self.full[f].copy_(rows)
            if w > 0 and carried and self.window_layers:
                torch.index_select(rows, 0, self._wl, out=self.window[w])


KVCache = torch.Tensor | KVGroups  # one pool (the tensor itself), or one per KV group


def allocate_pools(pool_sizes: list[int], config: ModelConfig, block_size: int, dtype: torch.dtype,
                   device: torch.device) -> KVCache:
    """The physical cache for a ``KVManager``'s ``pool_sizes`` (one per KV group: one pool, or full + window)."""
    if len(pool_sizes) == 1:
        return allocate(pool_sizes[0], config, block_size, dtype, device)
    num_full, num_window = pool_sizes
    return KVGroups(num_full, num_window - 1, config, block_size, dtype, device)


def block_shape(kv: KVCache) -> list[int]:
    """Shape of one logical block, the wire format: ``[L, 2, kvh, block_size, D]``."""
    return list(kv.block_shape) if isinstance(kv, KVGroups) else list(kv.shape[1:])


def pool_block_bytes(kv: KVCache) -> list[int]:
    """Bytes of one block of each pool (every layer the pool holds), in ``KVManager.pools`` order."""
    pools = [kv.full, kv.window] if isinstance(kv, KVGroups) else [kv]
    return [p[0].numel() * p.element_size() for p in pools]


def first_pool(kv: KVCache) -> torch.Tensor:
    """The first group's pool (the cache itself with one pool): its device and dtype are the cache's."""
    return kv.full if isinstance(kv, KVGroups) else kv


def gather(kv: KVCache, group_ids: list[list[int]]) -> torch.Tensor:
    """``[n, L, 2, kvh, bs, D]`` copy of logical blocks; ``group_ids[g][j]``: block ``j``'s id in group ``g``."""
    if isinstance(kv, KVGroups):
        return kv.gather(*group_ids)
    return kv[torch.tensor(list(group_ids[0]), dtype=torch.long, device=kv.device)]


def stage(kv: KVCache, group_ids: list[list[int]]) -> tuple[torch.Tensor, list[int], list[bool] | None]:
    """``(source, rows, has_window)``: what a transport stages the blocks from (``stage_blocks(source, rows)``).
    One pool: the cache itself and its block ids (no copy; ``has_window`` None: whole blocks). KV groups: a
    packed copy (``shared/kv/block_pack.py``: window rows only where the window id is not the null block),
    ``range(n)`` and which blocks carry window rows."""
    if isinstance(kv, KVGroups):
        packed, has_window = kv.gather_packed(*group_ids)
        return packed, list(range(len(packed))), has_window
    return kv, list(group_ids[0]), None


def stages_in_place(kv: KVCache) -> bool:
    """Whether ``stage`` hands out the cache itself (any thread may stage from it) rather than a copy (made on
    the engine thread, between steps)."""
    return not isinstance(kv, KVGroups)


def scatter(kv: KVCache, group_ids: list[list[int]], blocks: torch.Tensor) -> None:
    """Write logical blocks ``blocks: [n, L, ...]``: row ``j``'s group-``g`` rows into ``group_ids[g][j]``; an id
    of -1 (and a window group's null block 0) skips that part."""
    if isinstance(kv, KVGroups):
        kv.scatter(*group_ids, blocks)
        return
    pairs = [(j, b) for j, b in enumerate(group_ids[0]) if b >= 0]
    if pairs:
        rows, ids = (torch.tensor(x, dtype=torch.long, device=kv.device) for x in zip(*pairs))
        kv[ids] = blocks.to(kv)[rows]


def scatter_packed(kv: KVCache, group_ids: list[list[int]], packed: torch.Tensor, has_window: list[bool]) -> None:
    """``scatter`` from a packed run (``KVGroups.scatter_packed``); one pool has no window rows to leave out, so
    its packed run is its logical one."""
    if isinstance(kv, KVGroups):
        kv.scatter_packed(*group_ids, packed, has_window)
    else:
        scatter(kv, group_ids, packed)


def layer_view(kv: KVCache, meta, layer: int):
    """``(k, v, meta)`` for one layer: the single cache and ``meta``, or the layer's group's pool and
    ``meta[group]`` (one ``AttentionMetadata`` per group)."""
    if isinstance(kv, torch.Tensor):
        return (*layer_kv(kv, layer), meta)
    group, index = kv.groups[layer]
    return (*layer_kv(kv.window if group else kv.full, index), meta[group])
