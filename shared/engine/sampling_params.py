"""Per-request sampling parameters, validated on construction (bad values raise ``invalid_request``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling_rules import check_sampling

GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k <= 0`` disables top-k;
    ``top_p == 1`` disables top-p.

    ``seed`` makes sampling reproducible per request regardless of batching. ``stop`` strings end the
    output *before* the stop string (it is not in the text; the token that completed it is the last of the
    token ids). A stop token (EOS, unless ``ignore_eos``, or one of ``stop_token_ids``) ends the output
    *with* it: it is the last returned token id, and contributes no text (vLLM's token/text split).
    Rules: ``shared/sampling_rules.py``. ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before that
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
    speculative: bool | None = None  # speculative decoding for this request; None = the engine's default

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check_sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                       top_p=self.top_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                       min_tokens=self.min_tokens)

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` sample greedily (as vLLM does): dividing logits by a
        subnormal temperature overflows to inf and would poison the whole batch's sampling."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
