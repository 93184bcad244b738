"""The MTP drafter (``--drafter mtp``): DeepSeek V3's own next-n prediction module drafts from the target's hidden
states (``shared/model/mtp.py``).

Where its input comes from. The engine keeps the target's last hidden states (``DeepseekV3Model.keep_hidden``)
and after every step hands each request's valid rows to ``observe(seq_id, start, rows)``: all rows of a prefill
chunk or a decode, and of a verification only those of the tokens the target accepted (plus the row that
sampled the bonus token). Row ``i`` is ``h_i``, the state that predicted token ``i + 1``. MTP row ``j`` pairs
``h_j`` with token ``j + 1``, so the draft runs over the sequence from ``origin + 1`` on (``_view``), where
``origin`` is the first position this engine computed a hidden state for since the request's last reset: 0 for
a request prefilled here, later for one handed off, migrated in, or served from a prefix hit (the module then
attends to what this engine saw; verification keeps every output the target's either way).

Invariants (beyond ``DraftModelDrafter``'s, whose anchored window, batching and state table it reuses):
- A sequence gets a proposal only when the hidden states run up to its newest token's predecessor (``observe``
  reached position ``len(tokens) - 2``): a request no step of this engine has computed yet drafts nothing.
- The module's KV of a row holds only when that row's input was the target's own hidden state: after drafting
  the state keeps the sequence's rows, never the chained drafted rows (those used the module's ``h'``), so the
  next call recomputes accepted drafts' rows from the target's states.
- ``observe`` that does not extend a sequence's rows exactly at their end (a recompute after preemption, a gap)
  restarts that sequence: rows from ``start`` on, its module state dropped.
- Memory is bounded: at most ``2 * (window + stride + 2)`` rows of ``hidden`` numbers per sequence (trimmed to
  the ``window + stride + 2`` the next anchored window can need once past that), for at most ``max_states``
  sequences (least recently observed dropped).
- Greedy output equals plain decoding and sampled output follows the target's distribution: proposals are
  point masses verified by the engine's rejection rule, like every drafter's (``shared/spec/types.py``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from shared.model.attention import AttentionMetadata
from shared.model.deepseek import DeepseekV3Model
from shared.model.mtp import MultiTokenPredictor
from shared.spec.draft_model import DraftModelDrafter, _Plan
from shared.spec.types import DraftInput


@dataclass(slots=True)
class _Rows:
    """A sequence's target hidden states: ``rows[t]`` is ``h_{first + t}``; MTP rows count from ``origin``."""
    origin: int
    first: int
    rows: torch.Tensor  # [m, hidden]

    @property
    def end(self) -> int:
        return self.first + self.rows.shape[0]


class MtpDrafter(DraftModelDrafter):
    """``DraftModelDrafter`` whose draft is the target's MTP module fed the target's hidden states (module doc).
    ``observe`` must see every step of every request the engine runs (``Speculator.observe``)."""

    def __init__(self, target: DeepseekV3Model, window: int = 128, **kwargs) -> None:
        super().__init__(MultiTokenPredictor(target), window, name="mtp", **kwargs)
        self.hidden: OrderedDict[str, _Rows] = OrderedDict()  # least recently observed first
        self._keep = self.window + self.stride + 2
        self._chain: torch.Tensor | None = None  # [B, hidden]: the module's h' at each sequence's last row

    def observe(self, seq_id: str, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states ``rows: [m, hidden]`` of positions ``start .. start + m - 1``."""
        if rows.shape[0] == 0:
            return
        held = self.hidden.get(seq_id)
        if held is not None and held.end == start:
            held.rows = torch.cat([held.rows, rows])
            self.hidden.move_to_end(seq_id)
        else:   # new, or not a continuation (recompute, gap): start over from here
            if held is not None:
                self.states.release([seq_id])
            kept = rows[-self._keep:].clone()   # a copy: never a view keeping the step's whole tensor alive
            held = self.hidden[seq_id] = _Rows(start, start + rows.shape[0] - kept.shape[0], kept)
            self.hidden.move_to_end(seq_id)
        if held.rows.shape[0] > 2 * self._keep:   # trim in batches: one copy per ``_keep`` rows appended
            cut = held.rows.shape[0] - self._keep
            held.rows, held.first = held.rows[cut:].clone(), held.first + cut
        while len(self.hidden) > self.states.max_states:
            dropped, _ = self.hidden.popitem(last=False)
            self.states.release([dropped])

    def release(self, seq_ids: Iterable[str]) -> int:
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self.hidden.pop(seq_id, None)
        return super().release(seq_ids)

    def _view(self, seq: DraftInput) -> DraftInput:
        held = self.hidden.get(seq.seq_id)
        n = len(seq.token_ids)
        if held is None or held.end != n - 1 or n - 1 <= held.origin:
            return DraftInput(seq.seq_id, ())
        return DraftInput(seq.seq_id, seq.token_ids[held.origin + 1:])

    def _forward_fed(self, fed: list[_Plan], ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     last: torch.Tensor) -> torch.Tensor:
        parts = []
        for p in fed:   # view index v of the plan's context is MTP row origin + anchor + v, i.e. h of that position
            held = self.hidden[p.seq_id]
            lo = held.origin + p.state.anchor + p.keep - held.first
            parts.append(held.rows[lo:lo + len(p.ctx) - p.keep])
        prev = torch.cat(parts).to(self.model.device)  # [T, hidden]
        logits, self._chain = self.model.forward(ids, positions, meta, self.states.kv, last, prev)
        return logits

    def _forward_drafted(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         rows: torch.Tensor) -> torch.Tensor:
        logits, self._chain = self.model.forward(tokens, positions, meta, self.states.kv, rows, self._chain)
        return logits

    def _kept_after_draft(self, ctx: list[int], drafted: list[int]) -> list[int]:
        return ctx
