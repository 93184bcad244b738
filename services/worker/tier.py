"""A worker's side of the cache tier (``services/worker/tier_client.py``; the engine's: ``shared/engine/kv_port.py``):
pull the blocks a prompt lacks before it is added, write computed blocks back, and write a preempted sequence's KV
to the tier to pull it back before it is readmitted (``shared/engine/preempted_kv.py``). Mixed into
``services.worker.base.Worker``, whose ``engine``, ``aengine``, ``tier``, ``runtime`` and ``kv_source`` these use. None
of them raises for the tier's sake: a pull that fails computes, a write-back that cannot be made is dropped and
counted, a preempted sequence whose KV does not come back recomputes.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from shared.engine.preempted_kv import Offer
from shared.errors import DeepinferError
from shared.kv.transport import transfer_timeout
from shared.retention import NO_RETENTION
from services.worker.tier_client import Pulled

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Resume:
    """A preempted sequence's resume, while its KV is offered: ``wanted`` is set when the engine wants it back
    (or it is gone: aborted, finished, given up)."""
    wanted: asyncio.Event = field(default_factory=asyncio.Event)
    gone: bool = False


class TierMixin:
    def start_preempt_offers(self) -> None:
        """Offer preempted sequences' KV to the tier (off without a tier, for a state layout, or with
        ``preempt_offer_mib`` 0). Call on the loop before requests arrive."""
        c, eng = self.config, self.engine
        if self.tier is None or eng.kv_port.carries_state or c.preempt_offer_mib <= 0:
            return
        loop = asyncio.get_running_loop()
        self._resumes: dict[str, _Resume] = {}

        def sink(kind: str, request_id: str, payload) -> None:   # on the engine thread
            loop.call_soon_threadsafe(self._on_preempted, kind, request_id, payload)
        eng.kv_port.preempted.enable(sink, c.preempt_offer_mib << 20, c.tier_timeout_s)

    def _on_preempted(self, kind: str, request_id: str, payload) -> None:
        if kind == "offer":
            state = self._resumes[request_id] = _Resume()
            self.runtime.spawn(self._resume_preempted(payload, state))
            return
        state = self._resumes.get(request_id)
        if state is not None:
            state.gone = state.gone or kind == "gone"
            state.wanted.set()

    async def _resume_preempted(self, offer: Offer, state: _Resume) -> None:
        """Write ``offer`` to the tier; once the engine wants the sequence back, pull what its device cache lacks
        and hand it over (``PreemptedKV.resume``). Ends when the sequence is resumed or gone."""
        eng, rid = self.engine, offer.request_id
        port, pulled = eng.kv_port.preempted, None
        written = asyncio.get_running_loop().create_future()
        try:
            try:
                ok = await self.tier.write_back(offer.kv, range(len(offer.kv)), offer.chain, offer.token_ids,
                                                eng.config.block_size, offer.cache_salt, NO_RETENTION,
                                                offer.window_mask, eng.kv_port.full_layers, eng.kv_port.block_shape,
                                                written=written)
            finally:
                port.released(offer.nbytes)   # staged or dropped: the copy is not needed any more
                offer.kv = None
            if ok:
                await state.wanted.wait()   # bounded by the sequence's life: ``gone`` ends it too
                if not state.gone:
                    async with asyncio.timeout(transfer_timeout(self.config.tier_timeout_s, offer.nbytes)):
                        ok = await written
                    if ok:
                        # from block 0: the device cache lacks some, and what it holds now may be evicted
                        # before there is room to readmit (the import skips what it still holds then)
                        pulled = await self.tier_pull(offer.all_token_ids, offer.cache_salt, NO_RETENTION,
                                                      whole=True)
        except (TimeoutError, DeepinferError) as err:
            logger.info("[%s] preempted KV not pulled back: %s", rid, err)
        finally:
            if self._resumes.get(rid) is state:
                del self._resumes[rid]
            if not state.gone:
                try:
                    await self.aengine.call(lambda: port.resume(rid, pulled))
                except DeepinferError as err:   # the engine stopped: nothing to resume
                    logger.debug("[%s] no resume: %s", rid, err)

    async def tier_pull(self, prompt: list[int], cache_salt: str, retention: str, whole: bool = False) -> Pulled | None:
        """The prompt's reusable blocks that the local prefix cache lacks (``whole``: all of them, from block 0)
        and the tier holds, or None."""
        if self.tier is None or not self.tier.alive:
            return None
        eng = self.engine
        first, hashes = await self.aengine.call(lambda: eng.kv_port.missing_blocks(prompt, cache_salt))
        first = 0 if whole else first
        return await self.tier.pull(first, hashes, prompt, eng.config.block_size, eng.kv_port.tier_block_shape,
                                    eng.kv_port.dtype_name, cache_salt, retention,
                                    eng.kv_port.window_layers)

    def with_tier(self, pulled: Pulled | None, prompt: list[int], cache_salt: str, add, imported: list[int]):
        """An engine command: ``add(reimport)`` (an ``LLMEngine.add_request``) preceded by the import of ``pulled``
        blocks (their count is appended to ``imported``). ``reimport`` (None without a pull) publishes them again;
        the scheduler calls it before each admission attempt, so blocks evicted while the request waits (other
        requests' prefill chunks reuse free cached blocks) are back when its prefix lookup runs."""
        if pulled is None:
            return lambda: add(None)
        eng = self.engine

        def reimport() -> int:
            return eng.kv_port.import_tier_blocks(prompt, cache_salt, pulled.first, pulled.kv, pulled.has_window)

        def import_then_add():
            imported.append(reimport())
            return add(reimport)
        return import_then_add

    async def tier_write_back(self, request_id: str, first_block: int, cache_salt: str, retention: str) -> None:
        """Stage a held request's computed blocks from ``first_block`` on for the tier (the caller releases the
        request's blocks afterwards). Never raises: a write-back that cannot be made is dropped and counted."""
        if self.tier is None:
            return
        eng = self.engine
        if eng.kv_port.carries_state:
            await self._write_state(request_id, first_block, cache_salt, retention, running=False)
            return
        try:
            ids, hashes, tokens = await self.aengine.call(lambda: eng.kv_port.tier_blocks(request_id, first_block))
            cache, staged, mask = await self.kv_source(request_id, ids)
            await self.tier.write_back(cache, staged, hashes, tokens, eng.config.block_size, cache_salt,
                                       retention, mask, eng.kv_port.full_layers, eng.kv_port.block_shape)
        except DeepinferError as err:   # not held (aborted, failed): nothing to write
            logger.debug("[%s] no write-back: %s", request_id, err)

    async def tier_write_back_prompt(self, request_id: str, first_block: int, cache_salt: str, retention: str) -> int:
        """With KV groups: stage a running request's computed blocks from ``first_block`` on (its prompt, at its
        first token) for the tier with the window of the prompt's end (added with ``pin_prompt_window``, which this
        lifts), so a later prompt sharing the text but not its last words can be hit (by the request's end, or
        even its first decode step, the window has moved on). Blocks and their packed copy come from one engine
        command. Returns the block index written up to (``first_block`` when nothing was: no tier, no KV
        groups)."""
        eng = self.engine
        if self.tier is None or not (not eng.kv_port.stages_in_place):
            return first_block
        if eng.kv_port.carries_state:
            return await self._write_state(request_id, first_block, cache_salt, retention, running=True)

        def stage():
            req = eng.requests.get(request_id)
            try:
                ids, chain, tokens = eng.kv_port.tier_blocks(request_id, first_block, running=True)
                return ids, chain, tokens, *eng.kv_port.source(request_id, ids)
            finally:
                if req is not None:
                    req.window_pin = None   # copied (or nothing to copy): the window moves on
        try:
            ids, chain, tokens, cache, rows, mask = await self.aengine.call(stage)
        except DeepinferError as err:   # ended or aborted meanwhile
            logger.debug("[%s] no prompt write-back: %s", request_id, err)
            return first_block
        if ids and await self.tier.write_back(cache, rows, chain, tokens, eng.config.block_size, cache_salt,
                                              retention, mask, eng.kv_port.full_layers, eng.kv_port.block_shape):
            return first_block + len(ids)
        return first_block

    async def _write_state(self, request_id: str, first_block: int, cache_salt: str, retention: str,
                           running: bool) -> int:
        """A state layout's write-back (DeepSeek V4): the request's newest snapshot as tier blocks from
        ``first_block`` on, staged in one engine command (``KVPort.tier_state_run``). Returns the block index
        written up to."""
        eng = self.engine
        try:
            staged = await self.aengine.call(lambda: eng.kv_port.tier_state_run(request_id, first_block, running))
        except DeepinferError as err:   # ended or aborted meanwhile
            logger.debug("[%s] no write-back: %s", request_id, err)
            return first_block
        if staged is None:
            return first_block
        count, chain, tokens, run, rows, mask = staged
        if await self.tier.write_back(run, rows, chain, tokens, eng.config.block_size, cache_salt, retention, mask,
                                      eng.kv_port.full_layers, eng.kv_port.tier_block_shape):
            return first_block + count
        return first_block
