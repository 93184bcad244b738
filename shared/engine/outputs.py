"""What the engine reports back per request per step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    """Incremental: ``new_token_ids``/``new_text`` are what this step produced. On the final output
    ``finished`` is True, ``finish_reason`` is "stop" | "length" | "abort", and the usage fields are set."""

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
