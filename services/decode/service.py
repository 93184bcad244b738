"""Decode worker: admits KV hand-offs into its continuous batch (or prefills short prompts itself) and
streams tokens to the request's reply subject.

Invariants: a hand-off of KV computed by another model build (its ``model_fingerprint`` is not this engine's)
is refused with ``model_mismatch`` before anything is fetched; a hand-off is acknowledged only after its KV is in
this worker's cache (or queued for local recompute), so the prefill side may free its copy; every admitted
request ends with exactly one final chunk (finish reason + usage, or an error: ``timeout`` once the request's
``deadline_s`` has passed); cancel aborts the request in the engine and frees its blocks, and so does the death of
the router relaying its stream (``services/worker/router_watch.py``).
"""
from __future__ import annotations

import asyncio
import logging
import time

from services.decode.migration import MIGRATING, MigrationDesk
from shared import protocol, subjects, tracing
from shared.errors import DeepinferError, ErrorCode
from shared.kv import block_pack
from shared.kv.transport import handle_meta, transfer_timeout
from shared.metrics.common import OUTCOME_FINISHED
from services.worker.metrics import FINISH_REASONS, OUTCOME_MIGRATED
from services.worker.base import Worker

logger = logging.getLogger(__name__)


class DecodeService(Worker):
    async def serve_handlers(self) -> list:
        """Subscribe the decode work subject and the migration control; returns the subscriptions."""
        self.desk = MigrationDesk(self)
        return [await self.runtime.serve(subjects.decode(self.config.worker_id), self.on_message),
                await self.runtime.serve(subjects.ctl(self.config.worker_id, "migrate"), self.desk.on_migrate,
                                         work=False)]

    async def on_message(self, msg) -> None:
        req = protocol.decode(msg.data, (protocol.KVHandoff, protocol.DecodeLocalRequest, protocol.KVPrecopy))
        if isinstance(req, protocol.KVPrecopy):
            return await self.desk.on_precopy(msg, req)
        with tracing.span("decode", tracing.context_of(msg.headers),
                          {"deepinfer.request_id": req.request_id, "deepinfer.worker": self.config.worker_id,
                           "deepinfer.handoff": isinstance(req, protocol.KVHandoff)}, server=True) as span:
            await self._decode_request(msg, req, span)

    async def _decode_request(self, msg, req, span) -> None:
        """A hand-off or a local-prefill request (``on_message``), its chunks published until it ends."""
        params = req.sampling
        rid, eng = req.request_id, self.engine
        handoff = isinstance(req, protocol.KVHandoff)
        if handoff:
            transport = self.transports.get(req.transport)
            if transport is None:
                raise DeepinferError(ErrorCode.INVALID_REQUEST, f"transport {req.transport!r} not offered here")
            dtype, shape, nbytes = handle_meta(req.handle)  # the handle's own fields agree with each other
            has_window = block_pack.decode_mask(req.window_mask, req.num_blocks)
            packed = block_pack.packed_shape(has_window, req.block_shape, eng.kv_port.full_layers)
            if packed != shape or f"torch.{req.dtype}" != str(dtype):
                raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"hand-off header {packed} {req.dtype} disagrees "
                                     f"with its handle {shape} {dtype}")
            # before any allocation or fetch: a bad hand-off (or another build's KV) is refused here
            outputs = [*req.prior_output_ids, req.first_token]  # one token, or a migrating stream's all
            eng.kv_port.check_import(req.prompt_token_ids, outputs, params, [req.num_blocks, *req.block_shape],
                                     req.dtype, req.model_fingerprint, req.generator_state, req.first_block)
        else:
            eng.kv_port.check_model(req.model_fingerprint, "the decode request", allow_any=True)
            eng.validate([*req.prompt_token_ids, *req.prior_output_ids], params)
        deadline = asyncio.get_running_loop().time() + req.deadline_s  # the request's, as the router set it
        await self.track(rid, req.reply_to, req.router_id, req.router_instance)
        acked = False

        async def ack() -> None:
            nonlocal acked
            acked = True
            if msg.reply:
                await msg.respond(protocol.encode(protocol.Ack()))

        hold = self.tier is not None  # keep the blocks at the end for the write-back
        written_from = len(req.prompt_token_ids) // eng.config.block_size if handoff else 0  # local: set below
        imported: list[int] = []  # blocks pulled from the cache tier (local prefill)
        outcome = ErrorCode.INTERNAL.value  # unless set below: an unexpected exception (the runtime logs it)
        seq = req.first_seq if handoff else 0   # the next chunk's seq (an error chunk after the ack takes it)
        try:
            if handoff:
                t_fetch, fetch_ns = time.perf_counter(), time.time_ns()
                kv = await transport.fetch(req.handle, timeout=transfer_timeout(   # packed
                    self.config.handoff_timeout_s, nbytes))
                self.metrics.handoff(req.transport, "received", nbytes, time.perf_counter() - t_fetch)
                tracing.record("kv_fetch", fetch_ns, time.time_ns(), {"deepinfer.transport": req.transport,
                                                                      "deepinfer.bytes": nbytes})
                kv, has_window = eng.kv_port.unpack(kv.to(eng.kv_port.device), req.num_blocks, req.window_mask)
                submit = lambda: eng.kv_port.import_running(rid, req.prompt_token_ids, outputs, params, kv, req.cache_salt,
                                                    hold_kv=hold, model_fingerprint=req.model_fingerprint,
                                                    generator_state=req.generator_state, first_block=req.first_block,
                                                    has_window=has_window)
                seq, extra = req.first_seq, {"cached_tokens": req.num_cached_tokens, "prefill_ms": req.ttft_ms,
                                             "tier_cached_tokens": req.tier_cached_tokens}
            else:
                await ack()  # accepted now: an engine step in progress may take seconds to end
                known = [*req.prompt_token_ids, *req.prior_output_ids]   # a continuation's delivered tokens too
                pulled = await self.tier_pull(known, req.cache_salt, req.retention)
                pin = hold and self.tier is not None  # the prompt's window, for its write-back at the first token
                submit = self.with_tier(pulled, known, req.cache_salt, lambda reimport: eng.add_request(
                    req.prompt_token_ids, params, rid, req.cache_salt, hold_kv=hold, pin_prompt_window=pin,
                    prior_output_ids=req.prior_output_ids, reimport=reimport), imported)
                seq, extra = 0, {}
            # a hand-off is acknowledged once its KV is in our cache: the prefill side may drop its copy
            try:
                async with asyncio.timeout_at(deadline):
                    on_admitted = ack if handoff else None
                    while submit is not None:  # once, or again after a migration that did not happen
                        async for out in self.aengine.run(rid, submit, params.max_tokens + 1, on_admitted):
                            submit = on_admitted = None
                            if out.finish_reason == MIGRATING:  # every chunk before it is published: seq is next
                                submit = await self.desk.hand_over(req, seq, extra, deadline)
                                outcome = OUTCOME_MIGRATED if submit is None else outcome
                                hold = hold and submit is not None
                                continue
                            if out.finished:
                                outcome = (OUTCOME_FINISHED if out.finish_reason in FINISH_REASONS
                                           else ErrorCode.INTERNAL.value)
                                if not handoff:
                                    extra["tier_cached_tokens"] = min(sum(imported) * eng.config.block_size,
                                                                      out.num_cached_tokens)
                                    self.metrics.prompt_done(out.num_prompt_tokens, out.num_cached_tokens,
                                                             extra["tier_cached_tokens"])
                                    # blocks it found cached (device prefix cache, tier) were written back by
                                    # whoever computed them: only what this request computed goes to the tier
                                    written_from = max(written_from, out.num_cached_tokens // eng.config.block_size)
                                await self.publish_output(req.reply_to, seq, out, extra)
                                await self.tier_write_back(rid, written_from, req.cache_salt, req.retention)
                            else:
                                await self.publish_output(req.reply_to, seq, out)
                                if seq == (req.first_seq if handoff else 0):
                                    span.add_event("first_token")
                                if seq == 0 and not handoff and hold:  # the prompt, while its window is held
                                    written_from = await self.tier_write_back_prompt(
                                        rid, out.num_cached_tokens // eng.config.block_size, req.cache_salt,
                                        req.retention)
                            seq += 1
            except TimeoutError:
                raise DeepinferError(ErrorCode.TIMEOUT, f"the request's deadline passed after {seq} chunks") from None
        except DeepinferError as err:
            outcome = err.code.value
            if not acked:
                raise  # the prefill side (hand-off) or the router (dispatch) hears it in the reply
            await self.nc.publish(req.reply_to, protocol.encode(protocol.TokenChunk.from_error(rid, seq, err)))
        except asyncio.CancelledError:
            outcome = self.cancelled_outcome()
            raise
        finally:
            span.set_attributes({"deepinfer.outcome": outcome, "deepinfer.chunks": seq})
            self.untrack(rid, outcome)
            if hold:
                await self.aengine.call(lambda: eng.kv_port.release_held(rid))
