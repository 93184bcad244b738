"""The draft-model drafter: a smaller LLaMA-family model proposes its greedy continuation.

Design: stateless sliding window. For every ``propose`` call and every sequence, the draft's KV state is
rebuilt from the sequence's last ``window`` tokens only, as one prefill chunk at positions ``0..W-1``
(relative to the window; RoPE makes attention depend on relative positions only), then ``k - 1`` greedy
single-token decode steps follow. Nothing survives between calls, so a hand-off, a failover or a rejected
proposal needs no bookkeeping: the next call rebuilds from the window.

Invariants:
- Proposals are the draft's argmax continuation (ties → lowest id, as the engine's greedy sampler); they
  depend only on the window's tokens, never on batching (all sequences of a call share one forward per
  step: prefill chunks for the rebuild, then batched decode rows).
- ``len(proposal.tokens) == min(k, max_position_embeddings - window + 1)`` for a non-empty sequence (the
  draft's positions stay inside its RoPE table); an empty sequence gets an empty proposal.
- Memory is bounded: one scratch paged cache of ``max_batch * ceil((window + k) / block_size)`` blocks,
  reused by every call (grown only for a larger ``k``); sequence ``i`` of a slice owns the contiguous blocks
  ``[i * nb, (i + 1) * nb)``. Every slot read in a call was written earlier in the same call.
- ``self_speculative`` shares the target's tensors (no copies): the draft is the target's first layers, its
  final norm and its LM head.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from kernels import cpu_paged_attention
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.model import kv_cache
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.model.llama import LlamaModel
from shared.spec.types import DraftInput, Proposal, TokenFeatures

logger = logging.getLogger(__name__)

SELF_SPEC_PREFIX = "self:"


def self_speculative(target: LlamaModel, num_layers: int) -> LlamaModel:
    """The target's first ``num_layers`` layers + final norm + LM head as a model of its own.

    A shallow copy: every tensor (embedding, layers, norm, LM head, RoPE tables) is the target's own object."""
    total = target.config.num_layers
    if not 1 <= num_layers <= total:
        raise invalid(f"self-speculative draft needs 1..{total} layers, got {num_layers}")
    draft = copy.copy(target)
    draft.config = dataclasses.replace(
        target.config, num_layers=num_layers,
        layer_sliding_windows=target.config.layer_sliding_windows[:num_layers],
        model_id=f"{target.config.model_id}:self{num_layers}")
    draft.layers = target.layers[:num_layers]  # a new list of the same LayerWeights objects
    return draft


def load_drafter(path_or_spec: str | Path, target: LlamaModel, **kwargs) -> DraftModelDrafter:
    """``"self:N"`` → the target's first N layers; otherwise a GGUF file / HF folder loaded like the engine's
    model, in the target's dtype and device. ``kwargs`` go to ``DraftModelDrafter`` (window, max_batch, ...).

    Raises ``DeepinferError(INVALID_REQUEST)`` for a bad spec or a vocabulary that differs from the target's
    (token ids would mean different things)."""
    spec = str(path_or_spec)
    if spec.startswith(SELF_SPEC_PREFIX):
        count = spec[len(SELF_SPEC_PREFIX):]
        if not count.isdigit():
            raise invalid(f"drafter spec {spec!r}: expected 'self:<number of layers>'")
        model = self_speculative(target, int(count))
    else:
        from shared.model.loader import load_model_files  # heavy imports only when a file is loaded

        config, weights, _tokenizer = load_model_files(spec)
        if config.vocab_size != target.config.vocab_size:
            raise DeepinferError(ErrorCode.INVALID_REQUEST,
                                 f"draft model {spec} has a vocabulary of {config.vocab_size} tokens; the "
                                 f"target's has {target.config.vocab_size}")
        model = LlamaModel(config, weights, target.dtype, target.device)
    logger.info("drafter %s: %s, %d layers", spec, model.config.model_id, model.config.num_layers)
    return DraftModelDrafter(model, **kwargs)


def _pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits: [B, V]`` → ``(tokens [B] int64, top1 prob [B], entropy [B] in nats)``.

    Tokens are the argmax of the raw logits (what the engine's greedy sampler picks); probabilities are
    computed in float64 for a float64 model, float32 otherwise."""
    tokens = logits.argmax(-1)  # [B]
    wide = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)  # [B, V]
    logp = torch.log_softmax(wide, -1)  # [B, V]
    top1 = logp.gather(-1, tokens[:, None])[:, 0].exp()  # [B]
    entropy = torch.special.entr(logp.exp()).sum(-1)  # [B]; entr(0) = 0, every term >= 0
    return tokens, top1, entropy


class DraftModelDrafter:
    """``Drafter`` running a draft ``LlamaModel`` over a window of each sequence's last tokens (see module doc).

    Not thread-safe: one scratch cache per drafter, used by one ``propose`` at a time."""

    def __init__(self, model: LlamaModel, window: int = 128, name: str = "draft_model", *,
                 max_batch: int = 16, block_size: int = 16) -> None:
        max_pos = model.config.max_position_embeddings
        if not 1 <= window <= max_pos:
            raise invalid(f"draft window must be in 1..{max_pos} (the draft's context), got {window}")
        if max_batch < 1 or block_size < 1:
            raise invalid(f"max_batch and block_size must be positive, got {max_batch}, {block_size}")
        self.model, self.window, self.name = model, window, name
        self.max_batch, self.block_size = max_batch, block_size
        self._blocks_per_seq = 0
        self._kv: torch.Tensor | None = None  # [max_batch * blocks_per_seq, L, 2, kvh, block_size, D]
        if model.device.type == "cpu":
            cpu_paged_attention.load()  # build/load now, not inside the first decode step

    def propose(self, sequences: Sequence[DraftInput], k: int) -> list[Proposal]:
        """One proposal per sequence, in order: the draft's greedy continuation of its last ``window`` tokens."""
        if k <= 0 or not sequences:
            return [Proposal() for _ in sequences]
        k = min(k, self.model.config.max_position_embeddings - self.window + 1)
        self._ensure_cache(k)
        proposals = [Proposal() for _ in sequences]
        live = [i for i, s in enumerate(sequences) if len(s.token_ids)]  # empty sequence: nothing to draft
        for lo in range(0, len(live), self.max_batch):
            part = live[lo:lo + self.max_batch]
            tails = [list(sequences[i].token_ids[-self.window:]) for i in part]
            for i, proposal in zip(part, self._propose_slice(tails, k)):
                proposals[i] = proposal
        return proposals

    def _ensure_cache(self, k: int) -> None:
        needed = -(-(self.window + k) // self.block_size)
        if self._kv is not None and needed <= self._blocks_per_seq:
            return
        m = self.model
        self._kv = kv_cache.allocate(self.max_batch * needed, m.config, self.block_size, m.dtype, m.device)
        self._blocks_per_seq = needed
        logger.debug("drafter %s: scratch cache of %d blocks (%d per sequence, %.1f MiB)", self.name,
                     self.max_batch * needed, needed, self._kv.numel() * self._kv.element_size() / 2**20)

    def _propose_slice(self, tails: list[list[int]], k: int) -> list[Proposal]:
        """At most ``max_batch`` non-empty windows → their proposals of exactly ``k`` tokens."""
        m, bs, nb, dev = self.model, self.block_size, self._blocks_per_seq, self.model.device
        lens = torch.tensor([len(t) for t in tails], dtype=torch.long)  # [B]
        base = torch.arange(len(tails), dtype=torch.long) * nb  # [B] first block of each sequence
        # rebuild: one prefill chunk per window, positions 0..n-1, slots base*bs + position (contiguous blocks)
        positions = torch.cat([torch.arange(n) for n in lens.tolist()])  # [T]
        slots = torch.cat([b * bs + torch.arange(n) for b, n in zip(base.tolist(), lens.tolist())])  # [T]
        ends = lens.cumsum(0)  # [B]
        chunks = [PrefillChunk(e - n, e, n, torch.arange(b, b + -(-n // bs), device=dev))
                  for b, n, e in zip(base.tolist(), lens.tolist(), ends.tolist())]
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), num_decode=0,
            decode_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=dev),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev), prefills=chunks, block_size=bs)
        ids = torch.tensor([t for tail in tails for t in tail], dtype=torch.long, device=dev)  # [T]
        logits = m.forward(ids, positions.to(dev), meta, self._kv, (ends - 1).to(dev))  # [B, V]
        steps = [_pick(logits)]
        # decode: the token drafted at step j-1 sits at position n + j - 1
        tables = (base[:, None] + torch.arange(nb)).to(dtype=torch.int32, device=dev)  # [B, nb]
        rows = torch.arange(len(tails), device=dev)  # [B]
        lens_d, base_d = lens.to(dev), base.to(dev)
        for j in range(1, k):
            pos = lens_d + (j - 1)  # [B]
            meta = AttentionMetadata(
                slot_mapping=base_d * bs + pos, num_decode=len(tails), decode_block_tables=tables,
                decode_context_lens=(pos + 1).to(torch.int32), prefills=[], block_size=bs)
            logits = m.forward(steps[-1][0], pos, meta, self._kv, rows)  # [B, V]
            steps.append(_pick(logits))
        tokens = torch.stack([s[0] for s in steps], 1).tolist()  # [B, k]
        top1 = torch.stack([s[1] for s in steps], 1).tolist()  # [B, k]
        entropy = torch.stack([s[2] for s in steps], 1).tolist()  # [B, k]
        return [Proposal(tok, [TokenFeatures(top1_prob=p, entropy=h, ngram_len=0, position=i)
                               for i, (p, h) in enumerate(zip(ps, hs))])
                for tok, ps, hs in zip(tokens, top1, entropy)]
