"""Decode worker: admits KV hand-offs into its continuous batch (or prefills short prompts itself) and
streams tokens to the request's reply subject.

Invariants: a hand-off is acknowledged only after its KV is in this worker's cache (or queued for local
recompute), so the prefill side may free its copy; every admitted request ends with exactly one final chunk
(finish reason + usage, or an error); cancel aborts the request in the engine and frees its blocks.
"""
from __future__ import annotations

import logging

import torch

from shared import protocol, subjects
from shared.engine.kv_handoff import import_prefilled
from shared.errors import DeepinferError, ErrorCode
from services.worker import Worker

logger = logging.getLogger(__name__)


class DecodeService(Worker):
    async def serve_handlers(self) -> None:
        await self.runtime.serve(subjects.decode(self.config.worker_id), self.on_message)

    async def on_message(self, msg) -> None:
        req = protocol.decode(msg.data, (protocol.KVHandoff, protocol.DecodeLocalRequest))
        params = protocol.sampling_from_dict(req.sampling)
        self.engine.validate(req.prompt_token_ids, params)
        rid, eng = req.request_id, self.engine
        if isinstance(req, protocol.KVHandoff):
            transport = self.transports.get(req.transport)
            if transport is None:
                raise DeepinferError(ErrorCode.INVALID_REQUEST, f"transport {req.transport!r} not offered here")
            kv = await transport.fetch(req.handle, timeout=self.config.handoff_timeout_s)
            expected = [req.num_blocks, *req.block_shape]
            if list(kv.shape) != expected or str(kv.dtype) != f"torch.{req.dtype}":
                raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"KV arrived as {list(kv.shape)} {kv.dtype}, "
                                     f"expected {expected} {req.dtype}")
            kv = kv.to(torch.device(eng.model.device))
            submit = lambda: import_prefilled(eng, rid, req.prompt_token_ids, req.first_token, params, kv,
                                              req.cache_salt)
            seq, extra = 1, {"cached_tokens": req.num_cached_tokens, "prefill_ms": req.ttft_ms}
        else:
            submit = lambda: eng.add_request(req.prompt_token_ids, params, rid, req.cache_salt)
            seq, extra = 0, {}
        async def ack() -> None:
            if msg.reply:
                await msg.respond(protocol.encode(protocol.Ack()))

        handoff = isinstance(req, protocol.KVHandoff)
        if not handoff:
            await ack()  # accepted now: an engine step in progress may take seconds to end
        self.track(rid)
        try:
            # a hand-off is acknowledged once its KV is in our cache: the prefill side may drop its copy
            async for out in self.aengine.run(rid, submit, params.max_tokens + 1, ack if handoff else None):
                await self.publish_output(req.reply_to, seq, out, extra if out.finished else None)
                seq += 1
        except DeepinferError as err:
            if handoff:
                raise  # the prefill side reports it
            await self.nc.publish(req.reply_to, protocol.encode(protocol.TokenChunk.from_error(rid, seq, err)))
        finally:
            self.untrack(rid)
