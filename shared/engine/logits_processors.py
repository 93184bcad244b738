"""Logits processors: what a request's ``Sampling`` does to the model's logits before a token is chosen.

``process(logits, params, prompts, outputs, eos)`` returns the processed logits of a batch of sampled positions:
row ``i`` is the position after ``prompts[i] + outputs[i]`` (a drafted position's ``outputs`` include the drafts
before it). In vLLM's order (``shared/sampling.py`` states each rule):

1. ``allowed_token_ids``: every other token -> -inf;
2. ``min_tokens``: EOS and ``stop_token_ids`` -> -inf while fewer than ``min_tokens`` tokens were generated;
3. ``logit_bias``: added;
4. ``repetition_penalty`` over prompt + output tokens, then ``frequency_penalty`` and ``presence_penalty`` over
   output tokens (OpenAI's formula ``logit - f * count - p * (count > 0)``);
5. ``bad_words_token_ids``: a word's last token -> -inf where the output ends with the word's other tokens.

Invariants: every operation is a tensor op over the rows that need it (counts by ``scatter_add_``, masks by
``scatter_``), never a Python loop over the vocabulary; rows whose request processes nothing are returned
untouched and a batch where none does costs one pass over ``params``. State is the token history alone, so a
stream continued elsewhere from its tokens (hand-off, failover, migration, resume) processes exactly as it would
have in one engine. Temperature, ``min_p``, top-k and top-p belong to sampling (``sampler.probabilities``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.sampling import SamplingParams


def _padded(seqs: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [R, L], valid [R, L])`` of ragged token lists (padding id 0, not valid)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
    valid = torch.zeros(len(seqs), max(width, 1), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
            valid[i, :len(s)] = True
    return ids.to(device), valid.to(device)


def _counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` float: how often each token occurs in each row's list."""
    ids, valid = _padded(seqs, device)
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, valid.float())


def _ban(sub: torch.Tensor, at: list[int], seqs: list[Sequence[int]]) -> None:
    """``sub[at[k], t] = -inf`` for every token ``t`` of ``seqs[k]``, in place: a write per banned token, not a
    pass over the vocabulary."""
    ids, valid = _padded(seqs, sub.device)
    rows = torch.tensor(at, dtype=torch.long, device=sub.device)[:, None].expand_as(ids)
    sub[rows[valid], ids[valid]] = float("-inf")


def tokenize_bad_words(words: Sequence[str], encode) -> list[list[int]]:
    """vLLM's rule: each word as written (leading spaces dropped), and with one leading space where that makes a
    different first token of the same length (a word inside text); ``encode(text) -> ids`` without specials."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if bare:
            out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens ``words`` forbid next after ``output``: each word's last token when the output ends with the
    word's other tokens (a one-token word: always). A loop over the request's words, not the vocabulary."""
    bans = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head:]) == list(word[:head])):
            bans.append(word[-1])
    return bans


def process(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
            outputs: Sequence[Sequence[int]], eos: Sequence[int]) -> torch.Tensor:
    """``logits: [R, V]`` -> processed ``[R, V]`` (a new tensor when anything changed; see the module docstring)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    vocab, device = logits.shape[-1], logits.device
    sub = logits[torch.tensor(rows, dtype=torch.long, device=device)].float()    # [r, V]
    ps = [params[i] for i in rows]
    neg_inf = float("-inf")

    allowed = [j for j, p in enumerate(ps) if p.allowed_token_ids is not None]
    if allowed:
        ids, valid = _padded([ps[j].allowed_token_ids for j in allowed], device)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device).scatter_(1, ids, valid)
        sub[allowed] = sub[allowed].masked_fill(~keep, neg_inf)

    early = [j for j, p in enumerate(ps) if p.min_tokens and len(outputs[rows[j]]) < p.min_tokens]
    if early:
        _ban(sub, early, [[*eos, *ps[j].stop_token_ids] for j in early])

    biased = [j for j, p in enumerate(ps) if p.logit_bias]
    if biased:
        items = [list(ps[j].logit_bias.items()) for j in biased]
        ids, valid = _padded([[int(t) for t, _ in it] for it in items], device)
        values = torch.zeros(ids.shape, dtype=torch.float32)
        for r, it in enumerate(items):       # one row per biased request, its entries in one tensor
            values[r, :len(it)] = torch.tensor([float(b) for _, b in it])
        sub[biased] = sub[biased].scatter_add(1, ids, values.to(device) * valid)

    repeat = [j for j, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if repeat:
        seen = _counts([[*prompts[rows[j]], *outputs[rows[j]]] for j in repeat], vocab, device) > 0
        penalty = torch.tensor([ps[j].repetition_penalty for j in repeat], device=device).unsqueeze(1)   # [r, 1]
        x = sub[repeat]
        sub[repeat] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)

    counted = [j for j, p in enumerate(ps) if p.presence_penalty or p.frequency_penalty]
    if counted:
        counts = _counts([outputs[rows[j]] for j in counted], vocab, device)                               # [c, V]
        freq = torch.tensor([ps[j].frequency_penalty for j in counted], device=device).unsqueeze(1)
        pres = torch.tensor([ps[j].presence_penalty for j in counted], device=device).unsqueeze(1)
        sub[counted] = sub[counted] - freq * counts - pres * (counts > 0).float()

    banned = [(j, bad_word_bans(ps[j].bad_words_token_ids, outputs[rows[j]])) for j, p in enumerate(ps)
              if p.bad_words_token_ids]
    banned = [(j, ids) for j, ids in banned if ids]
    if banned:
        _ban(sub, [j for j, _ in banned], [ids for _, ids in banned])

    if len(rows) == len(params):  # every row processed: ``sub`` is already a new float tensor in row order
        return sub
    out = logits.float().clone()
    out[torch.tensor(rows, dtype=torch.long, device=device)] = sub
    return out
