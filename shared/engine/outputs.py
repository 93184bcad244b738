"""What the engine reports back per request per step."""
from __future__ import annotations

from dataclasses import dataclass

from shared.logprobs import Logprobs


@dataclass(slots=True)
class RequestOutput:
    """Incremental: ``new_token_ids``/``new_text`` are what this step produced. On the final output
    ``finished`` is True, ``finish_reason`` is "stop" | "length" | "abort", and the usage fields are set.
    ``logprobs``: one entry per new token (``Sampling.logprobs``); ``prompt_logprobs``: on the first output only,
    one entry per prompt token after the first (``Sampling.prompt_logprobs``)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    num_spec_steps: int = 0  # speculative decoding: proposals verified, drafted tokens verified, accepted
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
