"""Runs an ``LLMEngine`` on its own thread and exposes it to asyncio.

``launch`` builds the engine on that same thread, so a worker process runs every parallel torch op on one
thread and has one OpenMP thread pool. A second pool (the model loaded in an executor thread, a large copy
on the event loop) makes libgomp count more threads than cores and stop its workers spinning between
parallel regions. On 2 cores engine steps ran 10-45% slower, and the served path measured 0.77-0.84x of the
in-process engine instead of 0.93-0.97x (``benchmarks/e2e_services.py --prefill 0``).

The engine is not thread-safe, so every mutation (add, abort, import, export, release) is a command executed
on the engine thread between steps. Commands go through a bounded queue: when it is full, callers get an
``overloaded`` error instead of unbounded buffering. Each request's outputs go to a per-request asyncio queue
bounded by its ``max_tokens`` (one output per token at most).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.errors import DeepinferError, ErrorCode

logger = logging.getLogger(__name__)

STEP_EWMA = 0.2  # weight of the newest step in ``step_s`` (about the last 5-10 steps)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None, max_pending_commands: int = 1024) -> None:
        self.engine = engine  # None until ``launch`` has built it
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue(
            max_pending_commands)
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.step_s = 0.0  # moving average of engine step time (while it has work; written on the engine thread)

    # -- lifecycle ------------------------------------------------------------------------------------
    @classmethod
    async def launch(cls, build: Callable[[], LLMEngine], max_pending_commands: int = 1024) -> "AsyncEngine":
        """Start the engine thread, run ``build()`` on it (load the model, attach sinks and drafters: all the
        torch work of start-up), then step the engine there. Raises what ``build`` raised (the thread ends)."""
        self = cls(None, max_pending_commands)
        self._loop = asyncio.get_running_loop()
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build_and_run, args=(build, built), name="engine", daemon=True)
        self._thread.start()
        try:
            self.engine = await asyncio.wrap_future(built)
        except BaseException:  # build failed (the thread has ended) or the caller gave up (the thread ends)
            self._stopping.set()
            self._thread = None
            raise
        return self

    def _build_and_run(self, build: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        if not built.set_running_or_notify_cancel():  # the caller gave up before the build began
            return
        try:  # running from here on: a caller giving up now sets _stopping, and the loop below ends at once
            engine = build()
        except BaseException as err:
            built.set_exception(err)
            return
        self.engine = engine
        built.set_result(engine)
        self._run()

    async def stop(self) -> None:
        """Stop the engine thread (idempotent). Unfinished requests are aborted."""
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            self._thread = None

    def _run(self) -> None:
        eng = self.engine
        while not self._stopping.is_set():
            try:
                fn, fut = self._commands.get(timeout=0.02) if not eng.has_unfinished() else \
                    self._commands.get_nowait()
            except queue.Empty:
                fn = None
            if fn is not None:
                self._execute(fn, fut)
                while True:  # apply every queued command before the next step
                    try:
                        fn, fut = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    self._execute(fn, fut)
            if eng.has_unfinished():
                t0 = time.perf_counter()
                outputs = eng.step()
                self.step_s += STEP_EWMA * (time.perf_counter() - t0 - self.step_s)
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        for rid in list(eng.requests):
            eng.abort(rid)

    @staticmethod
    def _execute(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as err:  # delivered to the awaiting coroutine
            fut.set_exception(err)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        if self._thread is None:
            raise DeepinferError(ErrorCode.UNAVAILABLE, "engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._commands.put_nowait((fn, fut))
        except queue.Full:
            raise DeepinferError(ErrorCode.OVERLOADED, "engine command queue is full") from None
        return await asyncio.wrap_future(fut)

    # -- requests -------------------------------------------------------------------------------------
    def end_stream(self, out: RequestOutput) -> None:
        """Deliver a final ``out`` that the engine did not produce (a request detached for migration) after
        every output already dispatched for its request, and close that request's stream. Call on the loop,
        after the engine command that stopped the request returned (its earlier outputs are queued by then)."""
        stream = self._streams.pop(out.request_id, None)
        if stream is not None:
            stream.put_nowait(out)

    def open_stream(self, request_id: str, max_outputs: int) -> asyncio.Queue[RequestOutput]:
        if request_id in self._streams:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"duplicate request id {request_id!r}")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue(max_outputs + 1)
        self._streams[request_id] = stream
        return stream

    async def run(self, request_id: str, submit: Callable[[], Any], max_outputs: int,
                  on_admitted: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request via ``submit`` (executed on the engine thread), await ``on_admitted`` once it is
        in the engine, then yield its outputs until the final one. If the consumer stops early (cancel,
        disconnect), the request is aborted."""
        stream = self.open_stream(request_id, max_outputs)
        finished = False
        try:
            await self.call(submit)
            if on_admitted is not None:
                await on_admitted()
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._thread is not None:
                try:
                    await self.call(lambda: self.engine.abort(request_id))
                except DeepinferError:
                    logger.warning("could not abort %s", request_id)

    def load(self) -> dict[str, float | str]:
        """Racy-but-safe snapshot of load metrics (reads only ints/floats), plus the engine's model fingerprint
        (constant: every heartbeat built from this names the build it serves)."""
        eng = self.engine
        bm = eng.block_manager
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                     for r in list(eng.scheduler.waiting) + list(eng.scheduler.running))
        return {"num_running": len(eng.scheduler.running), "num_waiting": len(eng.scheduler.waiting),
                "kv_usage": bm.usage, "num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks,
                "queued_prefill_tokens": queued, "model_fingerprint": eng.fingerprint,
                "max_model_len": eng.max_model_len, "max_num_seqs": eng.config.max_num_seqs,
                "step_ms": self.step_s * 1000.0 if eng.has_unfinished() else 0.0}
