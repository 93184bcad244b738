"""Token masks of structured outputs (``shared/structured.py``) inside one engine: an llguidance matcher per
request, and the rows of allowed tokens the sampler applies.

Invariants:
- a matcher's state is the request's output tokens replayed: ``_sync`` consumes whatever was appended since it
  last looked, and a request new to this engine (a hand-off, failover, migration or resume) gets a fresh matcher
  fed its delivered tokens, so where a stream moves its grammar state moves exactly;
- ``allowed(req, drafts)`` is ``[len(drafts) + 1, V]``: row ``i`` is the mask after the output plus ``drafts[:i]``
  (speculative verification checks every drafted position against the grammar; the matcher is rolled back, so
  only tokens the engine appends advance it). A draft the grammar refuses leaves the rows after it all-allowed:
  verification stops at the refused draft, which its own row masks out;
- a row never allows nothing: when the grammar has ended (or failed) only the stop tokens are allowed.
"""
from __future__ import annotations

import numpy as np
import torch

from shared import structured


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = [int(t) for t in eos_token_ids]
        self._lltokenizer = None

    @property
    def lltokenizer(self):
        """llguidance's view of the vocabulary (built once, ~0.3 s for 49K tokens)."""
        if self._lltokenizer is None:
            import llguidance
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=self._eos)
        return self._lltokenizer

    def _sync(self, req):
        """The request's matcher, fed every output token so far."""
        import llguidance
        output = req.output_token_ids
        if req.matcher is None:
            req.matcher = llguidance.LLMatcher(self.lltokenizer, structured.grammar_of(req.params.structured),
                                               log_level=0)
            req.matcher_tokens = 0
        if req.matcher_tokens < len(output):
            req.matcher.consume_tokens(output[req.matcher_tokens:])
            req.matcher_tokens = len(output)
        return req.matcher

    def _row(self, matcher) -> torch.Tensor:
        """``[V]`` bool: the tokens the matcher allows next (never none: else the stop tokens)."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        row = torch.from_numpy(bits[:self.vocab_size].astype(bool))
        if not row.any():
            row[self._eos] = True
        return row

    def allowed(self, req, drafts: list[int] = ()) -> torch.Tensor:
        """``[len(drafts) + 1, V]`` bool masks (see the module docstring)."""
        matcher = self._sync(req)
        rows = [self._row(matcher)]
        consumed = 0
        for token in drafts:
            if not rows[-1][token] or not matcher.consume_token(token):
                break
            consumed += 1
            rows.append(self._row(matcher))
        if consumed:
            matcher.rollback(consumed)
        rows += [torch.ones(self.vocab_size, dtype=torch.bool)] * (len(drafts) + 1 - len(rows))
        return torch.stack(rows)


def apply(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits: [R, V]`` with every disallowed token at -inf (a new tensor)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
