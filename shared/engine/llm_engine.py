"""The single-process engine: the reference every disaggregated deployment must match token for token.

``add_request`` validates and queues; ``step`` schedules one batch, runs it, samples, applies stop rules
and returns incremental ``RequestOutput``s. Bad input raises ``DeepinferError`` at ``add_request`` and never
disturbs requests already running.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from shared.engine import kv_handoff, kv_io, kv_tier, migration
from shared.engine.config import EngineConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import RequestOutput
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.kv.block_hash import BlockChain
from shared.model.fingerprint import model_fingerprint
from shared.model.llama import LlamaModel

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig, tokenizer=None) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.block_manager = kv_io.build_block_manager(model, config, self.max_model_len)  # 1 pool or 2 KV groups
        num_blocks = self.block_manager.num_blocks
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(model, self.block_manager)
        if config.decode_graphs == "eager" or (config.decode_graphs == "auto" and model.device.type == "cuda"):
            self.runner.use_decode_graphs(max_blocks=-(-self.max_model_len // config.block_size),
                                          max_batch=min(config.decode_graph_max_batch, config.max_num_seqs),
                                          capture=config.decode_graphs == "auto")
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(mc.eos_token_ids)
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.held: dict[str, Request] = {}  # finished hold_kv requests whose blocks are still allocated
        self.detached: dict[str, Request] = {}  # running requests taken out of the batch to migrate (migration.py)
        self.speculator = None  # shared/engine/speculator.Speculator: speculative decoding when set
        # what determines this engine's KV (shared/model/fingerprint.py): in every block hash and hand-off
        self.fingerprint = model_fingerprint(model, tokenizer, config.block_size)
        logger.info("engine ready: model=%s fingerprint=%s device=%s dtype=%s kv_blocks=%d window_kv_blocks=%s "
                    "block_size=%d max_model_len=%d", mc.model_id, self.fingerprint, model.device, model.dtype,
                    num_blocks, getattr(self.block_manager, "num_window_blocks", None), config.block_size,
                    self.max_model_len)

    @classmethod
    def from_path(cls, path=None, config: EngineConfig | None = None, progress=None) -> "LLMEngine":
        """Load a GGUF file or HF folder (``None``: the default SmolLM2) and build an engine."""
        from shared.model.loader import load_model_files

        config = config or EngineConfig()
        torch.set_num_threads(config.resolve_threads())  # process-wide: one engine per process
        model_config, weights, tokenizer = load_model_files(path, progress=progress)
        device = config.resolve_device()
        model = LlamaModel(model_config, weights, config.resolve_dtype(device), device)
        return cls(model, config, tokenizer)

    # -- request API -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``DeepinferError`` if the request can never be served by this engine."""
        if not prompt_token_ids:
            raise invalid("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise invalid(f"prompt token ids must be integers in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise invalid(f"stop_token_ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len:
            raise DeepinferError(ErrorCode.PROMPT_TOO_LONG, f"prompt has {len(prompt_token_ids)} tokens; "
                                 f"the context window is {self.max_model_len}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if min(total, self.max_model_len) > capacity:
            raise DeepinferError(ErrorCode.PROMPT_TOO_LONG, f"prompt + max_tokens = {total} tokens exceeds "
                                 f"the KV cache capacity of {capacity} tokens")
        if not kv_io.window_fits(self, min(total, self.max_model_len)):
            raise DeepinferError(ErrorCode.PROMPT_TOO_LONG, f"prompt + max_tokens = {total} tokens cannot run in "
                                 f"the sliding-window KV pool of {self.block_manager.num_window_blocks} blocks "
                                 "(one prefill chunk and its window must fit: a larger KV budget or a smaller "
                                 "max_num_batched_tokens)")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str = "", hold_kv: bool = False, continues: bool = False,
                    pin_prompt_window: bool = False) -> str:
        """Queue a request. ``hold_kv``: keep its KV blocks after it finishes (see ``release_held``).
        ``continues``: its length stop is not the stream's end (a prefill worker's first token; the decode
        worker goes on), so text held back for an incomplete UTF-8 character is not flushed as U+FFFD.
        ``pin_prompt_window``: with SWA-aware KV, keep the window rows the prompt's prefill left until the caller
        lifts it (``Request.window_pin``; ``HybridBlockManager.pinned``), for a copy of the prompt to the tier."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise invalid(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, prompt_token_ids, params, block_size=self.config.block_size,
                      model_fingerprint=self.fingerprint, cache_salt=cache_salt)
        if self.tokenizer is not None:
            req.detokenizer = self.tokenizer.incremental_decoder()
        req.hold_kv, req.flush_text = hold_kv, not continues
        if pin_prompt_window and self.has_kv_groups:
            req.window_pin = 0       # follows the prefill chunks (HybridBlockManager.allocate_slots)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished ``hold_kv`` request (idempotent); hashed ones stay cached."""
        if self.held.pop(request_id, None) is not None:
            self.block_manager.free(request_id)

    # -- KV hand-off (prefill worker -> decode worker; see shared/engine/kv_handoff.py) ---------------
    @property
    def kv_cache(self) -> torch.Tensor:
        """The paged KV cache ``[num_blocks, L, 2, kvh, block_size, D]`` (blocks named by block ids); with KV
        groups the full group's pool (its device and dtype are the engine's; stage blocks via ``kv_source``)."""
        kv = self.runner.kv_cache
        return kv if isinstance(kv, torch.Tensor) else kv.full

    @property
    def kv_block_shape(self) -> list[int]:
        """The wire shape of one logical block: ``[L, 2, kvh, block_size, D]``."""
        return kv_io.block_shape(self)

    @property
    def kv_block_bytes(self) -> int:
        return kv_io.block_bytes(self)

    def kv_source(self, request_id: str, block_ids: list[int],
                  next_query: int | None = None) -> tuple[torch.Tensor, list[int], bytes]:
        """``(cache, rows, window_mask)`` to stage the request's ``block_ids`` from (engine thread; see
        ``kv_io.source``)."""
        return kv_io.source(self, request_id, block_ids, next_query)

    @property
    def has_kv_groups(self) -> bool:
        """KV in two pools (SWA-aware): staging needs a gathered copy (``kv_source``), made on the engine thread;
        without groups the held blocks are staged straight from the cache, from any thread."""
        return not isinstance(self.runner.kv_cache, torch.Tensor)

    def prompt_block_ids(self, request_id: str) -> list[int]:
        return kv_handoff.prompt_block_ids(self, request_id)

    def check_model(self, model_fingerprint: str, what: str, allow_any: bool = False) -> None:
        return kv_handoff.check_model(self, model_fingerprint, what, allow_any)

    def check_handoff(self, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                      shape: list[int], dtype: str, *, model_fingerprint: str) -> None:
        kv_handoff.check_handoff(self, prompt_token_ids, first_token, params, shape, dtype, model_fingerprint)

    def import_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                         params: SamplingParams, kv: torch.Tensor, cache_salt: str = "",
                         hold_kv: bool = False, *, model_fingerprint: str) -> bool:
        return kv_handoff.import_prefilled(self, request_id, prompt_token_ids, first_token, params, kv, cache_salt,
                                           hold_kv, model_fingerprint=model_fingerprint)

    # -- live migration (running request -> another decode worker; see shared/engine/migration.py) ------
    def detach(self, request_id: str) -> migration.Detached:
        return migration.detach(self, request_id)

    def full_blocks(self, request_id: str) -> tuple[list[int], list[int], str]:
        return migration.full_blocks(self, request_id)

    def holds_blocks(self, request_id: str, block_ids: list[int]) -> bool:
        return migration.holds_blocks(self, request_id, block_ids)

    def reattach(self, request_id: str) -> None:
        migration.reattach(self, request_id)

    def drop_detached(self, request_id: str) -> None:
        migration.drop_detached(self, request_id)

    def import_running(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                       params: SamplingParams, kv: torch.Tensor, cache_salt: str = "", hold_kv: bool = False, *,
                       model_fingerprint: str, generator_state: bytes = b"", first_block: int = 0,
                       has_window: list[bool] | None = None) -> bool:
        return migration.import_running(self, request_id, prompt_token_ids, output_token_ids, params, kv, cache_salt,
                                        hold_kv, model_fingerprint=model_fingerprint, generator_state=generator_state,
                                        first_block=first_block, has_window=has_window)

    # -- cache tier (see shared/engine/kv_tier.py) ------------------------------------------------------
    def missing_blocks(self, prompt_token_ids: list[int], cache_salt: str = "") -> tuple[int, BlockChain]:
        return kv_tier.missing_blocks(self, prompt_token_ids, cache_salt)

    def import_tier_blocks(self, prompt_token_ids: list[int], cache_salt: str, first: int, kv: torch.Tensor,
                           has_window: list[bool] | None = None) -> int:
        return kv_tier.import_tier_blocks(self, prompt_token_ids, cache_salt, first, kv, has_window)

    def tier_blocks(self, request_id: str, first: int = 0,
                    running: bool = False) -> tuple[list[int], BlockChain, list[int]]:
        return kv_tier.tier_blocks(self, request_id, first, running)

    def set_kv_event_sink(self, sink) -> None:
        """``sink(kind, hashes)`` hears every prefix-cache change (set before stepping starts)."""
        self.block_manager.event_sink = sink

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (a KV-event snapshot)."""
        return list(self.block_manager.cached)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.detached.pop(request_id, None)
        self.scheduler.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        if self.speculator is not None:
            self.speculator.finished(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------------------------
    def set_speculator(self, speculator) -> None:
        """Turn speculative decoding on (a ``Speculator``) or off (None); set before stepping starts."""
        if speculator is not None and speculator.max_model_len is None:
            speculator.max_model_len = self.max_model_len
        self.speculator = speculator

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        try:
            sampled = self.runner.execute(sched)
        except Exception:  # a bug or device failure: fail this batch, keep the engine alive
            logger.exception("step failed; failing %d requests", len(sched.scheduled))
            self.block_manager.reset_prefix_cache()
            return [self._finish(s.request, "error") for s in sched.scheduled]
        now = time.perf_counter()
        outputs, verified = [], False
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            drafted = len(req.spec_token_ids)
            if req.request_id in sampled:
                tokens = sampled[req.request_id]
                if drafted:  # rejected drafts: their KV is void and their blocks go back
                    verified = True
                    req.num_computed_tokens -= drafted - (len(tokens) - 1)
                    self.speculator.verified(req, drafted, len(tokens) - 1)
                    self.block_manager.trim(req.request_id, req.num_computed_tokens)
                req.spec_token_ids, req.spec_features = [], []
                outputs.append(self._append(req, tokens, now))
        if verified:
            self.speculator.counters.steps += 1
        return outputs

    def _append(self, req: Request, tokens: list[int], now: float) -> RequestOutput:
        """Append this step's tokens (one, or accepted drafts + one) until a stop rule ends the request."""
        text = ""
        for i, token in enumerate(tokens):
            piece, reason = self._append_one(req, token, now)
            text += piece
            if len(tokens) > 1 and (reason is not None or i == len(tokens) - 1):
                # as plain decoding would have: blocks whose tokens all have KV, the newest token excluded
                self.block_manager.publish_computed(req, min(req.num_computed_tokens, req.num_tokens - 1))
            if reason is not None:
                if req.detokenizer is not None and reason == "length" and req.flush_text:
                    text += req.detokenizer.flush()  # bytes held back waiting for a UTF-8 continuation
                return self._finish(req, reason, tokens[:i + 1], text)
        return RequestOutput(req.request_id, list(tokens), text, False)

    def _append_one(self, req: Request, token: int, now: float) -> tuple[str, str | None]:
        """Append one token; ``(its text, finish reason or None)``."""
        req.append_token(token)
        if req.stats.first_token_time is None:
            req.stats.first_token_time = now
        req.stats.token_times.append(now)
        params, text, reason = req.params, "", None
        is_stop_token = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        if req.detokenizer is not None and not is_stop_token:
            text = req.detokenizer.feed(token)
            if params.stop:
                text, reason = self._apply_stop_strings(req, text)
            req.output_text += text
        if is_stop_token:
            reason = "stop"
        elif reason is None and (req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        return text, reason

    @staticmethod
    def _apply_stop_strings(req: Request, text: str) -> tuple[str, str | None]:
        """Cut ``text`` before the first stop string completed by it; stop strings may straddle steps."""
        longest = max(len(s) for s in req.params.stop)
        tail_start = max(0, len(req.output_text) - longest + 1)
        window = req.output_text[tail_start:] + text
        cut = min((i for i in (window.find(s) for s in req.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return text, None
        keep = cut - (len(req.output_text) - tail_start)  # may be negative: stop began in earlier text
        if keep < 0:  # already emitted text cannot be recalled; end here
            return "", "stop"
        return text[:keep], "stop"

    def _finish(self, req: Request, reason: str, tokens: list[int] | None = None, text: str = "") -> RequestOutput:
        hold = req.hold_kv and reason not in ("error", "abort")
        self.scheduler.remove(req, free_blocks=not hold)
        if hold:
            self.held[req.request_id] = req
        self.requests.pop(req.request_id, None)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if self.speculator is not None:
            self.speculator.finished(req.request_id)
        st = req.stats
        return RequestOutput(req.request_id, tokens or [], text, True, reason, req.num_prompt_tokens,
                             st.num_cached_tokens, req.num_output_tokens, st.ttft, st.tpot,
                             st.num_spec_steps, st.num_drafted, st.num_accepted)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; return each one's output token ids (in order)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]
