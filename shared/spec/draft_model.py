"""The draft-model drafter: a smaller LLaMA-family model proposes its greedy continuation.

Design: the draft keeps its own KV per sequence across calls (``shared/spec/draft_state.py``) and sees the
sequence from an anchor on that hops by ``stride`` tokens (``window`` to ``window + stride - 1`` tokens, positions
relative to the anchor). Each call feeds only what the state lacks: usually the target's bonus token (drafted
tokens the target accepted are already in the state, written while drafting), after a rejection the tokens past
the common prefix (the state is truncated to it). A state is rebuilt from its anchor only when there is none
(new sequence, hand-off, failover, migration, eviction) or the anchor hops. Then ``k - 1`` greedy single-token
decode steps follow.

Invariants:
- Proposals are the draft's argmax continuation (ties → lowest id, as the engine's greedy sampler) of the
  sequence from ``anchor_of(n, window, stride)`` on: a function of the tokens only, never of the drafter's
  history, the states it holds or the batching (up to float rounding: the same KV computed one token at a time
  or in one chunk can differ in its last bits, which could flip a near-tie; float64 tests see identical
  proposals). With ``stride == 1`` that is the last ``window`` tokens, exactly what a per-step rebuild proposes.
- All sequences of a slice (at most ``max_batch``, no id twice) share one forward for their new tokens (decode
  rows for one token, prefill chunks over their cached context otherwise) and one per decode step.
- ``len(proposal.tokens) == min(k, max_position_embeddings - window + 1)`` for a non-empty sequence (the
  draft's positions stay inside its RoPE table; ``stride`` shrinks for that call if needed); an empty sequence
  gets an empty proposal and leaves the states alone.
- Memory is bounded: at most ``max_states`` states of ``window + stride + k - 2`` tokens (rounded up to blocks);
  ``release(seq_ids)`` frees finished sequences' states, otherwise the least recently used one goes.
- A forward that raises leaves every state valid (truncated to what it held before the call's writes).
- ``self_speculative`` shares the target's tensors (no copies): the draft is the target's first layers, its
  final norm and its LM head.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import cpu_paged_attention
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.model.llama import LlamaModel
from shared.spec.draft_state import DraftCounters, DraftState, DraftStates, anchor_of, common_prefix
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
    model, in the target's dtype and device. ``kwargs`` go to ``DraftModelDrafter`` (window, stride, ...).

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



@dataclass(slots=True)
class _Plan:
    """One sequence of a slice: its state, the tokens the draft sees (``ctx``), how many the state keeps."""
    seq_id: str
    state: DraftState
    ctx: list[int]
    keep: int


class DraftModelDrafter:
    """``Drafter`` running a draft ``LlamaModel`` over an anchored window of each sequence, keeping its KV
    across calls (see module doc). ``stride`` defaults to ``window // 2``, ``max_states`` to ``max(max_batch,
    64)`` (an engine's default ``max_num_seqs``: a drafter serving more sequences than it keeps states for
    rebuilds every one, every step).

    Not thread-safe: one state table per drafter, used by one ``propose`` at a time."""

    def __init__(self, model: LlamaModel, window: int = 128, name: str = "draft_model", *,
                 stride: int | None = None, max_batch: int = 16, max_states: int | None = None,
                 block_size: int = 16) -> None:
        max_pos = model.config.max_position_embeddings
        if not 1 <= window <= max_pos:
            raise invalid(f"draft window must be in 1..{max_pos} (the draft's context), got {window}")
        stride = max(1, window // 2) if stride is None else stride
        max_states = max(max_batch, 64) if max_states is None else max_states
        if min(max_batch, block_size, stride) < 1:
            raise invalid(f"max_batch, block_size and stride must be positive, got {max_batch}, {block_size}, "
                          f"{stride}")
        if max_states < max_batch:
            raise invalid(f"max_states ({max_states}) must be at least max_batch ({max_batch})")
        self.model, self.window, self.stride, self.name = model, window, stride, name
        self.max_batch, self.block_size = max_batch, block_size
        self.states = DraftStates(model, max_states, block_size)
        self.counters = DraftCounters()
        if model.device.type == "cpu":
            cpu_paged_attention.load()  # build/load now, not inside the first decode step

    def propose(self, sequences: Sequence[DraftInput], k: int) -> list[Proposal]:
        """One proposal per sequence, in order: the draft's greedy continuation of its anchored window."""
        if k <= 0 or not sequences:
            return [Proposal() for _ in sequences]
        max_pos = self.model.config.max_position_embeddings
        k = min(k, max_pos - self.window + 1)
        stride = max(1, min(self.stride, max_pos - self.window - k + 2))  # context + k - 1 drafted <= max_pos
        self.states.reserve(self.window + stride + k - 2)
        views = [self._view(seq) for seq in sequences]
        proposals = [Proposal() for _ in sequences]
        for part in self._slices(views):
            for i, proposal in zip(part, self._propose_slice([views[i] for i in part], k, stride)):
                proposals[i] = proposal
        return proposals

    def release(self, seq_ids: Iterable[str]) -> int:
        """Forget finished (or migrated) sequences' states; returns how many were held."""
        return self.states.release(seq_ids)

    def stats(self) -> dict[str, int]:
        """Counters (``DraftCounters``) plus states evicted for room and states held now."""
        return {**self.counters.as_dict(), "evictions": self.states.evictions, "states": len(self.states)}

    # -- what a drafter of another input (shared/spec/mtp_drafter.py) changes ------------------------------
    def _view(self, seq: DraftInput) -> DraftInput:
        """The token sequence the draft runs over (here: the sequence itself); empty = no proposal."""
        return seq

    def _forward_fed(self, fed: list[_Plan], ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     last: torch.Tensor) -> torch.Tensor:
        """The forward over each plan's new tokens ``ctx[keep:]`` (``fed`` in batch order; ``ids``, ``positions``:
        ``[T]``) → logits ``[B, V]`` at ``last``, in slice order."""
        return self.model.forward(ids, positions, meta, self.states.kv, last)

    def _forward_drafted(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         rows: torch.Tensor) -> torch.Tensor:
        """One decode row per sequence (``tokens``: ``[B]``, the previous step's drafts) → logits ``[B, V]``."""
        return self.model.forward(tokens, positions, meta, self.states.kv, rows)

    def _kept_after_draft(self, ctx: list[int], drafted: list[int]) -> list[int]:
        """What the state holds after drafting: KV is written for every drafted token but the last, and a
        drafted token's KV is what the sequence's own would be (a function of the tokens), so it stays."""
        return ctx + drafted

    def _slices(self, sequences: Sequence[DraftInput]) -> list[list[int]]:
        """Indices of the non-empty sequences, in order, in slices of at most ``max_batch`` with no id twice."""
        slices: list[list[int]] = []
        ids: set[str] = set()
        for i, seq in enumerate(sequences):
            if not len(seq.token_ids):  # empty sequence: nothing to draft
                continue
            if not slices or len(slices[-1]) == self.max_batch or seq.seq_id in ids:
                slices.append([])
                ids = set()
            slices[-1].append(i)
            ids.add(seq.seq_id)
        return slices

    def _plan(self, seqs: list[DraftInput], stride: int) -> list[_Plan]:
        """Each sequence's state, truncated to what it shares with the sequence (empty: rebuild from the anchor)."""
        pinned = {s.seq_id for s in seqs}
        plans = []
        for seq in seqs:
            anchor = anchor_of(len(seq.token_ids), self.window, stride)
            ctx = list(seq.token_ids[anchor:])  # [c] what the draft sees, position 0 = the anchor
            state = self.states.get(seq.seq_id)
            keep = 0
            if state is None:  # new sequence, hand-off, failover, migration, eviction
                state = self.states.acquire(seq.seq_id, pinned)
            elif state.anchor == anchor:  # accepted drafts stand; a rejection cuts back to the common prefix
                keep = min(common_prefix(state.token_ids, ctx), len(ctx) - 1)  # the last token is always fed
            state.anchor, state.token_ids = anchor, ctx[:keep]  # valid even if this call's forward raises
            self.counters.rebuilds += keep == 0
            self.counters.fed_tokens += len(ctx) - keep
            plans.append(_Plan(seq.seq_id, state, ctx, keep))
        return plans

    def _propose_slice(self, seqs: list[DraftInput], k: int, stride: int) -> list[Proposal]:
        """At most ``max_batch`` non-empty sequences with distinct ids → their proposals of exactly ``k`` tokens."""
        st, bs, dev = self.states, self.block_size, self.model.device
        plans = self._plan(seqs, stride)
        self.counters.calls += 1
        self.counters.drafts += len(plans)
        # new tokens: one decode row per sequence with one (first), one prefill chunk over its cache per other
        order = sorted(range(len(plans)), key=lambda i: len(plans[i].ctx) - plans[i].keep > 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last, decode, chunks = [0] * len(plans), [], []
        for i in order:
            p = plans[i]
            c, first = len(p.ctx), st.first_block(p.state)
            ids += p.ctx[p.keep:]
            positions.extend(range(p.keep, c))
            slots.extend(range(first * bs + p.keep, first * bs + c))  # contiguous blocks: slot = base + position
            if c - p.keep == 1:
                decode.append(i)
            else:
                chunks.append(PrefillChunk(len(ids) - (c - p.keep), len(ids), c,
                                           torch.arange(first, first + -(-c // bs), device=dev)))
            last[i] = len(ids) - 1
        lens = torch.tensor([len(p.ctx) for p in plans], dtype=torch.long)  # [B]
        base = torch.tensor([st.first_block(p.state) for p in plans], dtype=torch.long)  # [B]
        tables = (base[:, None] + torch.arange(st.blocks_per_state)).to(torch.int32)  # [B, nb]
        rows = torch.tensor(decode, dtype=torch.long)  # [num_decode]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), num_decode=len(decode),
            decode_block_tables=tables[rows].to(dev), decode_context_lens=lens[rows].to(torch.int32).to(dev),
            prefills=chunks, block_size=bs)
        logits = self._forward_fed([plans[i] for i in order], torch.tensor(ids, dtype=torch.long, device=dev),
                                   torch.tensor(positions, dtype=torch.long, device=dev), meta,
                                   torch.tensor(last, dtype=torch.long, device=dev))  # [B, V] in slice order
        steps = [_pick(logits)]
        # decode: the token drafted at step j-1 sits at position c + j - 1
        tables, rows = tables.to(dev), torch.arange(len(plans), device=dev)  # [B, nb], [B]
        lens_d, slot0 = lens.to(dev), (base * bs).to(dev)  # [B], [B]
        for j in range(1, k):
            pos = lens_d + (j - 1)  # [B]
            meta = AttentionMetadata(
                slot_mapping=slot0 + pos, num_decode=len(plans), decode_block_tables=tables,
                decode_context_lens=(pos + 1).to(torch.int32), prefills=[], block_size=bs)
            steps.append(_pick(self._forward_drafted(steps[-1][0], pos, meta, rows)))  # logits [B, V]
        tokens = torch.stack([s[0] for s in steps], 1).tolist()  # [B, k]
        top1 = torch.stack([s[1] for s in steps], 1).tolist()  # [B, k]
        entropy = torch.stack([s[2] for s in steps], 1).tolist()  # [B, k]
        for p, drafted in zip(plans, tokens):
            p.state.token_ids = self._kept_after_draft(p.ctx, drafted[:k - 1])
        return [Proposal(tok, [TokenFeatures(top1_prob=q, entropy=h, ngram_len=0, position=i)
                               for i, (q, h) in enumerate(zip(ps, hs))])
                for tok, ps, hs in zip(tokens, top1, entropy)]
