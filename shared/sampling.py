"""A request's sampling parameters: one type from the router's wire messages to the engine's sampler.

The router builds a ``Sampling`` (alias ``SamplingParams``) once from the client's request
(``GenerateRequest.sampling()``); it travels nested, unchanged, in every work message (prefill, hand-off,
migration) and each engine samples with the value it received. Its rules run on construction, so also on decode and on ``dataclasses.replace``: what one hop accepts
every hop accepts. Violations raise ``invalid_request`` naming the field. Adding a sampling field touches this
class, its rule in ``_check`` and the code that uses it.
"""
from __future__ import annotations

from shared import structured as output_specs
from shared.errors import invalid
from shared.wire_validation import WireModel, wire_field, wire_message

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_PRIORITY = 2**31 - 1
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024            # entries of logit_bias (OpenAI allows 300; vLLM sets no bound)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary
MAX_BAD_WORDS = 128              # bad_words strings, and bad_words_token_ids sequences
MAX_BAD_WORD_TOKENS = 64         # tokens of one bad word
MAX_LOGPROBS = 20                # top logprobs per position (OpenAI's bound)


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

    Logits processors, vLLM's semantics (``shared/engine/logits_processors.py`` applies them, batched, to the
    logits of every sampled position, drafted ones included; greedy decoding takes the argmax of the processed
    logits): ``allowed_token_ids`` (None: all) masks every other token; ``logit_bias`` (token id as a decimal
    string, OpenAI's form -> a bias in [-100, 100]) is added; ``repetition_penalty`` (> 0, 1 = off) divides a
    positive logit, multiplies a negative one, of every token in prompt + output (HF's and vLLM's rule);
    ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]) subtract ``f * count + p * (count > 0)``, count over
    the output tokens only. ``min_p`` (in [0, 1]) drops tokens whose probability after temperature is below
    ``min_p`` times the top token's. ``bad_words`` (vLLM's rule): each word is tokenized as written and with one
    leading space (the engine does it, with its tokenizer, into ``bad_words_token_ids``); a one-token word is
    never sampled, a longer one's last token is banned when the output ends with the rest of it. Their state is
    the token history itself, so it is exact wherever a stream moves (hand-off, failover, migration, resume).

    ``logprobs`` (None: off; 0..20) reports each generated token's log-probability and its position's top
    ``logprobs`` alternatives; ``prompt_logprobs`` the same for every prompt token after the first, on the first
    output (a request with it reuses no cached prefix: every prompt position is computed). Both are taken from
    the raw model distribution (``shared/logprobs.py``).

    ``structured`` (``shared/structured.py``): the output must match that JSON schema, regex, choice or grammar; the
    engine masks every sampled position, drafted ones included, with the grammar's state after the output so far.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict = wire_field(default_factory=dict)
    allowed_token_ids: list[int] | None = wire_field(default=None, max_len=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] = wire_field(default_factory=list, max_len=MAX_BAD_WORDS)
    bad_words_token_ids: list[list[int]] = wire_field(default_factory=list, max_len=2 * MAX_BAD_WORDS)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: dict | None = None
    seed: int | None = None
    stop: list[str] = wire_field(default_factory=list, max_len=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = wire_field(default_factory=list, max_len=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = 0
    speculative: bool | None = None
    prefill_only: bool = False
    priority: int = 0  # vLLM's: lower runs first where the engine's scheduling policy is ``priority``

    def _check(self) -> None:
        if self.max_tokens <= 0:
            raise invalid(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise invalid(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise invalid(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not 0 <= self.temperature < 1e6:   # NaN fails too
            raise invalid(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise invalid(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise invalid(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty <= 100:   # NaN fails too
            raise invalid(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        self._check_logit_bias()
        if self.allowed_token_ids is not None and (not self.allowed_token_ids
                                                   or any(t < 0 for t in self.allowed_token_ids)):
            raise invalid("allowed_token_ids must be a non-empty list of non-negative token ids (or absent)")
        if any(not w.strip() or len(w) > MAX_STOP_STRING_LEN for w in self.bad_words):
            raise invalid(f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings of at most "
                          f"{MAX_STOP_STRING_LEN} characters")
        if any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS or any(t < 0 for t in w) for w in self.bad_words_token_ids):
            raise invalid(f"bad_words_token_ids must be lists of 1 to {MAX_BAD_WORD_TOKENS} non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise invalid(f"{name} must be in [0, {MAX_LOGPROBS}] (or absent), got {value!r}")
        if self.structured is not None:
            output_specs.check(self.structured)
        if self.top_k < -1:
            raise invalid(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise invalid(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if any(not s or len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise invalid(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                          f"{MAX_STOP_STRING_LEN} characters")
        if any(t < 0 for t in self.stop_token_ids):
            raise invalid(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise invalid(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for key, bias in self.logit_bias.items():
            if not (isinstance(key, str) and key.isdecimal() and len(key) <= 9):
                raise invalid(f"logit_bias keys must be token ids (decimal strings), got {key!r:.40}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise invalid(f"logit_bias values must be numbers in [-100, 100], got {bias!r:.40} for {key}")

    @property
    def token_ids_named(self) -> list[int]:
        """Every token id the request names (stop tokens, biased and allowed ids): what ``validate`` bounds by the
        vocabulary."""
        return [*self.stop_token_ids, *map(int, self.logit_bias), *(self.allowed_token_ids or ()),
                *(t for word in self.bad_words_token_ids for t in word)]

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor is on (``shared/engine/logits_processors.py``); off, the sampler skips them."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.repetition_penalty != 1.0
                    or self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.bad_words_token_ids or self.bad_words)

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` sample greedily (as vLLM does): dividing logits by a
        subnormal temperature overflows to inf and would poison the whole batch's sampling."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


SamplingParams = Sampling   # the engine-side name (vLLM's); one type, registered on the wire as ``Sampling``
