"""A request's state inside the engine.

One rule drives scheduling (vLLM v1): ``num_computed_tokens`` counts the tokens of ``all_token_ids`` whose
KV is in the cache. Chunked prefill, prefix hits, decode and recompute after preemption are all "advance
``num_computed_tokens`` towards ``num_tokens``". A sample is drawn exactly when a step brings
``num_computed_tokens`` up to ``num_tokens``.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.logprobs import Logprobs
from shared.sampling import SamplingParams
from shared.kv.block_hash import block_key, chain_digests


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestStats:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    num_spec_steps: int = 0  # speculative decoding: verified proposals, drafted tokens verified, accepted
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "params", "cache_salt", "model_fingerprint", "block_size",
                 "all_token_ids", "num_computed_tokens", "status", "finish_reason", "block_hashes", "block_digests",
                 "stats", "generator", "output_text", "detokenizer", "hold_kv", "window_pin", "spec_token_ids",
                 "spec_features", "prompt_logprobs", "matcher", "matcher_tokens", "reimport",
                 "resume_wait_s", "resume_wanted_at")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 block_size: int, model_fingerprint: str, cache_salt: str = "") -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt, self.model_fingerprint, self.block_size = cache_salt, model_fingerprint, block_size
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.block_digests: list[bytes] = []  # chained digests of the full blocks (shared/kv/block_hash.py)
        self.block_hashes: list[int] = []  # their 64-bit keys, what the caches index
        self.stats = RequestStats(arrival_time=time.perf_counter())
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.output_text = ""
        self.detokenizer = None  # set by the engine when stop strings or text output are needed
        self.hold_kv = False  # keep blocks after finishing until released (prefill → decode hand-off)
        self.window_pin: int | None = None  # SWA-aware KV keeps the window its prefill left (hybrid_kv.py)
        # blocks computed elsewhere (a tier pull) published again before each admission attempt (Scheduler)
        self.reimport: Callable[[], object] | None = None
        # a preempted request whose KV was offered to the cache tier awaits it (shared/engine/preempted_kv.py):
        # for at most resume_wait_s from resume_wanted_at (the time the scheduler wanted to admit it)
        self.resume_wait_s = 0.0
        self.resume_wanted_at = 0.0
        self.spec_token_ids: list[int] = []  # drafted tokens verified this step (after all_token_ids)
        self.spec_features: list = []  # their TokenFeatures (acceptance log)
        # Sampling.prompt_logprobs: entries of prompt tokens 1.. scored so far (filled by the prefill chunks)
        self.prompt_logprobs: Logprobs | None = None if params.prompt_logprobs is None else Logprobs()
        self.matcher = None      # Sampling.structured: its grammar's state (shared/engine/grammar.py)
        self.matcher_tokens = 0  # output tokens the matcher has consumed
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend ``block_digests`` and ``block_hashes`` (new lists) to cover every full block of
        ``all_token_ids``."""
        self.block_digests = chain_digests(self.all_token_ids, self.block_size, self.model_fingerprint,
                                           self.cache_salt, self.block_digests)
        if len(self.block_hashes) < len(self.block_digests):
            self.block_hashes = self.block_hashes + [block_key(d) for d in self.block_digests[len(self.block_hashes):]]
