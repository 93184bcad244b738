"""Per-request sampling parameters, validated on construction (bad values raise ``invalid_request``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import invalid

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k; ``top_p == 1`` disables top-p.

    ``seed`` makes sampling reproducible per request regardless of batching. ``stop`` strings end the
    output *before* the stop string (it is not returned); ``stop_token_ids`` end it after the token (not
    returned either, like EOS). ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before that
    many tokens were generated (their logits are masked, like vLLM's ``min_tokens`` and HF's
    ``min_new_tokens``); ``ignore_eos`` instead keeps generating after an EOS that was sampled.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise invalid(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise invalid(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise invalid(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise invalid(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise invalid(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise invalid(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                          f"{MAX_STOP_STRING_LEN} characters")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise invalid("stop_token_ids must be non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
