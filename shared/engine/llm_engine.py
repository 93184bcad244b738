"""The single-process engine: the reference every disaggregated deployment must match token for token.

``add_request`` validates and queues; ``step`` schedules one batch, runs it, samples, applies stop rules
and returns incremental ``RequestOutput``s. Bad input raises ``DeepinferError`` at ``add_request`` and never
disturbs requests already running.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable

import torch

from shared.engine.config import EngineConfig
from shared.engine.hybrid_kv import build_kv_manager
from shared.engine.kv_manager import KVManager
from shared.engine.grammar import Grammars
from shared.engine.kv_port import KVPort
from shared.engine.logits_processors import tokenize_bad_words
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import RequestOutput
from shared.engine.request import Request, RequestStatus
from shared.sampling import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.logprobs import MAX_PROMPT_LOGPROB_ENTRIES, Logprobs
from shared.model import kv_cache
from shared.model.fingerprint import model_fingerprint
from shared.model.llama import LlamaModel

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig, tokenizer=None) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.block_manager: KVManager = build_kv_manager(model, config, self.max_model_len)  # 1 pool or KV groups
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.scheduling_policy)
        self.grammars = Grammars(tokenizer, mc.vocab_size, mc.eos_token_ids) if tokenizer is not None else None
        self.runner = ModelRunner(model, self.block_manager, self.grammars)
        paged = self.runner.kv_cache is not None   # else per-sequence states (DeepSeek V4): no graphs
        if paged and (config.decode_graphs == "eager" or (config.decode_graphs == "auto"
                                                           and model.device.type == "cuda")):
            self.runner.use_decode_graphs(max_blocks=-(-self.max_model_len // config.block_size),
                                          max_batch=min(config.decode_graph_max_batch, config.max_num_seqs),
                                          capture=config.decode_graphs == "auto")
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(mc.eos_token_ids)
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.kv_port = KVPort(self)  # KV crossing the engine: hand-off, migration, cache tier
        self.scheduler.preempted_kv = self.kv_port.preempted
        self.speculator = None  # shared/engine/speculator.Speculator: speculative decoding when set
        # what determines this engine's KV (shared/model/fingerprint.py): in every block hash and hand-off
        self.fingerprint = model_fingerprint(model, tokenizer, config.block_size)
        logger.info("engine ready: model=%s fingerprint=%s device=%s dtype=%s kv_pools=%s block_size=%d "
                    "max_model_len=%d", mc.model_id, self.fingerprint, model.device, model.dtype,
                    self.block_manager.pool_sizes, config.block_size, self.max_model_len)

    @classmethod
    def from_path(cls, path=None, config: EngineConfig | None = None, progress=None) -> "LLMEngine":
        """Load a GGUF file or HF folder (``None``: the default SmolLM2) and build an engine."""
        from shared.model.loader import build_model, load_model_files

        config = config or EngineConfig()
        torch.set_num_threads(config.resolve_threads())  # process-wide: one engine per process
        model_config, weights, tokenizer = load_model_files(path, progress=progress)
        if config.rope_scaling is not None:
            from shared.model.config import with_rope_scaling

            model_config = with_rope_scaling(model_config, config.rope_scaling)
            logger.info("RoPE scaling overridden: %s (context %d)", model_config.rope_scaling,
                        model_config.max_position_embeddings)
        device = config.resolve_device()
        model = build_model(model_config, weights, config.resolve_dtype(device), device)
        return cls(model, config, tokenizer)

    # -- request API -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``DeepinferError`` if the request can never be served by this engine."""
        if not prompt_token_ids:
            raise invalid("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise invalid(f"prompt token ids must be integers in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.token_ids_named):
            raise invalid(f"token ids in stop_token_ids, logit_bias and allowed_token_ids must be in [0, {vocab})")
        if params.structured is not None and self.grammars is None:
            raise invalid("structured outputs need the model's tokenizer; this engine has none")
        if params.prompt_logprobs is not None and len(prompt_token_ids) * (1 + params.prompt_logprobs) > \
                MAX_PROMPT_LOGPROB_ENTRIES:
            raise invalid(f"prompt_logprobs: {len(prompt_token_ids)} prompt tokens x {1 + params.prompt_logprobs} "
                          f"entries exceed {MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer top logprobs or a shorter "
                          "prompt")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len:
            raise DeepinferError(ErrorCode.PROMPT_TOO_LONG, f"prompt has {len(prompt_token_ids)} tokens; "
                                 f"the context window is {self.max_model_len}")
        reason = self.block_manager.refuse(min(total, self.max_model_len))
        if reason is not None:
            raise DeepinferError(ErrorCode.PROMPT_TOO_LONG, f"prompt + max_tokens = {total} tokens {reason}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str = "", hold_kv: bool = False, pin_prompt_window: bool = False,
                    prior_output_ids: list[int] = (), reimport: Callable[[], object] | None = None) -> str:
        """Queue a request. ``hold_kv``: keep its KV blocks after it finishes (see ``KVPort.release_held``).
        ``pin_prompt_window``: with SWA-aware KV, keep the window rows the prompt's prefill left until the caller
        lifts it (``Request.window_pin``; ``HybridBlockManager.pinned``), for a copy of the prompt to the tier.
        ``prior_output_ids``: a continuation's delivered tokens (failover, resume): computed with the prompt, as a
        recompute after preemption would, and counted as output by every stop rule and logits processor.
        ``reimport``: publishes blocks computed elsewhere (a tier pull, already imported once) again; the scheduler
        calls it before each admission attempt until the request is admitted (``Scheduler``)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise invalid(f"duplicate request id {request_id!r}")
        params = self.resolve(params)
        self.validate([*prompt_token_ids, *prior_output_ids], params)
        if len(prior_output_ids) >= params.max_tokens:
            raise invalid(f"{len(prior_output_ids)} prior output tokens leave none of max_tokens {params.max_tokens}")
        req = self.new_request(request_id, prompt_token_ids, params, cache_salt)
        for token in prior_output_ids:   # as KVPort.import_running: stop tokens are not fed to the detokenizer
            req.append_token(token)
            if req.detokenizer is not None and not self.is_stop_token(token, params):
                req.output_text += req.detokenizer.feed(token)
        req.hold_kv = hold_kv
        req.reimport = reimport
        if pin_prompt_window and not self.kv_port.stages_in_place:
            req.window_pin = 0       # follows the prefill chunks (HybridBlockManager.allocate_slots)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str = "") -> Request:
        """A request object of this engine (its block size, fingerprint and detokenizer); not queued."""
        req = Request(request_id, prompt_token_ids, self.resolve(params), block_size=self.config.block_size,
                      model_fingerprint=self.fingerprint, cache_salt=cache_salt)
        if self.tokenizer is not None:
            req.detokenizer = self.tokenizer.incremental_decoder()
        return req

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` tokenized into ``bad_words_token_ids`` by this engine's tokenizer
        (``logits_processors.tokenize_bad_words``); idempotent, so every hop may call it."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise invalid("bad_words needs the model's tokenizer; this engine has none (send bad_words_token_ids)")
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        words = [*params.bad_words_token_ids, *tokenize_bad_words(params.bad_words, encode)]
        unique = list(dict.fromkeys(map(tuple, words)))
        return dataclasses.replace(params, bad_words=[], bad_words_token_ids=[list(w) for w in unique])

    def is_stop_token(self, token: int, params: SamplingParams) -> bool:
        """The stop-token rule: an EOS token (unless ``ignore_eos``) or one of ``stop_token_ids``; a stop token
        ends the request and is never fed to the detokenizer."""
        return (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids

    def set_kv_event_sink(self, sink) -> None:
        """``sink(kind, hashes)`` hears every prefix-cache change (set before stepping starts)."""
        self.block_manager.event_sink = sink

    def kv_pools(self) -> list[dict[str, int | str]]:
        """The KV budget's split: per pool its ``name``, ``blocks``, ``free`` blocks and ``block_bytes``
        (``KVManager.pools``; ``/metrics`` and ``deepinfer status`` show it)."""
        kv = self.runner.kv_cache
        sizes = kv_cache.pool_block_bytes(kv) if kv is not None else [self.kv_port.block_bytes]
        return [{"name": name, "blocks": blocks, "free": free, "block_bytes": nbytes}
                for (name, blocks, free), nbytes in zip(self.block_manager.pools(), sizes)]

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (a KV-event snapshot)."""
        return list(self.block_manager.cached)

    def forget(self, req: Request, reason: str) -> None:
        """Mark a request finished with ``reason`` and drop it from the engine (its blocks are the caller's)."""
        self.requests.pop(req.request_id, None)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if self.speculator is not None:
            self.speculator.finished(req.request_id)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.kv_port.detached.pop(request_id, None)
        self.scheduler.remove(req)
        self.forget(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------------------------
    def set_speculator(self, speculator) -> None:
        """Turn speculative decoding on (a ``Speculator``) or off (None); set before stepping starts. A drafter
        that reads the target's hidden states (``observe``: the MTP drafter) has the model keep them."""
        if speculator is not None and speculator.max_model_len is None:
            speculator.max_model_len = self.max_model_len
        self.speculator = speculator
        if hasattr(self.model, "keep_hidden"):
            self.model.keep_hidden = speculator is not None and speculator.observes

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
            if sampled.hidden is not None and self.speculator is not None:
                start, rows = sampled.hidden[req.request_id]   # the rows of the tokens that stand:
                valid = s.num_new_tokens                        # rejected drafts' are void
                if drafted and req.request_id in sampled.tokens:
                    valid -= drafted - (len(sampled.tokens[req.request_id]) - 1)
                self.speculator.observe(req.request_id, start, rows[:valid])
            if req.request_id in sampled.tokens:
                tokens = sampled.tokens[req.request_id]
                if drafted:  # rejected drafts: their KV is void and their blocks go back
                    verified = True
                    req.num_computed_tokens -= drafted - (len(tokens) - 1)
                    self.speculator.verified(req, drafted, len(tokens) - 1)
                    self.block_manager.trim(req.request_id, req.num_computed_tokens)
                req.spec_token_ids, req.spec_features = [], []
                outputs.append(self._append(req, tokens, now, sampled.logprobs.get(req.request_id)))
        if verified:
            self.speculator.counters.steps += 1
        return outputs

    def _append(self, req: Request, tokens: list[int], now: float, logprobs: Logprobs | None) -> RequestOutput:
        """Append this step's tokens (one, or accepted drafts + one) until a stop rule ends the request; the
        request's first output carries its prompt logprobs."""
        text = ""
        prompt_logprobs = req.prompt_logprobs if req.num_output_tokens == 0 else None
        for i, token in enumerate(tokens):
            piece, reason = self._append_one(req, token, now)
            text += piece
            if len(tokens) > 1 and (reason is not None or i == len(tokens) - 1):
                # as plain decoding would have: blocks whose tokens all have KV, the newest token excluded
                self.block_manager.publish_computed(req, min(req.num_computed_tokens, req.num_tokens - 1))
            if reason is not None:
                if req.detokenizer is not None and reason == "length":
                    text += req.detokenizer.flush()  # bytes held back waiting for a UTF-8 continuation
                # "prefilled" flushes nothing: the stream goes on in the decode worker, which gets the same bytes
                out = self._finish(req, reason, tokens[:i + 1], text)
                out.logprobs, out.prompt_logprobs = logprobs and logprobs.head(i + 1), prompt_logprobs
                return out
        return RequestOutput(req.request_id, list(tokens), text, False, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs)

    def _append_one(self, req: Request, token: int, now: float) -> tuple[str, str | None]:
        """Append one token; ``(its text, finish reason or None)``."""
        req.append_token(token)
        if req.stats.first_token_time is None:
            req.stats.first_token_time = now
        req.stats.token_times.append(now)
        params, text, reason = req.params, "", None
        is_stop_token = self.is_stop_token(token, params)
        if req.detokenizer is not None and not is_stop_token:
            text = req.detokenizer.feed(token)
            if params.stop:
                text, reason = self._apply_stop_strings(req, text)
            req.output_text += text
        if is_stop_token:
            reason = "stop"
        elif reason is None and (req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        elif reason is None and params.prefill_only:
            reason = "prefilled"   # the first token; the request goes on elsewhere from its held KV
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
            self.kv_port.hold(req)
        self.forget(req, reason)
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
