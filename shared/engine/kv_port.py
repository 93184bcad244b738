"""The engine's KV port: KV that crosses the engine's boundary, in whatever layout its ``KVManager`` keeps.

Three flows go through it, each between steps on the engine thread (``AsyncEngine.call``), so no step runs in
the middle of one:

- **Hand-off** (prefill worker -> decode worker). A request added with ``hold_kv`` finishes with its blocks
  allocated (``hold``; ``release_held`` frees them); ``prompt_block_ids`` names the blocks of its prompt's KV and
  ``source`` stages them. The decode side checks a hand-off before any allocation or fetch (``check_handoff``:
  another build's KV is ``model_mismatch``, a token outside the vocabulary ``invalid_request``, a payload that is
  not this layout's ``transfer_failed``), then ``import_prefilled`` admits the request with the prompt computed.
- **Migration** (decode worker -> decode worker). ``detach`` takes a running request at a decode-step boundary
  out of the batch with its blocks kept (``reattach`` puts it back as it was; ``drop_detached`` frees it once the
  target runs it); ``Detached`` carries its tokens, blocks and seeded generator state. Pre-copy:
  ``full_blocks`` names the blocks whose KV is final, ``holds_blocks`` confirms nothing preempted it meanwhile.
  ``import_running`` rebuilds the request from prompt + output tokens (the detokenizer is fed the same tokens
  under the engine's own stop-token rule), writes the KV of all but the newest token after its own prefix-cache
  hit, restores the generator and joins the batch: the next step decodes the newest token as the source would
  have. A hand-off is the case of one output token. With no room it is queued for local recompute: work is
  never lost, only recomputed.
- **Cache tier** (``shared/engine/kv_tier.py``, mixed in): pulled blocks published in the prefix cache before
  the request is added, computed blocks named for write-back.

Wire layout: a run of blocks is a packed run (``shared/kv/block_pack.py``) of logical blocks
``[L, 2, kvh, block_size, D]``: every block's full-attention rows, a window layer's rows only where the source
still held them (a layout without KV groups sends whole blocks: empty mask). An importer never reads a row that
did not travel: its ``KVManager`` allocates window rows only where its window needs them, and a layout that
cannot take a partial block (``accepts``) recomputes instead.

A per-sequence state layout (DeepSeek V4, ``shared/engine/v4_kv.py``: a window, compressed entries and pending
groups per layer, no paged pools) travels as one packed state (``shared/model/v4_state.pack``): pages of
``block_shape = [page_numel]`` numbers, as many as the state over the request's tokens needs, the whole state at
once (no pre-copy: no block of it is final while the request runs); the importer restores it whole
(``V4StateManager.adopt``). To the cache tier it writes a snapshot at a block boundary as blocks of compressed
entries with the snapshot's tail (window, pending groups) on the last (``shared/model/v4_tier.py``: the tail rows
are the packed run's window rows, so the tier stores them as it stores a window layer's), and a pull becomes a
snapshot in its prefix cache (``tier_state_run``, ``import_tier_blocks``).

Invariants: a detached request is in ``engine.requests`` and ``detached`` and in no scheduler queue; a held one
is in ``held`` only; ``engine.abort`` of either frees its blocks.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from shared.engine.kv_tier import TierFlow
from shared.engine.preempted_kv import PreemptedKV
from shared.engine.request import Request, RequestStatus
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.kv import block_pack
from shared.model import kv_cache, v4_tier
from shared.protocol_work import MAX_GENERATOR_STATE_BYTES

if TYPE_CHECKING:
    from shared.engine.llm_engine import LLMEngine


@dataclasses.dataclass(frozen=True, slots=True)
class Detached:
    """What a target needs to continue a detached request: ``block_ids`` hold the KV of
    ``prompt_token_ids + output_token_ids[:-1]`` in order; ``generator_state`` is b"" for unseeded sampling."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    generator_state: bytes
    num_cached_tokens: int


class KVPort(TierFlow):
    """See the module docstring. Owned by one ``LLMEngine`` (``engine.kv_port``); every method runs on its thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.held: dict[str, Request] = {}      # finished hold_kv requests whose blocks are still allocated
        self.detached: dict[str, Request] = {}  # running requests taken out of the batch to migrate
        self.preempted = PreemptedKV(self)      # preempted sequences' KV offered to the cache tier (off by default)

    @property
    def _bm(self):
        return self.engine.block_manager

    @property
    def _kv(self) -> kv_cache.KVCache:
        return self.engine.runner.kv_cache

    # -- layout --------------------------------------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        """The first KV group's pool ``[num_blocks, L, 2, kvh, block_size, D]`` (the whole cache with one pool):
        its device and dtype are the cache's; stage blocks through ``source``."""
        return kv_cache.first_pool(self._kv)

    @property
    def block_shape(self) -> list[int]:
        """The wire shape of one logical block: ``[L, 2, kvh, block_size, D]`` (a state layout's page:
        ``[page_numel]``)."""
        return [self._bm.page_numel] if self.carries_state else kv_cache.block_shape(self._kv)

    def _payload_blocks(self, num_tokens: int) -> int:
        """Payload blocks of a request whose KV covers ``num_tokens`` tokens (a state layout's: its pages)."""
        if self.carries_state:
            return self._bm.payload_pages(num_tokens)
        return -(-num_tokens // self.engine.config.block_size)

    @property
    def carries_state(self) -> bool:
        """Whether the manager keeps one state per sequence (DeepSeek V4) rather than paged KV blocks."""
        return self._kv is None

    @property
    def tier_block_shape(self) -> list[int]:
        """The shape of one block the cache tier stores: the wire block's, or a state layout's tier block
        (``v4_tier.block_shape``: an entry row and the tail rows)."""
        if self.carries_state:
            return v4_tier.block_shape(self.engine.model.config, self.engine.config.block_size)
        return self.block_shape

    @property
    def block_bytes(self) -> int:
        """Bytes of one logical block (a state layout's budget block)."""
        if self.carries_state:
            return self._bm.block_bytes
        return int(torch.Size(self.block_shape).numel()) * self.kv_cache.dtype.itemsize

    @property
    def dtype(self) -> torch.dtype:
        """The dtype KV travels in: the cache's (a state layout's: the model's)."""
        return self.engine.model.dtype if self.carries_state else self.kv_cache.dtype

    @property
    def device(self) -> torch.device:
        """Where imported KV goes: the cache's device (a state layout's: the model's)."""
        return self.engine.model.device if self.carries_state else self.kv_cache.device

    @property
    def dtype_name(self) -> str:
        """The KV dtype as the wire names it (torch's name without ``torch.``)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def stages_in_place(self) -> bool:
        """Whether ``source`` hands out the cache itself (any thread may stage from it) rather than a packed copy
        (made on the engine thread, between steps: then the blocks' content at one instant)."""
        return not self.carries_state and kv_cache.stages_in_place(self._kv)

    @property
    def window_layers(self) -> list[int]:
        """The model's sliding-window layers (the rows a packed block may leave out; a state layout's tier block:
        its tail rows)."""
        if self.carries_state:
            return v4_tier.tail_rows(self.engine.model.config, self.engine.config.block_size)
        return [i for i, w in enumerate(self.engine.model.config.layer_sliding_windows) if w is not None]

    @property
    def full_layers(self) -> int:
        """Layer rows of a packed block without its window rows (``shared/kv/block_pack.py``; a state layout's
        tier block: its entry row)."""
        if self.carries_state:
            return 1
        return self.engine.model.config.num_layers - len(self.window_layers)

    def gather(self, request_id: str, ids: list[int]) -> torch.Tensor:
        """``[n, L, 2, kvh, bs, D]`` copy of the request's logical blocks ``ids``."""
        return kv_cache.gather(self._kv, self._bm.group_block_ids(request_id, list(ids)))

    def source(self, request_id: str, ids: list[int],
               next_query: int | None = None) -> tuple[torch.Tensor, list[int], bytes]:
        """``(cache, rows, window_mask)`` a transport stages the request's blocks ``ids`` from
        (``stage_blocks(cache, rows)``): the cache itself, ``ids`` and ``b""`` when it stages in place; else a
        packed run, ``range(n)`` and its mask. With ``next_query`` (the first position the importer computes), a
        block carries window rows only where that query's window can see it: no row travels unread."""
        if self.carries_state:   # the whole state, packed: ``ids`` are its pages
            req = self.held.get(request_id) or self.detached.get(request_id) or self.engine.requests[request_id]
            covered = self._bm.state_of(request_id).num_tokens
            if covered != req.num_tokens - 1 or len(ids) != self._payload_blocks(covered):
                raise DeepinferError(ErrorCode.INTERNAL, f"{request_id}'s state covers {covered} tokens, not the "
                                     f"{req.num_tokens - 1} before its newest ({len(ids)} pages asked)")
            pages = self._bm.pack(request_id)
            return pages, list(range(len(pages))), b""
        group_ids = self._bm.group_block_ids(request_id, list(ids), next_query)
        source, rows, has_window = kv_cache.stage(self._kv, group_ids)
        return source, rows, b"" if has_window is None else block_pack.encode_mask(has_window)

    def payload_shape(self, num_blocks: int, window_mask: bytes) -> list[int]:
        """The shape of a payload of ``num_blocks`` packed blocks with ``window_mask`` in this layout
        (``[num_blocks, *block_shape]`` when the mask is empty); ``transfer_failed`` for a mask that cannot be."""
        if not window_mask:
            return [num_blocks, *self.block_shape]
        has_window = block_pack.decode_mask(window_mask, num_blocks)
        return block_pack.packed_shape(has_window, self.block_shape, self.full_layers)

    def unpack(self, payload: torch.Tensor, num_blocks: int, window_mask: bytes) -> tuple[torch.Tensor, list[bool]]:
        """``(blocks [num_blocks, L, ...], has_window)`` of a fetched payload (``payload_shape``); rows that did not
        travel read as zeros, and ``has_window`` says which blocks carry theirs. A state layout's pages come back
        as they are."""
        if self.carries_state:
            if window_mask or list(payload.shape) != [num_blocks, *self.block_shape]:
                raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"a packed state is {num_blocks} pages of "
                                     f"{self.block_shape} with no window mask, not {list(payload.shape)}")
            return payload, [True] * num_blocks
        has_window = block_pack.decode_mask(window_mask, num_blocks)   # block_pack.unpack checks the shape
        return block_pack.unpack(payload, has_window, self.window_layers, self.block_shape), has_window

    def write(self, request_id: str, first: int, blocks: torch.Tensor) -> None:
        """Write logical blocks ``blocks: [n, L, ...]`` into the request's blocks ``first .. first + n - 1`` (window
        rows only where its window table holds a block)."""
        ids = self._bm.block_ids(request_id)[first:first + len(blocks)]
        kv_cache.scatter(self._kv, self._bm.group_block_ids(request_id, ids), blocks)

    # -- hand-off --------------------------------------------------------------------------------------
    def hold(self, request: Request) -> None:
        """Keep a finished ``hold_kv`` request's blocks until ``release_held``."""
        self.held[request.request_id] = request

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished ``hold_kv`` request (idempotent); hashed ones stay cached."""
        if self.held.pop(request_id, None) is not None:
            self._bm.free(request_id)

    def held_generator_state(self, request_id: str) -> bytes:
        """A held request's sampler state after its last token (b"" unseeded): what the next engine continues
        from, so a seeded stream samples as it would have in one engine."""
        req = self.held.get(request_id)
        if req is None:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} holds no KV")
        return bytes(req.generator.get_state().numpy().tobytes()) if req.generator is not None else b""

    def prompt_block_ids(self, request_id: str) -> list[int]:
        """The blocks holding a held request's KV (prompt and any prior outputs: every token but the newest), in
        order."""
        req = self.held.get(request_id)
        if req is None:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} holds no KV")
        return self._kv_block_ids(req)

    def _kv_block_ids(self, req: Request) -> list[int]:
        """The blocks (a state layout's: pages) holding the KV of every token of ``req`` but the newest."""
        if self.carries_state:
            return list(range(self._payload_blocks(req.num_tokens - 1)))
        return self._bm.block_ids(req.request_id)[:-(-(req.num_tokens - 1) // self.engine.config.block_size)]

    def export_kv(self, request_id: str) -> torch.Tensor:
        """``[num_prompt_blocks, L, 2, kvh, block_size, D]`` copy of a held request's prompt KV."""
        return self.gather(request_id, self.prompt_block_ids(request_id))

    def check_model(self, model_fingerprint: str, what: str, allow_any: bool = False) -> None:
        """Raise ``model_mismatch`` unless ``model_fingerprint`` is this engine's (``allow_any``: or empty, for work
        that carries tokens only, from a sender that names no build). ``what`` names the message in the error."""
        engine = self.engine
        if model_fingerprint == engine.fingerprint or (allow_any and not model_fingerprint):
            return
        raise DeepinferError(ErrorCode.MODEL_MISMATCH, f"{what} is for model build {model_fingerprint or '(unnamed)'}"
                             f"; this worker serves {engine.model.config.model_id} build {engine.fingerprint}")

    def check_handoff(self, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                      shape: list[int], dtype: str, *, model_fingerprint: str) -> None:
        """Raise unless a hand-off of ``prompt_token_ids`` + ``first_token`` whose payload is ``shape`` / ``dtype``,
        computed by the build ``model_fingerprint``, can be imported here. Allocates and reads nothing."""
        self.check_import(prompt_token_ids, [first_token], params, shape, dtype, model_fingerprint)

    def import_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                         params: SamplingParams, kv: torch.Tensor, cache_salt: str = "", hold_kv: bool = False, *,
                         model_fingerprint: str, has_window: list[bool] | None = None) -> bool:
        """``import_running`` with one output token: ``kv: [ceil(len(prompt) / block_size), L, 2, kvh, bs, D]``."""
        return self.import_running(request_id, prompt_token_ids, [first_token], params, kv, cache_salt, hold_kv,
                                   model_fingerprint=model_fingerprint, has_window=has_window)

    # -- migration -------------------------------------------------------------------------------------
    def detach(self, request_id: str) -> Detached:
        """Take a running request out of the batch, blocks kept. ``invalid_request`` if it is not running, or not
        at a decode step boundary (queued, preempted, mid-prefill: there is no live KV to move)."""
        engine = self.engine
        req = engine.requests.get(request_id)
        if req is None or request_id in self.detached:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not running here")
        if (req.status != RequestStatus.RUNNING or req not in engine.scheduler.running or req.spec_token_ids
                or req.num_output_tokens < 1 or req.num_computed_tokens != req.num_tokens - 1):
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not decoding "
                                 f"({req.num_computed_tokens}/{req.num_tokens} tokens computed)")
        engine.scheduler.remove(req, free_blocks=False)
        self.detached[request_id] = req
        ids = self._kv_block_ids(req)
        state = bytes(req.generator.get_state().numpy().tobytes()) if req.generator is not None else b""
        return Detached(list(req.prompt_token_ids), list(req.output_token_ids), list(ids), state,
                        req.stats.num_cached_tokens)

    def full_blocks(self, request_id: str) -> tuple[list[int], list[int], str]:
        """Pre-copy: ``(block ids, token ids, cache salt)``: a running request's computed full blocks (their KV
        never changes while it runs; a state layout has none), all its tokens so far, and the salt its block hashes
        are chained with."""
        req = self.engine.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING or request_id in self.detached:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not running here")
        full = 0 if self.carries_state else min(req.num_computed_tokens, req.num_tokens - 1) // self.engine.config.block_size
        return list(self._bm.block_ids(request_id)[:full]), list(req.all_token_ids), req.cache_salt

    def holds_blocks(self, request_id: str, block_ids: list[int]) -> bool:
        """Whether the request still runs on exactly ``block_ids`` first (no preemption since ``full_blocks``:
        what was copied from them meanwhile is its KV)."""
        req = self.engine.requests.get(request_id)
        return (req is not None and req.status == RequestStatus.RUNNING
                and self._bm.block_ids(request_id)[:len(block_ids)] == block_ids)

    def reattach(self, request_id: str) -> None:
        """Put a detached request back into the batch as it was (the migration did not happen)."""
        req = self.detached.pop(request_id, None)
        if req is None or self.engine.requests.get(request_id) is not req:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not detached here")
        self.engine.scheduler.join_running(req)

    def drop_detached(self, request_id: str) -> None:
        """Forget a detached request that now runs elsewhere and free its blocks (hashed ones stay cached)."""
        req = self.detached.pop(request_id, None)
        if req is not None:
            self._bm.free(request_id)
            self.engine.forget(req, "migrated")

    def check_import(self, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams,
                     shape: list[int], dtype: str, model_fingerprint: str, generator_state: bytes = b"",
                     first_block: int = 0) -> None:
        """Raise unless a request of ``prompt_token_ids`` + ``output_token_ids`` (the KV of all but the newest
        token, from block ``first_block`` on, in a payload of ``shape`` / ``dtype``, computed by the build
        ``model_fingerprint``) can be imported here. Allocates and reads nothing."""
        engine, bs = self.engine, self.engine.config.block_size
        self.check_model(model_fingerprint, "the KV hand-off")
        engine.validate(prompt_token_ids, params)
        vocab = engine.model.config.vocab_size
        if not output_token_ids or len(output_token_ids) > params.max_tokens:
            raise invalid(f"{len(output_token_ids)} output tokens for max_tokens {params.max_tokens}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in output_token_ids):
            raise invalid(f"output token ids (a hand-off's first_token) must be in [0, {vocab})")
        if len(generator_state) > MAX_GENERATOR_STATE_BYTES or (generator_state and params.seed is None):
            raise invalid(f"a generator state needs a seeded request and at most {MAX_GENERATOR_STATE_BYTES} bytes")
        with_kv = len(prompt_token_ids) + len(output_token_ids) - 1
        if not 0 <= first_block <= (0 if self.carries_state else with_kv // bs):
            raise invalid(f"first_block {first_block} is not a full block of {with_kv} tokens")
        want = [self._payload_blocks(with_kv) - first_block, *self.block_shape]
        if list(shape) != want or dtype != self.dtype_name:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"KV payload {list(shape)} {dtype} does not match this "
                                 f"engine's {want} {self.dtype_name} for {with_kv} tokens")

    def import_running(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                       params: SamplingParams, kv: torch.Tensor, cache_salt: str = "", hold_kv: bool = False, *,
                       model_fingerprint: str, generator_state: bytes = b"", first_block: int = 0,
                       has_window: list[bool] | None = None) -> bool:
        """Admit a request that ran elsewhere: True if its KV was used, False if it was queued for local recompute
        (no room). ``kv: [ceil((len(prompt) + len(outputs) - 1) / block_size) - first_block, L, 2, kvh, bs, D]``:
        the blocks before ``first_block`` must be in this engine's prefix cache (pre-copied), else
        ``transfer_failed`` and nothing changes. ``has_window`` (per payload block, from its packed form): a
        layout that cannot take partial blocks recomputes instead (its prefix cache would serve them whole)."""
        engine, bm, bs = self.engine, self._bm, self.engine.config.block_size
        if request_id in engine.requests:
            raise invalid(f"duplicate request id {request_id!r}")
        self.check_import(prompt_token_ids, output_token_ids, params, list(kv.shape),
                          str(kv.dtype).removeprefix("torch."), model_fingerprint, generator_state, first_block)
        req = engine.new_request(request_id, prompt_token_ids, params, cache_salt)
        req.hold_kv = hold_kv
        if generator_state:
            try:
                req.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
            except RuntimeError as err:
                raise invalid(f"bad generator state: {err}") from None
        req.stats.first_token_time = req.stats.arrival_time
        for token in output_token_ids:   # the engine's own rule (LLMEngine._append_one): stop tokens are not fed
            req.append_token(token)
            req.stats.token_times.append(req.stats.arrival_time)
            if req.detokenizer is not None and not engine.is_stop_token(token, params):
                req.output_text += req.detokenizer.feed(token)
        with_kv = req.num_tokens - 1
        if self.carries_state:
            engine.requests[request_id] = req
            if engine.scheduler.has_seat() and bm.adopt(req, kv, with_kv):
                self._run_imported(req, with_kv, 0)
                return True
            engine.scheduler.add(req)   # no room: recomputed here
            return False
        hits, _ = bm.get_computed_blocks(req, q0=with_kv)  # window blocks: only what its next query will see
        if len(hits) < first_block:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"{first_block} pre-copied blocks expected in the prefix "
                                 f"cache, {len(hits)} found (evicted since)")
        engine.requests[request_id] = req
        sched, new_ids = engine.scheduler, None
        if bm.accepts(has_window) and sched.has_seat():
            new_ids = bm.allocate_slots(req, with_kv - len(hits) * bs, hits, q0=with_kv)
        if new_ids is None:
            sched.add(req)  # recompute locally when there is room; exact, just slower
            return False
        self.write(request_id, len(hits), kv[len(hits) - first_block:])  # the payload's blocks this cache lacks
        self._run_imported(req, with_kv, len(hits) * bs)
        return True

    def _run_imported(self, req: Request, with_kv: int, cached_tokens: int) -> None:
        """Join an imported request to the batch with the KV of ``with_kv`` tokens in place."""
        req.num_computed_tokens = with_kv
        req.status = RequestStatus.RUNNING
        req.stats.first_scheduled_time = time.perf_counter()
        req.stats.num_cached_tokens = cached_tokens
        self.engine.scheduler.join_running(req)
