"""The one interface between the engine and a KV layout: which blocks a request holds, in every KV group.

A layout is a set of KV groups that share one block size and one logical block index (block ``i`` holds the
KV of tokens ``[i * bs, (i + 1) * bs)`` in every group): the plain paged cache is one group
(``shared/engine/block_manager.py``); SWA-aware KV is a full group and a sliding-window group
(``shared/engine/hybrid_kv.py``). The physical pools are ``shared/model/kv_cache.allocate(pool_sizes, ...)``;
what moves between engines is ``shared/engine/kv_port.py``'s. Nothing outside a manager asks which layout it is.

The scheduler needs six verbs, after vLLM v1's ``KVCacheManager`` and nano-vllm's block manager:
``get_computed_blocks`` (an opaque prefix hit and its token count), ``allocate_slots`` (room for a step, or
``None``: no room, nothing changed; the caller preempts or waits), ``has_room``, ``free``, ``trim`` (rejected
drafts) and ``publish_computed``. The engine's KV port adds ``block_ids`` / ``group_block_ids`` (tables),
``cached_prefix`` and ``import_cached`` (KV computed elsewhere), ``accepts`` and ``refuse`` (what a layout
can take), and ``reset_prefix_cache``.

Invariants every manager keeps:
- ``allocate_slots`` checks every group before changing any: a request is never left half-allocated.
- Logical block ids are the first group's (``block_ids``): prefix-cache hashes, KV events, the router's index
  and every hand-off name blocks by them; other groups' ids stay internal.
- ``num_blocks`` / ``num_free_blocks`` / ``usage`` speak in logical blocks (tokens / block_size): the unit
  routers compare with a prompt's length; ``usage`` is the fullest group's.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sized

from shared.engine.request import Request

EventSink = Callable[[str, list[int]], None]  # (kind, hashes): "stored", "removed", "cleared"


@dataclasses.dataclass(frozen=True, slots=True)
class ImportedBlocks:
    """Where ``import_cached`` put blocks computed elsewhere: ``rows[g][j]`` is the group-``g`` block that takes
    payload block ``j``'s group-``g`` rows, or -1 (not written: already cached, or not needed); the prefix cache
    then holds the request's leading ``num_blocks`` blocks (every group the hit rule needs)."""
    rows: list[list[int]]
    num_blocks: int


class KVManager(abc.ABC):
    """See the module docstring. ``Hits`` (``get_computed_blocks``) is opaque: callers only pass it back to
    ``allocate_slots`` and take its ``len`` (hit blocks)."""

    block_size: int
    enable_caching: bool
    num_query_tokens: int   # prefix-cache accounting: tokens looked up / found
    num_hit_tokens: int

    # -- sizes -------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_blocks(self) -> int:
        """Logical blocks (the first group's pool): a request never holds more than this."""

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    @abc.abstractmethod
    def usage(self) -> float: ...

    @property
    @abc.abstractmethod
    def pool_sizes(self) -> list[int]:
        """Physical blocks per KV group (a null block included): what ``kv_cache.allocate`` builds."""

    @abc.abstractmethod
    def pools(self) -> list[tuple[str, int, int]]:
        """``(name, blocks, free blocks)`` per KV group, null blocks left out: the split ``/metrics`` and
        ``deepinfer status`` show (``"kv"`` for one pool; ``"full"`` and ``"window"`` with windows)."""

    @property
    @abc.abstractmethod
    def cached(self) -> dict[int, int]:
        """Block hash -> logical block id of every published block (what KV events announce)."""

    event_sink: EventSink | None   # hears every change of ``cached`` (set before stepping starts)

    # -- the scheduler's verbs ---------------------------------------------------------------------
    @abc.abstractmethod
    def get_computed_blocks(self, request: Request, q0: int | None = None) -> tuple[Sized, int]:
        """Longest usable prefix hit ``(hits, num_tokens)``; at least one token is left to compute. ``q0``: the
        first position a query will compute after the hit (an import that writes past the hit itself)."""

    @abc.abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, hits: Sized = (),
                       q0: int | None = None) -> list[int] | None:
        """Room for ``num_new_tokens`` after ``request.num_computed_tokens`` plus ``hits``: the new logical block
        ids, or ``None`` (no room; nothing changed)."""

    @abc.abstractmethod
    def has_room(self, request: Request, total: int) -> bool:
        """Whether the request could grow to ``total`` tokens now."""

    @abc.abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block of the request (idempotent); published blocks stay cached until evicted."""

    @abc.abstractmethod
    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks beyond those holding the request's first ``num_tokens`` tokens (rejected drafts)."""

    @abc.abstractmethod
    def publish_computed(self, request: Request, num_tokens: int) -> None:
        """Publish the full blocks among the request's first ``num_tokens`` tokens (KV computed)."""

    @abc.abstractmethod
    def withdraw_uncomputed(self, request: Request, num_tokens: int) -> None:
        """Take out of the prefix cache the request's blocks published for this step beyond the full blocks of
        its first ``num_tokens`` tokens (``allocate_slots`` publishes a step's blocks before the step writes their
        KV): for a request leaving the step after its allocation (preempted for a more urgent one)."""

    # -- tables and the prefix cache ---------------------------------------------------------------
    @abc.abstractmethod
    def block_ids(self, request_id: str) -> list[int]:
        """The request's logical block table."""

    @abc.abstractmethod
    def block_tables(self, request_id: str) -> list[list[int]]:
        """One block table per KV group (what attention reads), logical one first."""

    @abc.abstractmethod
    def group_block_ids(self, request_id: str, ids: list[int], next_query: int | None = None) -> list[list[int]]:
        """Per group, the blocks holding the request's logical blocks ``ids`` (from its table); with
        ``next_query``, a group whose rows no query from that position on can see names its null block instead."""

    @abc.abstractmethod
    def cached_prefix(self, request: Request) -> int:
        """How many leading blocks the hit rule would reuse now (read-only: no stats)."""

    @abc.abstractmethod
    def import_cached(self, request: Request, first: int, count: int, has_window: list[bool]) -> ImportedBlocks:
        """Make room for the request's blocks ``[first, first + count)`` computed elsewhere (``has_window[j]``:
        block ``first + j`` carries its window rows) and publish them as free cached blocks; the caller writes
        ``rows`` before the next step. Never evicts the request's own cached prefix."""

    @abc.abstractmethod
    def accepts(self, has_window: list[bool] | None) -> bool:
        """Whether a payload whose blocks carry window rows as ``has_window`` says (None: all) can be written
        whole into this layout (a running request's KV; otherwise it is recomputed)."""

    @abc.abstractmethod
    def refuse(self, total: int) -> str | None:
        """Why a request of ``total`` tokens could never run in this layout, or None."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (after a failed step left KV contents undefined)."""
