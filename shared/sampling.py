"""A request's sampling parameters: one type from the router's wire messages to the engine's sampler.

The router builds a ``Sampling`` (alias ``SamplingParams``) once from the client's request
(``GenerateRequest.sampling()``); it travels nested, unchanged, in every work message (prefill, hand-off,
migration) and each engine samples with the value it received. Its rules run on construction, so also on decode and on ``dataclasses.replace``: what one hop accepts
every hop accepts. Violations raise ``invalid_request`` naming the field. Adding a sampling field touches this
class, its rule in ``_check`` and the code that uses it.
"""
from __future__ import annotations

from shared.errors import invalid
from shared.wire_validation import WireModel, wire_field, wire_message

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024


@wire_message(64 * 1024)
class Sampling(WireModel):
    """``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k <= 0`` disables top-k;
    ``top_p == 1`` disables top-p.

    ``seed`` makes sampling reproducible per request regardless of batching. ``stop`` strings end the output
    *before* the stop string (it is not in the text; the token that completed it is the last of the token ids). A
    stop token (EOS, unless ``ignore_eos``, or one of ``stop_token_ids``) ends the output *with* it: it is the
    last returned token id, and contributes no text (vLLM's token/text split). ``min_tokens``: EOS and
    ``stop_token_ids`` cannot be sampled before that many tokens were generated (their logits are masked, like
    vLLM's ``min_tokens`` and HF's ``min_new_tokens``); ``ignore_eos`` instead keeps generating after an EOS that
    was sampled. ``speculative``: speculative decoding for this request (None: the decode worker's default).
    ``prefill_only``: the engine stops after the first token with the KV held for a hand-off, finish reason
    ``prefilled`` unless a stop rule of the whole request ended it there; ``max_tokens`` stays the request's own.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = wire_field(default_factory=list, max_len=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = wire_field(default_factory=list, max_len=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = 0
    speculative: bool | None = None
    prefill_only: bool = False

    def _check(self) -> None:
        if self.max_tokens <= 0:
            raise invalid(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise invalid(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not 0 <= self.temperature < 1e6:   # NaN fails too
            raise invalid(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise invalid(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise invalid(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if any(not s or len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise invalid(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                          f"{MAX_STOP_STRING_LEN} characters")
        if any(t < 0 for t in self.stop_token_ids):
            raise invalid(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` sample greedily (as vLLM does): dividing logits by a
        subnormal temperature overflows to inf and would poison the whole batch's sampling."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


SamplingParams = Sampling   # the engine-side name (vLLM's); one type, registered on the wire as ``Sampling``
