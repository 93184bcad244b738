"""Verifying drafted tokens against the target model's logits: the acceptance rules of speculative decoding.

``verify(logits, draft, params, generator)`` gets the target's logits at the ``k + 1`` positions of one
verification pass (the pending token, then each drafted token) and returns the tokens to append: the leading
accepted drafts plus exactly one token from the target (the correction at the first rejection, or a bonus
token when every draft was accepted).

Invariants (proposals are deterministic, see ``shared/spec/types.py``):
- Greedy: a draft is accepted iff it equals the target's argmax at its position (the longest matching prefix);
  the appended tokens are exactly what plain greedy decoding would produce, token for token.
- Sampled: draft ``x`` at position ``i`` is accepted with probability ``p_i(x)`` (``p_i`` = the distribution
  plain decoding samples from: ``sampler.probabilities``); on rejection the token is drawn from ``p_i`` with
  ``x`` removed and renormalised. Each appended token is therefore distributed exactly as plain decoding's
  (P(x) = p(x) from acceptance; P(y != x) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y)).
"""
from __future__ import annotations

import torch

from kernels.sampling_ops import argmax
from shared.engine.logits_processors import process
from shared.engine.sampler import probabilities
from shared.sampling import SamplingParams


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams, generator: torch.Generator | None,
           prompt: list[int] = (), output: list[int] = (), eos: tuple[int, ...] = ()) -> list[int]:
    """``logits: [len(draft) + 1, V]`` → the accepted drafts + one target token (1..len(draft)+1 tokens). Row ``i``
    is processed (``logits_processors``) as plain decoding would process it: after ``prompt``, ``output`` and
    the drafts before it."""
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(draft)} drafted tokens")
    if params.processes_logits:
        histories = [[*output, *draft[:i]] for i in range(len(draft) + 1)]
        logits = process(logits, [params] * len(histories), [prompt] * len(histories), histories, eos)
    if params.is_greedy:
        target = argmax(logits).tolist()          # ties -> lowest id, as in sampler.sample
        n = 0
        while n < len(draft) and draft[n] == target[n]:
            n += 1
        return draft[:n] + [target[n]]
    rows = logits.cpu()
    for i, x in enumerate(draft):
        p = probabilities(rows[i], params)                                  # [V]
        if torch.rand((), generator=generator).item() < p[x].item():
            continue
        residual = p.clone()
        residual[x] = 0.0
        return draft[:i] + [int(torch.multinomial(residual, 1, generator=generator).item())]
    bonus = torch.multinomial(probabilities(rows[len(draft)], params), 1, generator=generator)
    return draft + [int(bonus.item())]
