"""Token sampling: logits processors, then greedy or temperature, min-p, top-k, top-p with per-request seeded
generators.

``probabilities`` is a pure function (logits → the distribution actually sampled from); speculative
decoding's rejection sampling uses it so that drafted and plain decoding target the same distribution.
"""
from __future__ import annotations

import torch

from kernels.sampling_ops import argmax
from shared.engine.logits_processors import process
from shared.sampling import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits: [V]`` (processed: ``logits_processors.process``) → ``probs: [V]`` float32 after temperature,
    min-p, top-k and top-p (temperature > 0)."""
    x = logits.float() / params.temperature
    if params.min_p > 0.0:
        p = x.softmax(-1)
        x = x.masked_fill(p < params.min_p * p.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return x.softmax(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
           eos: tuple[int, ...] = ()) -> list[int]:
    """``logits: [S, V]`` → one token id per row. Row ``i`` follows ``prompts[i] + outputs[i]`` (the histories the
    logits processors read; None: empty). Greedy rows take the argmax of the processed logits (ties → lowest id)."""
    empty = [[] for _ in params]
    logits = process(logits, params, prompts or empty, outputs or empty, eos)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    tokens = [0] * len(params)
    if greedy_rows:
        rows = logits if len(greedy_rows) == len(params) else logits[torch.tensor(greedy_rows, dtype=torch.long)]
        for row, tok in zip(greedy_rows, argmax(rows).tolist()):
            tokens[row] = tok
    for i, p in enumerate(params):
        if not p.is_greedy:
            probs = probabilities(logits[i].cpu(), p)  # generators live on the CPU
            tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
