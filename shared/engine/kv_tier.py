"""The cache-tier flow of the engine's KV port (``shared/engine/kv_port.py``: ``KVPort`` takes it in): pulled
blocks published in the prefix cache before the request that needs them is added, and a request's computed
blocks named (or, for a per-sequence state layout, its newest snapshot cut into tier blocks) for write-back.

- ``missing_blocks`` names the prompt blocks the local prefix cache lacks (a state layout: all of them unless
  the local snapshot covers the prompt: a state is never rebuilt from part of its entries);
  ``import_tier_blocks`` publishes pulled blocks as free cached blocks (the worker adds the request in the same
  engine command, so its prefix lookup finds them before any eviction: a tier hit is a local hit, and greedy
  output equals the single-process engine's); a state layout's pull becomes the snapshot at its last tail
  (``shared/model/v4_tier.py``).
- ``tier_blocks`` names a held, detached or running request's computed full blocks with their ``BlockChain``
  for write-back (the tier serves a block only to a get naming the same digest and model fingerprint);
  ``tier_state_run`` is a state layout's: its newest snapshot as tier blocks, staged in the same command.

Every method runs on the engine thread, between steps.
"""
from __future__ import annotations

import torch

from shared.engine.request import Request
from shared.errors import DeepinferError, ErrorCode
from shared.kv import block_pack
from shared.kv.block_hash import BlockChain
from shared.model import kv_cache, v4_tier
from shared.sampling import SamplingParams

_SCRATCH_PARAMS = SamplingParams(max_tokens=1)


class TierFlow:
    """Mixed into ``KVPort`` (its ``engine``, ``held``, ``detached``, ``_bm``, ``_kv`` and layout properties)."""

    def _scratch_request(self, prompt_token_ids: list[int], cache_salt: str) -> Request:
        """A request object used only for its block hashes and keys (never scheduled)."""
        engine = self.engine
        return Request("~tier", prompt_token_ids, _SCRATCH_PARAMS, block_size=engine.config.block_size,
                       model_fingerprint=engine.fingerprint, cache_salt=cache_salt)

    def _reusable_blocks(self, prompt_token_ids: list[int]) -> int:
        """Leading full blocks of a prompt a cache may supply: one token is always computed (its logits)."""
        return max(0, (len(prompt_token_ids) - 1) // self.engine.config.block_size)

    def missing_blocks(self, prompt_token_ids: list[int], cache_salt: str = "") -> tuple[int, BlockChain]:
        """``(first, chain)``: the prompt's reusable blocks from index ``first`` on are not in the local prefix
        cache; ``chain`` names all its reusable blocks (what the tier is asked for)."""
        req = self._scratch_request(prompt_token_ids, cache_salt)
        usable = self._reusable_blocks(prompt_token_ids)
        first = min(self._bm.cached_prefix(req), usable) if self.engine.config.enable_prefix_caching else usable
        if self.carries_state and first < usable:   # a state is rebuilt from every entry up to its boundary
            first = 0
        return first, BlockChain.of(self.engine.fingerprint, req.block_digests[:usable])

    def import_tier_blocks(self, prompt_token_ids: list[int], cache_salt: str, first: int, kv: torch.Tensor,
                           has_window: list[bool] | None = None) -> int:
        """Publish ``kv`` (blocks ``first .. first + n - 1`` of the prompt: ``[n, *block_shape]`` unpacked, or the
        packed run ``[rows, *block_shape[1:]]`` as fetched, ``shared/kv/block_pack.py``; block ``j`` carries its
        window layers' rows when ``has_window[j]``, default all) in the prefix cache, written block by block
        without unpacking; the run's leading blocks that the prefix cache holds already are skipped. Returns how
        many of the others a prefix lookup now reuses (the layout's hit rule: blocks without the window rows a
        hit needs do not count; fewer when the pool has no free room; 0 with prefix caching off)."""
        if self.carries_state:
            return self._import_tier_state(prompt_token_ids, cache_salt, first, kv, has_window)
        shape, packed = self.block_shape, kv.dim() == len(self.block_shape)
        if (kv.dim() not in (len(shape), len(shape) + 1) or list(kv.shape[-(len(shape) - 1):]) != shape[1:]
                or (not packed and kv.shape[1] != shape[0]) or kv.dtype != self.kv_cache.dtype):
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"tier KV {list(kv.shape)} {kv.dtype} does not match "
                                 f"this engine's blocks {shape} {self.kv_cache.dtype}")
        if has_window is None:
            has_window = [True] * (int(kv.shape[0]) // shape[0] if packed else int(kv.shape[0]))
        has_window = list(has_window)
        rows = block_pack.packed_rows(has_window, shape[0], self.full_layers) if packed else len(has_window)
        if rows != kv.shape[0]:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"{len(has_window)} window flags for a run of "
                                 f"{kv.shape[0]} {'rows' if packed else 'blocks'}")
        if not self.engine.config.enable_prefix_caching or not has_window:
            return 0
        req = self._scratch_request(prompt_token_ids, cache_salt)
        count = max(0, min(len(has_window), self._reusable_blocks(prompt_token_ids) - first))
        skip = min(max(0, self._bm.cached_prefix(req) - first), count)   # the run's blocks held here already
        if skip:
            kv = kv[block_pack.packed_rows(has_window[:skip], shape[0], self.full_layers) if packed else skip:]
            has_window, first, count = has_window[skip:], first + skip, count - skip
        imported = self._bm.import_cached(req, first, count, has_window[:count])
        if packed:   # the run's leading ``count`` blocks: the rest of it is skipped by its own row counts
            kv_cache.scatter_packed(self._kv, imported.rows, kv, has_window[:count])
        else:
            kv_cache.scatter(self._kv, imported.rows, kv[:count])
        return max(0, imported.num_blocks - first)

    def _import_tier_state(self, prompt_token_ids: list[int], cache_salt: str, first: int, kv: torch.Tensor,
                           has_window: list[bool] | None) -> int:
        """A state layout's ``import_tier_blocks``: the run (blocks ``0 ..``, ``v4_tier``'s packed run, or
        ``[n, *tier_block_shape]`` whole blocks) becomes the snapshot at the end of its last block with a tail
        within the prompt's reusable blocks; returns that snapshot's blocks (0: none, no room, one no longer than
        the local snapshot's, or ``first > 0``: a state is never rebuilt from part of its entries)."""
        config, bs, shape = self.engine.model.config, self.engine.config.block_size, self.tier_block_shape
        whole = kv.dim() == 3 and list(kv.shape[1:]) == shape   # whole blocks: each carries its tail rows
        if not (whole or kv.dim() == 2 and kv.shape[1] == shape[1]) or kv.dtype != self.dtype:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"tier KV {list(kv.shape)} {kv.dtype} is not a run of "
                                 f"this engine's DeepSeek V4 tier blocks {shape} {self.dtype}")
        if whole or has_window is None:
            has_window = [True] * (int(kv.shape[0]) if whole else int(kv.shape[0]) // shape[0])
        if not whole and block_pack.packed_rows(has_window, shape[0], 1) != kv.shape[0]:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"{len(has_window)} window flags for a run of "
                                 f"{kv.shape[0]} rows of DeepSeek V4 tier blocks")
        count = max(0, min(len(has_window), self._reusable_blocks(prompt_token_ids) - first))
        if first or not self.engine.config.enable_prefix_caching:
            return 0
        req = self._scratch_request(prompt_token_ids, cache_salt)
        ends = [j for j in range(count) if has_window[j]]
        if ends and self._bm.cached_snapshot(req, ends[-1] + 1):   # imported before (a re-import): kept
            return ends[-1] + 1
        if not ends or ends[-1] + 1 <= self._bm.cached_prefix(req):   # no tail, or one below the local snapshot
            return 0
        try:
            state = v4_tier.join(kv.to(self.device), has_window, config, bs, count)
        except ValueError as err:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, str(err)) from None
        if state is None or not self._bm.adopt_snapshot(req, state):
            return 0
        return state.num_tokens // bs

    def tier_state_run(self, request_id: str, first: int = 0, running: bool = False):
        """A state layout's write-back: ``(blocks, chain, token_ids, run, rows, window_mask)`` of the request's
        newest snapshot as tier blocks ``first ..`` (``v4_tier.split``: the tail on the last), or None when it has
        no snapshot past block ``first``. Which requests qualify is ``tier_blocks``'s rule."""
        req = self._tier_request(request_id, running)
        req.update_block_hashes()
        snap = self._bm.tier_snapshot(req)
        k = 0 if snap is None else len(snap.hashes)
        if k <= first:
            return None
        config, bs = self.engine.model.config, self.engine.config.block_size
        run = v4_tier.split(snap.state, config, bs, first)
        chain = BlockChain.of(self.engine.fingerprint, req.block_digests[first:k])
        return (k - first, chain, req.all_token_ids[first * bs:k * bs], run, list(range(len(run))),
                block_pack.encode_mask([False] * (k - first - 1) + [True]))

    def _tier_request(self, request_id: str, running: bool) -> Request:
        engine = self.engine
        req = self.held.get(request_id) or self.detached.get(request_id) or \
            (engine.requests.get(request_id) if running else None)
        if req is None:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} holds no KV")
        return req

    def tier_blocks(self, request_id: str, first: int = 0,
                    running: bool = False) -> tuple[list[int], BlockChain, list[int]]:
        """``(block_ids, chain, token_ids)`` of a held (or detached, migrating; with ``running`` also a running)
        request's computed full blocks from index ``first`` on; ``token_ids`` is flat, ``block_size`` per block. A
        running request's blocks change at the next step: copy them in the same engine command."""
        engine = self.engine
        req = self._tier_request(request_id, running)
        bs = engine.config.block_size
        req.update_block_hashes()
        full = min(req.num_computed_tokens // bs, len(req.block_hashes))
        first = max(0, first)
        ids = self._bm.block_ids(request_id)[first:full]
        chain = BlockChain.of(engine.fingerprint, req.block_digests[first:first + len(ids)])
        return ids, chain, req.all_token_ids[first * bs:(first + len(ids)) * bs]
