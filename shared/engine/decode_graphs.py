"""Decode steps replayed as CUDA graphs: one captured forward pass per batch-size bucket.

A decode step on a GPU launches ~10 kernels per layer, each a few microseconds of work; launching them from
Python costs more than running them. Capturing the whole forward pass once per batch size and replaying it
removes that overhead (vLLM and SGLang do the same).

Invariants:
  * Only pure decode steps use it: every row one new token, its logits wanted (no prefill chunks, no drafted
    tokens to verify, no cascade groups). Anything else runs eagerly.
  * A step of ``n`` rows runs in the smallest bucket ``b >= n``; rows ``n..b-1`` are padding: slot ``-1``
    (the KV store skips it), context length 1 over block 0 (read, never written), token 0 at position 0.
    Padding rows therefore never touch another sequence's cache, and their logits are dropped.
  * Inputs live in static buffers sized for the largest bucket; a replay reads them where the capture did.
    Block tables are ``max_blocks`` wide (the model's context length in blocks), so any sequence fits.
  * With KV groups (``shared/engine/hybrid_kv.py``) every group has its own slot and table buffers; padding
    rows read block 0 of each group (the window group's null block) and write nothing.
  * ``capture=False`` runs the very same padded, static-buffer forward pass eagerly: the path the CPU tests
    check token for token, and the fallback when a capture fails.
"""
from __future__ import annotations

import logging

import torch

from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaModel

logger = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (and ``max_batch``)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, max_blocks: int,
                 max_batch: int, capture: bool, num_groups: int = 1) -> None:
        self.model, self.kv_cache, self.block_size, self.max_blocks = model, kv_cache, block_size, max_blocks
        self.sizes = buckets(max_batch)
        self.capture = capture
        dev, top = model.device, self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)  # [top]
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)  # [top]
        self.slots = [torch.full((top,), -1, dtype=torch.long, device=dev)  # [top] per KV group
                      for _ in range(num_groups)]
        self.tables = [torch.zeros(top, max_blocks, dtype=torch.int32, device=dev)  # [top, max_blocks] per group
                       for _ in range(num_groups)]
        self.context_lens = torch.ones(top, dtype=torch.int32, device=dev)  # [top]
        self.rows = torch.arange(top, dtype=torch.long, device=dev)  # [top]: every row's logits
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> [bucket, V] logits written by its replay

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def _forward(self, b: int) -> torch.Tensor:  # [b, V]
        metas = [AttentionMetadata(slot_mapping=slots[:b], num_decode=b, decode_block_tables=tables[:b],
                                   decode_context_lens=self.context_lens[:b], prefills=[], block_size=self.block_size)
                 for slots, tables in zip(self.slots, self.tables)]
        meta = metas[0] if len(metas) == 1 else metas
        return self.model.forward(self.input_ids[:b], self.positions[:b], meta, self.kv_cache, self.rows[:b])

    def capture_all(self) -> None:
        """Capture every bucket, largest first, into one memory pool (CUDA only). On failure keep running
        eagerly: a decode step is never lost to a capture problem."""
        if not self.capture:
            return
        try:
            with torch.cuda.device(self.model.device):  # capture on the model's device, not the current one
                pool = torch.cuda.graph_pool_handle()
                for b in reversed(self.sizes):
                    self._forward(b)  # warm-up outside the graph: Triton compiles, allocator settles
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._outputs[b] = self._forward(b)
                    self._graphs[b] = graph
        except Exception as err:  # a capture or Triton compile error: decode eagerly rather than not start
            logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", err)
            self._graphs.clear()
            self._outputs.clear()
            self.capture = False
        else:
            logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: list[torch.Tensor],
            tables: list[torch.Tensor], context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of ``n = len(input_ids)`` rows (``n <= max_batch``) → logits ``[n, V]``.

        Per KV group: ``tables[g]: [n, w]`` int32 with ``w <= max_blocks`` and ``slots[g]: [n]``; the other
        inputs ``[n]``. The returned logits are the bucket's output buffer: read them before the next call."""
        n = len(input_ids)
        b = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        for buf, table_buf, src, table in zip(self.slots, self.tables, slots, tables):
            buf[:n].copy_(src)
            table_buf[:n, :table.shape[1]].copy_(table)
            buf[n:b].fill_(-1)
            table_buf[n:b].zero_()
        self.context_lens[:n].copy_(context_lens)
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.context_lens[n:b].fill_(1)
        graph = self._graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        with torch.cuda.device(self.model.device):
            graph.replay()
        return self._outputs[b][:n]
