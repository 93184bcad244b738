"""The source half of a live migration on a decode worker: the router asks on ``ctl(<worker>, "migrate")``
(``MigrateRequest``: a request this worker runs, a target decode worker, a KV transport).

0. Pre-copy, while the request keeps decoding: its full computed blocks (their KV is final) are staged and
   sent to the target as a ``KVPrecopy``, which keeps them in its prefix cache (``on_precopy``). A pre-copy
   that fails, or that a preemption overtook, is dropped: the switch then ships everything.
1. ``on_migrate`` detaches the request at the next step boundary (``KVPort.detach``: out of the batch, blocks
   kept) and ends its engine stream with a ``MIGRATING`` output, after every token it produced.
2. The request's own handler (``DecodeService.on_message``) has published every chunk before that output, so it
   knows the next ``seq``: it calls ``hand_over``, which stages the blocks the target lacks (from
   ``first_block``: the pre-copied ones are there), sends the target a ``KVHandoff`` for the stream under way
   (prompt + outputs, newest token, generator state, ``first_seq``) and waits for its Ack.
3. Acked: the target runs the stream (its chunks continue the seq on the same reply subject); the source drops
   the request and frees its blocks, and the handler ends without a final chunk. Anything else (refusal,
   timeout, transfer error, the target dying): the request is reattached and decodes on here as if nothing
   happened. Either way the router's ``MigrateRequest`` is answered (``Ack(detail=target)`` or the error).

Invariants: at most one migration per request at a time; ``max_concurrent`` per worker (more are refused
``overloaded``); every wait is bounded (``handoff_timeout_s``); the source stops before the target starts. A
target whose Ack was lost (the source timed out and decodes on) streams the same seqs as the source: to the
router the second chunk of a seq is out of order, so the attempt fails over from what the client already has
and both copies are cancelled (``services/router/relay.py``); the client never sees a duplicate.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from shared import protocol, subjects
from shared.engine.kv_port import Detached
from shared.engine.outputs import RequestOutput
from shared.errors import DeepinferError, ErrorCode
from shared.kv.transport import handle_meta, transfer_timeout

logger = logging.getLogger(__name__)

MIGRATING = "migrating"  # the finish reason of the engine output that ends a request's stream for a migration


MIN_PRECOPY_BLOCKS = 4  # fewer full blocks than this: the switch ships them all (a pre-copy costs a round trip)


@dataclasses.dataclass(slots=True)
class _Order:
    target: str
    transport: str
    done: asyncio.Future
    moved: Detached | None = None
    precopied: int = 0  # leading blocks the target already holds
    precopy_s: float = 0.0


class MigrationDesk:
    """Migrations out of one decode worker (``worker``: its engine, transports, NATS and config)."""

    def __init__(self, worker, max_concurrent: int = 2) -> None:
        self.worker, self.max_concurrent = worker, max_concurrent
        self.orders: dict[str, _Order] = {}
        self.sent = self.failed = 0
        self.precopied_blocks = 0

    async def on_migrate(self, msg) -> None:
        """``ctl(<worker>, "migrate")``: detach the request, then answer once the hand-over is settled."""
        req = protocol.decode(msg.data, protocol.MigrateRequest)
        w, rid = self.worker, req.request_id
        if rid not in w.active or rid in self.orders:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"{rid!r} is not running here, or already moving")
        if len(self.orders) >= self.max_concurrent:
            raise DeepinferError(ErrorCode.OVERLOADED, f"{len(self.orders)} migrations already under way")
        if req.transport not in w.transports or not req.target or req.target == w.config.worker_id:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"cannot move to {req.target!r} over {req.transport!r}")
        order = _Order(req.target, req.transport, asyncio.get_running_loop().create_future())
        self.orders[rid] = order
        try:
            t0 = time.perf_counter()
            order.precopied = await self._precopy(rid, order)
            order.precopy_s = time.perf_counter() - t0
            order.moved = await w.aengine.call(lambda: w.engine.kv_port.detach(rid))
        except BaseException:
            self.orders.pop(rid, None)
            raise
        w.aengine.end_stream(RequestOutput(rid, [], "", True, MIGRATING))
        try:
            moving = len(order.moved.block_ids) * w.engine.kv_port.block_bytes
            async with asyncio.timeout(transfer_timeout(w.config.handoff_timeout_s + 5.0, moving)):
                await asyncio.shield(order.done)
        except TimeoutError:
            raise DeepinferError(ErrorCode.TIMEOUT, f"migration of {rid} did not settle") from None
        finally:
            self.orders.pop(rid, None)
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(detail=order.target)))

    async def _precopy(self, rid: str, order: _Order) -> int:
        """Ship the request's full blocks ahead while it decodes on; how many the target kept (0: none)."""
        w, eng = self.worker, self.worker.engine
        ids, tokens, salt = await w.aengine.call(lambda: eng.kv_port.full_blocks(rid))
        if len(ids) < MIN_PRECOPY_BLOCKS:
            return 0
        transport, tid = w.transports[order.transport], f"{rid}-pre"
        try:
            cache, staged, mask = await w.kv_source(rid, ids, len(ids) * eng.config.block_size)
            handle = await transport.stage_blocks(cache, staged, tid)
            try:
                if not await w.aengine.call(lambda: eng.kv_port.holds_blocks(rid, ids)):
                    return 0  # preempted while copying: the staged bytes may not be its KV
                msg = protocol.KVPrecopy(request_id=rid, token_ids=tokens, cache_salt=salt,
                                         num_blocks=len(ids), block_shape=eng.kv_port.block_shape,
                                         dtype=eng.kv_port.dtype_name,
                                         transport=order.transport, handle=handle, model_fingerprint=eng.fingerprint,
                                         window_mask=mask)
                reply = await w.nc.request(subjects.decode(order.target), protocol.encode(msg),
                                           timeout=w.config.handoff_timeout_s)
                kept = min(len(ids), int(protocol.decode_reply(reply.data, protocol.Ack).detail or 0))
            finally:
                await transport.release(tid)
        except Exception as err:  # noqa: BLE001 - the switch ships everything instead
            logger.info("[%s] pre-copy to %s dropped: %r", rid, order.target, err)
            return 0
        self.precopied_blocks += kept
        return kept

    async def on_precopy(self, msg, req: protocol.KVPrecopy) -> None:
        """Target side: keep a pre-copy's blocks in the prefix cache; answer how many were kept."""
        w, eng = self.worker, self.worker.engine
        eng.kv_port.check_model(req.model_fingerprint, "the KV pre-copy")
        transport = w.transports.get(req.transport)
        dtype, shape, _ = handle_meta(req.handle)
        if transport is None or req.block_shape != eng.kv_port.block_shape \
                or shape != eng.kv_port.payload_shape(req.num_blocks, req.window_mask) \
                or str(dtype) != f"torch.{req.dtype}" or req.num_blocks * eng.config.block_size > len(req.token_ids):
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"pre-copy of {req.num_blocks} blocks over "
                                 f"{req.transport!r} does not fit its header or tokens")
        packed = await transport.fetch(req.handle, timeout=w.config.handoff_timeout_s)   # KVPort.payload_shape
        kv, has_window = eng.kv_port.unpack(packed.to(eng.kv_port.device), req.num_blocks, req.window_mask)
        kept = await w.aengine.call(lambda: eng.kv_port.import_tier_blocks(req.token_ids, req.cache_salt, 0, kv, has_window))
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(detail=str(kept))))

    async def hand_over(self, req: protocol.KVHandoff | protocol.DecodeLocalRequest, seq: int, extra: dict,
                        deadline: float) -> Callable[[], object] | None:
        """Send the detached request to its order's target, continuing at chunk ``seq`` with the usage ``extra``
        so far; ``deadline`` is the request's (loop time). Returns None once the target runs it (the source's
        copy is gone; a request this worker prefilled itself first wrote its computed blocks back to the tier,
        as its end would have), else the engine command that reattaches it here (the order's error is
        answered)."""
        w, rid = self.worker, req.request_id
        order = self.orders[rid]
        moved, eng = order.moved, w.engine
        transport = w.transports[order.transport]
        tid = f"{rid}-mig"
        t0 = time.perf_counter()
        first = order.precopied
        try:
            with_kv = len(moved.prompt_token_ids) + len(moved.output_token_ids) - 1   # the target's first query
            cache, staged, mask = await w.kv_source(rid, moved.block_ids[first:], with_kv)
            handle = await transport.stage_blocks(cache, staged, tid)
            try:
                handoff = protocol.KVHandoff(
                    request_id=rid, prompt_token_ids=moved.prompt_token_ids,
                    prior_output_ids=moved.output_token_ids[:-1], first_token=moved.output_token_ids[-1],
                    sampling=req.sampling, reply_to=req.reply_to, cache_salt=req.cache_salt,
                    num_blocks=len(moved.block_ids) - first, block_shape=eng.kv_port.block_shape,
                    dtype=eng.kv_port.dtype_name, transport=order.transport, handle=handle,
                    num_cached_tokens=min(extra.get("cached_tokens", moved.num_cached_tokens),
                                          len(moved.prompt_token_ids)),
                    ttft_ms=extra.get("prefill_ms", 0.0), retention=req.retention,
                    tier_cached_tokens=min(extra.get("tier_cached_tokens", 0),
                                           extra.get("cached_tokens", moved.num_cached_tokens),
                                           len(moved.prompt_token_ids)),
                    model_fingerprint=eng.fingerprint,
                    deadline_s=deadline - asyncio.get_running_loop().time(), router_id=req.router_id,
                    router_instance=req.router_instance, generator_state=moved.generator_state, first_seq=seq,
                    first_block=first, window_mask=mask)
                reply = await w.nc.request(subjects.decode(order.target), protocol.encode(handoff),
                                           timeout=transfer_timeout(w.config.handoff_timeout_s,
                                                                    int(handle.get("nbytes", 0))))
                protocol.decode_reply(reply.data, protocol.Ack)
            finally:
                await transport.release(tid)
        except Exception as err:  # noqa: BLE001 - refused, timed out, transfer failed: the stream stays here
            self.failed += 1
            failure = err if isinstance(err, DeepinferError) else DeepinferError(
                ErrorCode.TRANSFER_FAILED, f"migration of {rid} to {order.target} failed: {err!r}")
            logger.warning("[%s] migration to %s failed, decoding on here: %s", rid, order.target, failure)
            _settle(order.done, failure)
            return lambda: eng.kv_port.reattach(rid)
        if isinstance(req, protocol.DecodeLocalRequest):  # a hand-off's prompt went back from its prefill worker
            await w.tier_write_back(rid, moved.num_cached_tokens // eng.config.block_size, req.cache_salt,
                                    req.retention)
        await w.aengine.call(lambda: eng.kv_port.drop_detached(rid))
        self.sent += 1
        w.metrics.handoff(order.transport, "migrated", int(handle.get("nbytes", 0)), time.perf_counter() - t0)
        logger.info("[%s] migrated to %s at chunk %d (%d tokens; %d of %d blocks pre-copied in %.3f s, the rest "
                    "switched in %.3f s)", rid, order.target, seq, len(moved.prompt_token_ids) +
                    len(moved.output_token_ids), first, len(moved.block_ids), order.precopy_s,
                    time.perf_counter() - t0)
        _settle(order.done, None)
        return None


def _settle(done: asyncio.Future, err: BaseException | None) -> None:
    if not done.done():
        if err is None:
            done.set_result(None)
        else:
            done.set_exception(err)

