"""Per-sequence draft KV kept across ``propose`` calls: which tokens the draft sees, and where their KV lives.

The anchored window. A draft of ``L > 1`` layers cannot slide its KV one token at a time and stay exact: the
layer-``l`` KV of a token depends on every token it attended to below, so dropping the oldest token's KV
leaves the others' deeper KV computed *with* it, which a rebuild from the shorter window would not
(``tests/unit/test_draft_state.py`` shows layer 0 equal and layer 1 different). So the window's start hops
instead: the draft sees the sequence from ``anchor_of(n)`` on, which moves by ``stride`` tokens at a time and
depends on the token count ``n`` only. Between hops the state grows one verified token at a time and is exactly
the KV a rebuild of the same span would give; at a hop (and with no state) it is rebuilt from the new anchor.
With ``stride == 1`` the draft sees exactly the last ``window`` tokens, as a per-step rebuild does.

Invariants:
- ``anchor_of(n, window, stride) == max(0, n - window) // stride * stride``: the draft sees ``min(n, window)``
  to ``window + stride - 1`` tokens; positions are relative to the anchor (``0..``), so they stay inside the
  draft's RoPE table whatever the sequence's length.
- ``state.token_ids[p]`` has its KV (every layer) at slot ``state.slot * blocks_per_state * block_size + p`` for
  each ``p < len(state.token_ids) <= blocks_per_state * block_size``; nothing past ``len`` is ever read, so
  truncating a state (a rejected draft, a rollback) is shortening the list: the KV of a prefix does not depend
  on later tokens.
- At most ``max_states`` states (least recently used evicted first, never a pinned one); state ``i`` owns the
  contiguous blocks ``[slot * blocks_per_state, (slot + 1) * blocks_per_state)`` and no two states share a slot.
- The pool grows by doubling up to ``max_states`` states (contents copied); a larger ``blocks_per_state`` (a
  larger ``k``) drops every state, which the next call rebuilds.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from shared.model import kv_cache
from shared.model.llama import LlamaModel

logger = logging.getLogger(__name__)


def anchor_of(num_tokens: int, window: int, stride: int) -> int:
    """Index of the first token the draft sees in a sequence of ``num_tokens`` tokens (see module doc)."""
    return max(0, num_tokens - window) // stride * stride


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case: every cached token still stands
        return n
    return next(i for i in range(n) if a[i] != b[i])


@dataclass(slots=True)
class DraftState:
    """One sequence's draft KV: ``token_ids`` = the sequence from ``anchor`` on (then drafted tokens), in ``slot``."""
    slot: int
    anchor: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DraftCounters:
    calls: int = 0             # propose calls that drafted for at least one sequence
    drafts: int = 0            # sequence-proposals made
    rebuilds: int = 0          # states computed from their anchor (no state, an anchor hop, nothing in common)
    fed_tokens: int = 0        # sequence tokens run through the draft (rebuilt or incremental; not drafted ones)

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "drafts": self.drafts, "rebuilds": self.rebuilds, "fed_tokens": self.fed_tokens}


class DraftStates:
    """LRU table ``seq_id -> DraftState`` over one paged KV pool (see module doc). Not thread-safe."""

    def __init__(self, model: LlamaModel, max_states: int, block_size: int) -> None:
        self.model, self.max_states, self.block_size = model, max_states, block_size
        self.blocks_per_state = 0
        self.capacity = 0                    # states the pool has room for (<= max_states)
        self.kv: torch.Tensor | None = None  # [capacity * blocks_per_state, L, 2, kvh, block_size, D]
        self._states: OrderedDict[str, DraftState] = OrderedDict()  # least recently used first
        self._free: list[int] = []           # slots < capacity owned by no state
        self.evictions = 0                   # states dropped for room (least recently used)

    def __len__(self) -> int:
        return len(self._states)

    def reserve(self, num_tokens: int) -> None:
        """Make every state hold at least ``num_tokens`` tokens; growing the per-state room drops all states."""
        needed = -(-num_tokens // self.block_size)
        if needed <= self.blocks_per_state:
            return
        if self._states:
            logger.info("draft states: %d dropped (room per sequence grows to %d tokens)", len(self._states),
                        needed * self.block_size)
        self._states.clear()
        self.blocks_per_state, self.capacity, self.kv, self._free = needed, 0, None, []

    def get(self, seq_id: str) -> DraftState | None:
        """The sequence's state (now the most recently used), or None."""
        state = self._states.get(seq_id)
        if state is not None:
            self._states.move_to_end(seq_id)
        return state

    def acquire(self, seq_id: str, pinned: set[str]) -> DraftState:
        """A new empty state for ``seq_id`` (which has none): a free slot, a larger pool, or the least recently
        used state outside ``pinned`` evicted. Raises ``RuntimeError`` if every state is pinned."""
        if not self._free and self.capacity < self.max_states:
            self._grow(min(self.max_states, max(1, 2 * self.capacity)))
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((s for s in self._states if s not in pinned), None)
            if victim is None:
                raise RuntimeError(f"all {self.max_states} draft states are in use by this call")
            slot = self._states.pop(victim).slot
            self.evictions += 1
        state = self._states[seq_id] = DraftState(slot)
        return state

    def release(self, seq_ids: Iterable[str]) -> int:
        """Forget these sequences' states (finished, migrated away); unknown ids are ignored. Returns how many."""
        freed = 0
        for seq_id in seq_ids:
            state = self._states.pop(seq_id, None)
            if state is not None:
                self._free.append(state.slot)
                freed += 1
        return freed

    def first_block(self, state: DraftState) -> int:
        return state.slot * self.blocks_per_state

    def _grow(self, capacity: int) -> None:
        m, nb = self.model, self.blocks_per_state
        kv = kv_cache.allocate(capacity * nb, m.config, self.block_size, m.dtype, m.device)
        if self.kv is not None:
            kv[:self.capacity * nb].copy_(self.kv)
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))  # lowest slot handed out first
        self.kv, self.capacity = kv, capacity
        logger.debug("draft states: pool of %d states x %d blocks (%.1f MiB)", capacity, nb,
                     kv.numel() * kv.element_size() / 2**20)
