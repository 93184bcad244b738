"""Prefill worker: computes a prompt's KV (reusing its own prefix cache), samples the first token, streams
it to the client, hands the KV blocks to the decode worker named in the request, then frees them.

Invariant: the request's blocks are held from the first token until the hand-off is acknowledged, failed or
timed out — then released on this side (hashed blocks stay in the prefix cache) and the transport staging is
freed. A failed hand-off ends the request with a ``transfer_failed`` final chunk (``model_mismatch`` when the
decode worker serves another model build than this one's, named in the hand-off): never a hang, never a leak;
the router re-places the request. Work for another build than this worker's is refused (``model_mismatch``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from shared import protocol, subjects, tracing
from shared.errors import DeepinferError, ErrorCode
from shared.metrics.common import OUTCOME_FINISHED
from shared.kv.transport import transfer_timeout
from services.worker.metrics import OUTCOME_HANDED_OFF
from services.worker.base import Worker

logger = logging.getLogger(__name__)


class PrefillService(Worker):
    async def serve_handlers(self) -> list:
        """Subscribe the prefill work subject; returns the subscriptions."""
        return [await self.runtime.serve(subjects.prefill(self.config.worker_id), self.on_prefill)]

    async def on_prefill(self, msg) -> None:
        if not msg.reply:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, "a PrefillRequest needs a reply subject for its Ack")
        req = protocol.decode(msg.data, protocol.PrefillRequest)
        self.engine.kv_port.check_model(req.model_fingerprint, "the prefill request", allow_any=True)
        params = req.sampling
        if req.transport not in self.transports:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"transport {req.transport!r} not offered here")
        self.engine.validate([*req.prompt_token_ids, *req.prior_output_ids], params)
        await msg.respond(protocol.encode(protocol.Ack()))
        with tracing.span("prefill_request", tracing.context_of(msg.headers),
                          {"deepinfer.request_id": req.request_id, "deepinfer.worker": self.config.worker_id},
                          server=True):
            await self._prefill_request(req, params)

    async def _prefill_request(self, req: protocol.PrefillRequest, params) -> None:
        """An accepted prefill request (``on_prefill``): prefill, hand off, write back, release."""
        rid = req.request_id
        deadline = time.monotonic() + req.deadline_s  # the rest of it travels in the hand-off
        await self.track(rid, req.reply_to, req.router_id, req.router_instance)
        computed_from = [0]  # first block this prefill computed (the cached ones are not written back)
        outcome = ErrorCode.INTERNAL.value  # unless set below: an unexpected exception (the runtime logs it)
        try:
            outcome = await asyncio.wait_for(self._prefill(req, params, computed_from, deadline),
                                             timeout=max(req.deadline_s, 0.1))
        except asyncio.TimeoutError:
            outcome = ErrorCode.TIMEOUT.value
            await self._fail(req, DeepinferError(ErrorCode.TIMEOUT, "prefill or KV hand-off timed out"))
        except DeepinferError as err:
            outcome = err.code.value
            await self._fail(req, err)
        except asyncio.CancelledError:
            outcome = self.cancelled_outcome()
            raise
        finally:
            self.untrack(rid, outcome)
            await self.tier_write_back(rid, computed_from[0], req.cache_salt, req.retention)
            await self.aengine.call(lambda: self.engine.kv_port.release_held(rid))

    async def _prefill(self, req: protocol.PrefillRequest, params, computed_from: list[int], deadline: float) -> str:
        """Prefill, stream the first token, hand the KV off (with what is left of the request's ``deadline``, a
        ``time.monotonic()`` instant); the outcome (``finished`` when the first token ended the request, else
        ``handed_off``)."""
        rid, eng = req.request_id, self.engine
        t0, start_ns = time.perf_counter(), time.time_ns()
        one = dataclasses.replace(params, prefill_only=True)   # the first token, KV held for the hand-off
        known = [*req.prompt_token_ids, *req.prior_output_ids]   # a continuation's delivered tokens too
        pulled = await self.tier_pull(known, req.cache_salt, req.retention)
        imported: list[int] = []
        submit = self.with_tier(pulled, known, req.cache_salt, lambda reimport: eng.add_request(
            req.prompt_token_ids, one, rid, req.cache_salt, hold_kv=True, prior_output_ids=req.prior_output_ids,
            reimport=reimport),
            imported)
        outs = [o async for o in self.aengine.run(rid, submit, 2)]
        final = outs[-1]
        computed_from[0] = final.num_cached_tokens // eng.config.block_size
        tier_tokens = min(sum(imported) * eng.config.block_size, final.num_cached_tokens)
        if final.finish_reason not in ("length", "stop", "prefilled"):
            raise DeepinferError(ErrorCode.INTERNAL, f"prefill ended with {final.finish_reason}")
        self.metrics.prompt_done(final.num_prompt_tokens, final.num_cached_tokens, tier_tokens)
        tracing.record("prefill", start_ns, time.time_ns(), {"deepinfer.prompt_tokens": final.num_prompt_tokens,
                                                             "deepinfer.cached_tokens": final.num_cached_tokens,
                                                             "deepinfer.tier_cached_tokens": tier_tokens})
        if final.finish_reason != "prefilled":  # a stop rule of the whole request ended it at its first token
            await self.publish_output(req.reply_to, 0, final, {"tier_cached_tokens": tier_tokens})
            return OUTCOME_FINISHED
        await self.publish_output(req.reply_to, 0, dataclasses.replace(final, finished=False, finish_reason=None))
        ids = await self.aengine.call(lambda: eng.kv_port.prompt_block_ids(rid))
        generator_state = await self.aengine.call(lambda: eng.kv_port.held_generator_state(rid))
        transport = self.transports[req.transport]
        t_handoff, handoff_ns = time.perf_counter(), time.time_ns()
        # the blocks stay held (engine will not touch them) until the finally of on_prefill releases them
        # the cache itself, or a packed copy (KV groups: window rows only where the first decode query looks)
        cache, staged, mask = await self.kv_source(rid, ids, len(known))
        handle = await transport.stage_blocks(cache, staged, rid)  # gathers straight into staging
        try:
            handoff = protocol.KVHandoff(
                request_id=rid, prompt_token_ids=req.prompt_token_ids, first_token=final.new_token_ids[0],
                prior_output_ids=req.prior_output_ids,
                sampling=req.sampling, reply_to=req.reply_to, cache_salt=req.cache_salt, num_blocks=len(ids),
                block_shape=eng.kv_port.block_shape, dtype=eng.kv_port.dtype_name,
                transport=req.transport, handle=handle, num_cached_tokens=final.num_cached_tokens,
                ttft_ms=(time.perf_counter() - t0) * 1000.0, prefill_worker=self.config.worker_id,
                retention=req.retention, tier_cached_tokens=tier_tokens, model_fingerprint=eng.fingerprint,
                deadline_s=deadline - time.monotonic(), router_id=req.router_id, router_instance=req.router_instance,
                window_mask=mask, generator_state=generator_state)
            try:
                reply = await self.nc.request(subjects.decode(req.decode_worker), protocol.encode(handoff),
                                              timeout=transfer_timeout(self.config.handoff_timeout_s,
                                                                       int(handle.get("nbytes", 0))),
                                              headers=tracing.headers())
            except Exception as err:  # timeout, no responders, connection loss
                raise DeepinferError(ErrorCode.TRANSFER_FAILED,
                                     f"decode worker {req.decode_worker} did not take the KV: {err!r}") from None
            answer = protocol.decode(reply.data, (protocol.Ack, protocol.ErrorReply))
            if isinstance(answer, protocol.ErrorReply):
                raise answer.to_exception()
            self.metrics.handoff(req.transport, "sent", int(handle.get("nbytes", 0)), time.perf_counter() - t_handoff)
            tracing.record("kv_handoff", handoff_ns, time.time_ns(), {"deepinfer.transport": req.transport,
                                                                      "deepinfer.bytes": int(handle.get("nbytes", 0))})
        finally:
            await transport.release(rid)
        return OUTCOME_HANDED_OFF

    async def _fail(self, req: protocol.PrefillRequest, err: DeepinferError) -> None:
        logger.warning("[%s] prefill failed: %s", req.request_id, err)
        chunk = protocol.TokenChunk.from_error(req.request_id, 1, err)
        await self.nc.publish(req.reply_to, protocol.encode(chunk))
