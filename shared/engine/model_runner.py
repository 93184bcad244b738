"""Turns a ``SchedulerOutput`` into one forward pass over the paged KV cache and samples next tokens.

Batch layout: single-token chunks first (decode attention over the block table), then multi-token chunks
(prefill attention). A request verifying ``k`` drafted tokens runs as ``k + 1`` decode rows over its block
table (row ``i`` with context ``start + i + 1``): exactly the attention plain decoding computes for those
positions, through the fast decode kernel. Logits are computed only for requests whose chunk reaches the end
of their known tokens (``ScheduledRequest.samples``): one row, or the ``k + 1`` rows checked by
``spec_verify.verify``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from shared.model.attention import AttentionMetadata, PrefillChunk
from kernels import cascade_attention, cpu_paged_attention
from shared.model import kv_cache
from shared.engine.kv_manager import KVManager
from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.grammar import Grammars, apply as apply_grammar
from shared.engine.sampler import sample
from shared.engine.spec_verify import verify
from shared.engine.scheduler import SchedulerOutput
from shared.logprobs import Logprobs, of_tokens
from shared.model.deepseek_v4 import V4Chunk
from shared.model.llama import LlamaModel
from shared.model.v4_state import V4SequenceState


class Sampled(NamedTuple):
    """One step's samples: ``tokens[request_id]`` its new tokens; ``logprobs[request_id]`` theirs, for requests
    with ``Sampling.logprobs``; with a model that keeps its hidden states (``keep_hidden``, for an MTP drafter)
    ``hidden[request_id] = (first position, [n, hidden] rows)`` of every token the step computed for it."""
    tokens: dict[str, list[int]]
    logprobs: dict[str, Logprobs]
    hidden: dict[str, tuple[int, torch.Tensor]] | None = None


def _decode_like(s) -> bool:
    """A plain decode, or a verification of drafted tokens right after the pending one: every row attends the
    paged cache through the decode kernel (its KV, drafts included, is stored before attention runs)."""
    req = s.request
    return s.num_new_tokens == 1 or (bool(req.spec_token_ids) and req.num_computed_tokens == req.num_tokens - 1
                                      and s.num_new_tokens == len(req.spec_token_ids) + 1)


class ModelRunner:
    def __init__(self, model: LlamaModel, block_manager: KVManager, grammars: Grammars | None = None) -> None:
        self.model, self.bm, self.grammars = model, block_manager, grammars
        self._eos = tuple(model.config.eos_token_ids)
        if model.device.type == "cpu":
            cpu_paged_attention.load()  # build/load now, not inside the first decode step
        # kv_cache: [num_blocks, L, 2, kvh, block_size, D], or one pool per KV group (shared/model/kv_cache.py);
        # None for a layout of per-sequence states (no pools: DeepSeek V4, shared/engine/v4_kv.py)
        self.num_groups = len(block_manager.pool_sizes)
        self.kv_cache: kv_cache.KVCache | None = kv_cache.allocate_pools(
            block_manager.pool_sizes, model.config, block_manager.block_size, model.dtype, model.device) \
            if self.num_groups else None
        self._cascade = cascade_attention.available(model.device, model.dtype)
        self.graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, max_blocks: int, max_batch: int, capture: bool) -> None:
        """Run pure decode steps of up to ``max_batch`` rows through ``DecodeGraphs`` (captured when
        ``capture``, else its padded path eagerly). Cascade attention is a per-step choice a graph cannot
        replay: graph-eligible steps never use it. With KV groups every group has its own slots and tables."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.bm.block_size, max_blocks, max_batch, capture,
                                   num_groups=self.num_groups)
        self.graphs.capture_all()

    def _prepare(self, out: SchedulerOutput):
        """Inputs of one step. Per KV group (one, or full + window: ``KVManager.block_tables``), the rows' slots, decode
        block tables and prefill chunk tables; ``meta`` is one ``AttentionMetadata`` or one per group."""
        bs, device = self.bm.block_size, self.model.device
        ordered = sorted(out.scheduled, key=lambda s: not _decode_like(s))  # stable: decodes first
        ngroups = self.num_groups
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[list[np.ndarray]] = [[] for _ in range(ngroups)]
        decode_tables: list[list[list[int]]] = [[] for _ in range(ngroups)]
        decode_lens: list[int] = []
        prefills: list[list[PrefillChunk]] = [[] for _ in range(ngroups)]
        logits_rows: list[int] = []
        sampled: list = []
        scored: list[tuple] = []   # (request, first prompt entry, rows): prompt logprobs this step
        spans: list[tuple[str, int, int, int]] = []   # (request id, first position, first row, rows)
        for s in ordered:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            pos = np.arange(start, start + n, dtype=np.int64)
            positions.append(pos)
            row0 = len(ids)
            spans.append((req.request_id, start, row0, n))
            tokens = req.all_token_ids + req.spec_token_ids if req.spec_token_ids else req.all_token_ids
            ids.extend(tokens[start:start + n])
            decode = _decode_like(s)
            if decode:  # one decode row per token (a verification: row i sees positions <= start + i)
                decode_lens.extend(range(start + 1, start + n + 1))
            for g, table in enumerate(self.bm.block_tables(req.request_id)):
                slots[g].append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
                if decode:
                    decode_tables[g].extend([table] * n)
                else:
                    num_blocks = -(-(start + n) // bs)
                    prefills[g].append(PrefillChunk(row0, row0 + n, start + n, torch.tensor(
                        table[:num_blocks], dtype=torch.long, device=device)))
            if s.samples:
                k = len(req.spec_token_ids)
                logits_rows.extend(range(row0 + n - 1 - k, row0 + n))
                sampled.append(req)
            lps = req.prompt_logprobs
            if lps is not None and req.num_output_tokens == 0:
                # entry e scores prompt token e + 1 from position e's logits; a recompute skips scored ones
                first, end = max(start, len(lps)), min(start + n, req.num_prompt_tokens - 1)
                if first < end:
                    scored.append((req, first, range(row0 + first - start, row0 + end - start)))
        if not ngroups:
            meta = self._state_chunks(ordered, spans)
        metas = []
        for g in range(ngroups):
            width = max((len(t) for t in decode_tables[g]), default=0)
            tables = np.zeros((len(decode_tables[g]), width), dtype=np.int32)
            for i, t in enumerate(decode_tables[g]):
                tables[i, :len(t)] = t
            metas.append(AttentionMetadata(
                slot_mapping=torch.from_numpy(np.concatenate(slots[g])).to(device),
                num_decode=len(decode_tables[g]),
                decode_block_tables=torch.from_numpy(tables).to(device),
                decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
                prefills=prefills[g], block_size=bs,
                decode_cascade=cascade_attention.find_shared_prefixes(tables, np.asarray(decode_lens), bs, device)
                if self._cascade and self.graphs is None and g == 0 else None))
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(device)
        num_sample_rows = len(logits_rows)
        for _, _, score_rows in scored:
            logits_rows.extend(score_rows)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
        if ngroups:
            meta = metas[0] if ngroups == 1 else metas
        return input_ids, pos_t, meta, rows, sampled, scored, num_sample_rows, spans

    def _state_chunks(self, ordered, spans) -> list[V4Chunk]:
        """A state layout's batch: each request's rows as a chunk of its state, split at the last block boundary
        the step crosses inside it, where the model snapshots the state for the prefix cache (a boundary at
        the chunk's end snapshots the whole chunk). Within the prompt the boundary stays before its last token:
        the snapshot a repeat of the prompt can hit (a hit leaves one token to compute)."""
        bs, chunks = self.bm.block_size, []
        for s, (_, start, row0, n) in zip(ordered, spans):
            req = s.request
            state = self.bm.state_of(req.request_id)
            if req.spec_token_ids:   # a verification: a state after every row, to roll back to
                marks = [V4SequenceState() for _ in range(n)]
                chunks += [V4Chunk(state, row0 + j, row0 + j + 1, mark) for j, mark in enumerate(marks)]
                continue
            boundary = (min(start + n, req.num_prompt_tokens - 1) if start < req.num_prompt_tokens
                        else start + n) // bs * bs
            if not self.bm.enable_caching or boundary <= start:
                chunks.append(V4Chunk(state, row0, row0 + n))
                continue
            cut = row0 + boundary - start
            chunks.append(V4Chunk(state, row0, cut, V4SequenceState()))
            if cut < row0 + n:
                chunks.append(V4Chunk(state, cut, row0 + n))
        return chunks

    def _graph_step(self, meta, num_rows: int) -> bool:
        """Whether a step is a pure decode the decode graphs hold (every row sampled, batch and table fit)."""
        m = meta[0] if isinstance(meta, list) else meta
        return (not m.prefills and num_rows == m.num_decode <= self.graphs.max_batch
                and m.decode_block_tables.shape[1] <= self.graphs.max_blocks)

    def execute(self, out: SchedulerOutput) -> Sampled:
        """Run one step; ``Sampled.tokens``: ``{request_id: new tokens}`` for requests that reached a sample point
        (one sampled token, or a speculating request's accepted drafts plus one target token), with their
        ``logprobs`` where asked; prompt logprobs are appended to the requests' ``prompt_logprobs``."""
        keep_hidden = getattr(self.model, "keep_hidden", False)
        result = Sampled({}, {}, {} if keep_hidden else None)
        if not out.scheduled:
            return result
        input_ids, positions, meta, rows, sampled, scored, num_sample_rows, spans = self._prepare(out)
        if self.kv_cache is None:   # per-sequence states: meta is the step's V4Chunks
            logits = self.model.forward(input_ids, positions, meta, rows)  # [S, V]
            by_state = {id(self.bm.state_of(s.request.request_id)): s.request for s in out.scheduled}
            for ch in meta:
                if ch.snapshot is not None:
                    req = by_state[id(ch.state)]
                    if req.spec_token_ids:
                        self.bm.mark(req.request_id, ch.snapshot)
                    self.bm.checkpoint(req, ch.snapshot)
        elif self.graphs is not None and not scored and not keep_hidden and self._graph_step(meta, len(rows)):
            # pure decode (drafts being verified included): every row's logits, in row order
            metas = meta if isinstance(meta, list) else [meta]
            logits = self.graphs.run(input_ids, positions, [g.slot_mapping for g in metas],
                                     [g.decode_block_tables for g in metas], metas[0].decode_context_lens)
        else:
            logits = self.model.forward(input_ids, positions, meta, self.kv_cache, rows)  # [S, V]
        if keep_hidden:
            hidden = self.model.last_hidden  # [T, hidden]
            result.hidden.update({rid: (start, hidden[row0:row0 + n]) for rid, start, row0, n in spans})
        row = num_sample_rows
        for req, first, score_rows in scored:    # rows after the sample rows, in order
            targets = req.prompt_token_ids[first + 1:first + 1 + len(score_rows)]
            req.prompt_logprobs.extend(of_tokens(logits[row:row + len(score_rows)], targets,
                                                 req.params.prompt_logprobs, ranks=True))
            row += len(score_rows)
        if not sampled:
            return result
        logits = logits[:num_sample_rows]
        tokens_of: dict[str, list[int]] = result.tokens
        plain, plain_rows, row, first_row = [], [], 0, {}
        for req in sampled:
            k = len(req.spec_token_ids)
            first_row[req.request_id] = row
            if k:
                rows = logits[row:row + k + 1]
                if req.params.structured is not None:
                    rows = apply_grammar(rows, self.grammars.allowed(req, req.spec_token_ids))
                tokens_of[req.request_id] = verify(rows, req.spec_token_ids, req.params,
                                                req.generator, req.prompt_token_ids,
                                                req.output_token_ids if req.params.processes_logits else (),
                                                self._eos)
            else:
                plain.append(req)
                plain_rows.append(row)
            row += k + 1
        if plain:
            rows_t = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
            plain_logits = logits[rows_t] if len(plain) < len(sampled) else logits
            constrained = [i for i, r in enumerate(plain) if r.params.structured is not None]
            if constrained:   # masked on a copy: logprobs stay the raw distribution's
                at = torch.tensor(constrained, dtype=torch.long, device=logits.device)
                plain_logits = plain_logits.clone()
                plain_logits[at] = apply_grammar(plain_logits[at], torch.cat([self.grammars.allowed(plain[i])
                                                                              for i in constrained]))
            tokens = sample(plain_logits,
                            [r.params for r in plain], [r.generator for r in plain],
                            [r.prompt_token_ids for r in plain],   # histories only where a processor reads them
                            [r.output_token_ids if r.params.processes_logits else () for r in plain], self._eos)
            tokens_of.update({r.request_id: [t] for r, t in zip(plain, tokens)})
        for req in sampled:
            if req.params.logprobs is not None:
                got, row = tokens_of[req.request_id], first_row[req.request_id]
                result.logprobs[req.request_id] = of_tokens(logits[row:row + len(got)], got, req.params.logprobs)
        return result
