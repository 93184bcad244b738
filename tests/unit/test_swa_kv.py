"""SWA-aware KV (shared/engine/hybrid_kv.py): a tiny float64 Gemma-3-shaped model (window 8, block size 4, five of
every six layers sliding) gives exactly the full-KV engine's greedy tokens while its window pool releases what no
query can see: batching, chunked prefill across window boundaries, prefix hits, preemption, speculative decoding,
migration, prefill hand-off and tier import (also across SWA-aware and full-KV engines: one wire format)."""
import dataclasses
import math

import pytest
import torch

from shared.kv import block_pack
from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.hybrid_kv import HybridBlockManager, pool_sizes
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import Request
from shared.sampling import SamplingParams
from shared.engine.speculator import SpecConfig, Speculator
from shared.errors import DeepinferError, ErrorCode
from shared.model.llama import LlamaModel
from tests.gemma_factory import gemma_config, gemma_weights
from tests.tiny_model import tiny_model
from tests.unit.test_spec_engine import OracleDrafter

BS, WINDOW = 4, 8
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 200 + 10 for i in range(n)] for j, n in ((1, 5), (2, 19), (3, 33), (4, 12))]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, window=WINDOW, num_layers=7)
    return LlamaModel(config, gemma_weights(config, seed=3, dtype=torch.float64), torch.float64, torch.device("cpu"))


def engine(model, swa=True, blocks=96, window_blocks=None, batched=64, caching=True) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_size=BS, num_kv_blocks=blocks, num_window_kv_blocks=window_blocks,
                                         max_num_batched_tokens=batched, swa_kv=swa, enable_prefix_caching=caching))


def run(eng, rid, until=None):
    got, last = [], None
    while eng.has_unfinished() and (until is None or len(got) < until):
        for o in eng.step():
            if o.request_id == rid:
                got += o.new_token_ids
                last = o
    return got, last


def staged(eng, rid, ids, next_query=None) -> tuple[torch.Tensor, int, bytes]:
    """``(payload, num_blocks, window_mask)``: what a transport would carry of the request's blocks ``ids``."""
    cache, rows, mask = eng.kv_port.source(rid, ids, next_query)
    return cache[torch.tensor(rows, dtype=torch.long)], len(ids), mask


def window_held(bm: HybridBlockManager, rid: str) -> int:
    return sum(1 for b in bm.window_block_ids(rid) if b != bm.win.null)


@pytest.fixture(scope="module")
def reference(model):
    return engine(model, swa=False).generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("batched", [64, 7, 3])
def test_batched_and_chunked_prefill_equal_full_kv(model, reference, batched):
    eng = engine(model, batched=batched)
    assert isinstance(eng.block_manager, HybridBlockManager)
    assert eng.generate(PROMPTS, GREEDY) == reference
    bm = eng.block_manager
    assert bm.full.num_free_blocks == bm.num_blocks and bm.win.num_free_blocks == bm.num_window_blocks


def test_window_blocks_are_released_and_stay_bounded(model):
    eng = engine(model, batched=8)
    params = dataclasses.replace(GREEDY, max_tokens=80)
    rids = [eng.add_request(p, params) for p in PROMPTS[1:3]]
    bm, peak = eng.block_manager, 0
    while eng.has_unfinished():
        eng.step()
        for rid in rids:
            req = eng.requests.get(rid)
            if req is not None and req.num_output_tokens >= 2:   # decoding (a decode step allocated since prefill)
                peak = max(peak, window_held(bm, rid))
                assert window_held(bm, rid) <= -(-WINDOW // BS) + 1
                assert len(bm.block_ids(rid)) >= req.num_computed_tokens // BS   # the full group keeps everything
    assert peak == -(-WINDOW // BS) + 1
    assert eng.generate(PROMPTS[1:3], params) == engine(model, swa=False).generate(PROMPTS[1:3], params)


def test_prefix_hits_same_prompt_and_shared_prefix(model, reference):
    eng, full = engine(model), engine(model, swa=False)
    for e in (eng, full):
        e.generate([PROMPTS[2]], GREEDY)
    shared = PROMPTS[2][:26] + [99, 98, 97]
    for prompt in (PROMPTS[2], shared, PROMPTS[2][:21]):
        outs = []
        for e in (eng, full):
            rid = e.add_request(prompt, GREEDY)
            outs.append(run(e, rid))
        assert outs[0][0] == outs[1][0]
        assert outs[0][1].num_cached_tokens > 0


def test_hit_rule_needs_the_window_blocks_the_next_query_sees():
    bm = HybridBlockManager(32, 8, BS, WINDOW)
    prompt = list(range(1, 26))   # 25 tokens: up to 6 full blocks reusable
    a = Request("a", prompt, GREEDY, block_size=BS, model_fingerprint="")
    assert bm.allocate_slots(a, 25) is not None   # all 7 window blocks (nothing computed yet)
    assert len(bm.win.free_queue) == 1
    bm.free("a")
    b = Request("b", prompt, GREEDY, block_size=BS, model_fingerprint="")
    hits, n = bm.get_computed_blocks(b)
    assert n == 24 and hits.window[:4] == [0] * 4 and 0 not in hits.window[4:]   # window of 24 needs blocks 4, 5
    del bm.win.cached[b.block_hashes[4]]           # the window group lost block 4: n = 6 and 5 fail
    hits, n = bm.get_computed_blocks(b)
    assert n == 16 and hits.window[:2] == [0, 0] and 0 not in hits.window[2:]
    assert bm.allocate_slots(b, 9, hits) is not None
    assert window_held(bm, "b") == 5 and len(bm.block_ids("b")) == 7   # blocks 2..6 of the window group


def test_a_request_the_window_pool_can_never_hold_is_refused_naming_it(model):
    eng = engine(model, blocks=96, window_blocks=4, batched=16)    # a 16-token chunk and its window: 7 blocks
    with pytest.raises(DeepinferError) as err:
        eng.add_request(PROMPTS[2], GREEDY)
    assert err.value.code == ErrorCode.PROMPT_TOO_LONG and "sliding-window KV pool of 4 blocks" in err.value.message
    assert not eng.has_unfinished()


def test_no_room_in_the_window_pool_changes_nothing():
    bm = HybridBlockManager(32, 3, BS, WINDOW)
    a = Request("a", list(range(1, 20)), GREEDY, block_size=BS, model_fingerprint="")
    free_full = bm.full.num_free_blocks
    assert bm.allocate_slots(a, 19) is None      # 5 window blocks needed, 3 in the pool
    assert bm.full.num_free_blocks == free_full and not bm.block_ids("a") and not bm.window_block_ids("a")
    assert bm.allocate_slots(a, 8) is not None and bm.usage == pytest.approx(2 / 3)


def test_preemption_under_a_small_window_pool(model, reference):
    eng = engine(model, blocks=40, window_blocks=12, batched=16)
    assert eng.generate(PROMPTS, GREEDY) == reference
    assert eng.num_preemptions > 0


def test_speculative_decoding_equals_full_kv(model, reference):
    spec = Speculator(OracleDrafter(PROMPTS, reference, wrong_every=3), SpecConfig(k=4))
    eng = engine(model, batched=24)
    eng.set_speculator(spec)
    assert eng.generate(PROMPTS, GREEDY) == reference
    assert 0 < spec.counters.accepted < spec.counters.drafted


@pytest.mark.parametrize("src_swa,dst_swa", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("after", [1, 6])
def test_migration_equals_full_kv(model, src_swa, dst_swa, after):
    prompt = PROMPTS[2]
    expected = engine(model, swa=False).generate([prompt], GREEDY)[0]
    src, dst = engine(model, swa=src_swa), engine(model, swa=dst_swa)
    src.add_request(PROMPTS[0], dataclasses.replace(GREEDY, max_tokens=40), "other")
    src.add_request(prompt, GREEDY, "x")
    got, _ = run(src, "x", until=after)
    moved = src.kv_port.detach("x")
    kv = src.kv_port.gather("x", moved.block_ids)            # [blocks, L, 2, kvh, bs, D]: the wire format
    assert list(kv.shape[1:]) == dst.kv_port.block_shape
    assert dst.kv_port.import_running("x", moved.prompt_token_ids, moved.output_token_ids, GREEDY, kv,
                              model_fingerprint=src.fingerprint)
    if dst_swa:
        assert window_held(dst.block_manager, "x") <= -(-WINDOW // BS) + 1   # only what the window still needs
    src.kv_port.drop_detached("x")
    assert got + run(dst, "x")[0] == expected


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_pre_copy_then_switch_equals_full_kv(model, packed):
    """The pre-copied run imported unpacked, or as it came off the wire (packed: written block by block)."""
    prompt = PROMPTS[2]
    expected = engine(model, swa=False).generate([prompt], GREEDY)[0]
    src, dst = engine(model), engine(model)
    src.add_request(prompt, GREEDY, "x")
    got, _ = run(src, "x", until=3)
    ids, tokens, salt = src.kv_port.full_blocks("x")
    payload, n, mask = staged(src, "x", ids, len(ids) * BS)   # a packed run: the released window rows stay home
    assert mask and payload.numel() < n * math.prod(src.kv_port.block_shape)
    if packed:
        kept = dst.kv_port.import_tier_blocks(tokens, salt, 0, payload, block_pack.decode_mask(mask, n))
    else:
        kept = dst.kv_port.import_tier_blocks(tokens, salt, 0, *dst.kv_port.unpack(payload, n, mask))
    assert kept == len(ids)
    got += run(src, "x", until=3)[0]
    assert src.kv_port.holds_blocks("x", ids)
    moved = src.kv_port.detach("x")
    tail = src.kv_port.gather("x", moved.block_ids[kept:])
    assert dst.kv_port.import_running("x", moved.prompt_token_ids, moved.output_token_ids, GREEDY, tail,
                              model_fingerprint=src.fingerprint, first_block=kept)
    src.kv_port.drop_detached("x")
    assert got + run(dst, "x")[0] == expected


@pytest.mark.parametrize("src_swa,dst_swa", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("prompt_len", [5, 8, 23, 33])
def test_handoff_equals_monolithic(model, src_swa, dst_swa, prompt_len):
    prompt = [(11 * i + 5) % 200 + 10 for i in range(prompt_len)]
    expected = engine(model, swa=False).generate([prompt], GREEDY)[0]
    src = engine(model, swa=src_swa, batched=8)
    rid = src.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=1), hold_kv=True)
    first = run(src, rid)[0][0]
    kv = src.kv_port.export_kv(rid)
    src.kv_port.release_held(rid)
    dst = engine(model, swa=dst_swa)
    assert dst.kv_port.import_prefilled("y", prompt, first, GREEDY, kv, model_fingerprint=src.fingerprint)
    assert [first] + run(dst, "y")[0] == expected


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("src_swa,max_tokens,cached", [(True, 1, 36), (False, 1, 36), (True, 20, 0), (False, 20, 36)])
def test_tier_import_is_an_exact_hit(model, src_swa, max_tokens, cached, packed):
    """A prefill worker's write-back (max_tokens 1) carries the window rows the prompt's end needs: a full hit. A
    decode worker's SWA-aware write-back after 20 more tokens lacks them (released: not sent): no hit (the import
    says so: 0 reusable blocks), still exact."""
    prompt = PROMPTS[2] + [5, 6, 7, 8, 9, 10, 11]   # 40 tokens: 9 reusable blocks
    expected = engine(model, swa=False).generate([prompt], GREEDY)[0]
    src = engine(model, swa=src_swa, batched=8)      # chunked: the early window rows are released (zeros)
    rid = src.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=max_tokens), hold_kv=True)
    run(src, rid)
    ids, chain, tokens = src.kv_port.tier_blocks(rid)
    payload, n, mask = staged(src, rid, ids)
    kv, has_window = src.kv_port.unpack(payload, n, mask)
    src.kv_port.release_held(rid)
    dst = engine(model)
    first, _ = dst.kv_port.missing_blocks(prompt)
    reusable = (len(prompt) - 1) // BS
    if packed:   # the whole run as fetched: blocks past the reusable ones are skipped
        assert payload.dim() == 5 or all(has_window)
        kept = dst.kv_port.import_tier_blocks(prompt, "", 0, payload, has_window)
    else:
        kept = dst.kv_port.import_tier_blocks(prompt, "", 0, kv[:reusable], has_window[:reusable])
    assert first == 0 and kept == cached // BS
    if cached:
        assert window_held(dst.block_manager, "none") == 0 and dst.kv_port.missing_blocks(prompt)[0] == 9
    rid = dst.add_request(prompt, GREEDY)
    got, last = run(dst, rid)
    assert got == expected and last.num_cached_tokens == cached


def test_model_without_windows_allocates_exactly_as_before():
    model = tiny_model(seed=3)
    prompts = [[t % 120 + 1 for t in p] for p in PROMPTS]
    runs = []
    for swa in (True, False):
        eng = LLMEngine(model, EngineConfig(block_size=BS, num_kv_blocks=64, swa_kv=swa))
        assert type(eng.block_manager) is BlockManager and isinstance(eng.kv_port.kv_cache, torch.Tensor)
        ids = [eng.add_request(p, GREEDY) for p in prompts]
        tables = []
        while eng.has_unfinished():
            eng.step()
            tables.append({r: list(eng.block_manager.block_ids(r)) for r in ids})
        runs.append(tables)
    assert runs[0] == runs[1]


def test_pool_split_and_load_report_the_fuller_pool(model):
    eng = LLMEngine(model, EngineConfig(block_size=BS, kv_cache_bytes=4 << 20, max_model_len=256))
    bm = eng.block_manager
    layer_bytes = 2 * BS * 2 * 16 * 8               # one layer's block: K and V, 2 kv heads, D 16, float64
    assert bm.num_blocks * layer_bytes + bm.num_window_blocks * layer_bytes * 6 <= 4 << 20   # 1 full, 6 window
    assert bm.num_window_blocks < bm.num_blocks
    rid = eng.add_request(PROMPTS[2], GREEDY)
    eng.step()
    assert bm.usage == max(bm.full.usage, bm.win.usage) and bm.win.usage > bm.full.usage
    assert bm.num_free_blocks == bm.num_blocks - math.ceil(bm.usage * bm.num_blocks - 1e-9)
    assert eng.abort(rid) and bm.usage == 0


def test_pool_sizes_reserve_a_step_of_window_blocks_only_where_windows_save():
    # 64-token sequences, window 8, block 4: 16 full blocks and 3 window blocks per sequence; bytes for ~10 of them
    full_b, win_b = 100, 600
    base = pool_sizes(10 * (16 * full_b + 3 * win_b), full_b, win_b, 64, 8, 4, 1)
    spiked = pool_sizes(10 * (16 * full_b + 3 * win_b), full_b, win_b, 64, 8, 4, 1, step_tokens=16)
    assert base == (160, 30)
    assert spiked[1] >= 5 + math.floor((10 * (16 * full_b + 3 * win_b) - 5 * win_b) / (16 * full_b + 3 * win_b) * 3)
    assert spiked[1] > base[1] and spiked[0] < base[0]                    # 16 / 4 + 1 blocks for a step's tokens
    assert spiked[0] * full_b + spiked[1] * win_b <= 10 * (16 * full_b + 3 * win_b)
    short = pool_sizes(10 * 2 * (full_b + win_b), full_b, win_b, 8, 8, 4, 1, step_tokens=16)  # context <= window
    assert short == pool_sizes(10 * 2 * (full_b + win_b), full_b, win_b, 8, 8, 4, 1)


@pytest.mark.parametrize("dst_swa", [True, False])
def test_packed_handoff_carries_only_the_window_rows_it_needs(model, dst_swa):
    """The hand-off's payload holds every block's full-attention rows and window rows only for the blocks the
    receiver's first query can see (fewer than the source still holds after chunked prefill); decoding after it
    equals the monolithic engine."""
    prompt = [(11 * i + 5) % 200 + 10 for i in range(39)]   # last chunk from 32: the window held from block 6
    expected = engine(model, swa=False).generate([prompt], GREEDY)[0]
    src = engine(model, batched=8)
    rid = src.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=1), hold_kv=True)
    first = run(src, rid)[0][0]
    ids, bm = src.kv_port.prompt_block_ids(rid), src.block_manager
    payload, n, mask = staged(src, rid, ids, len(prompt))
    held = [b != bm.win.null for b in bm.window_block_ids(rid)[:n]]
    seen = [held[j] and j >= bm.drop(len(prompt)) for j in range(n)]  # what the first decode query can see
    assert block_pack.decode_mask(mask, n) == seen and 0 < sum(seen) < sum(held)
    full, win = src.kv_port.full_layers, len(src.kv_port.window_layers)
    assert list(payload.shape) == [n * full + sum(seen) * win, *src.kv_port.block_shape[1:]]
    dst = engine(model, swa=dst_swa)
    kv, has_window = dst.kv_port.unpack(payload, n, mask)
    src.kv_port.release_held(rid)
    used = dst.kv_port.import_prefilled("y", prompt, first, GREEDY, kv, model_fingerprint=src.fingerprint,
                            has_window=has_window)
    assert used == dst_swa        # one pool: blocks without window rows are recomputed, not served whole later
    assert [first] + run(dst, "y")[0] == expected


@pytest.fixture(scope="module")
def model_window_7() -> LlamaModel:
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, window=7, num_layers=7)
    return LlamaModel(config, gemma_weights(config, seed=5, dtype=torch.float64), torch.float64, torch.device("cpu"))


@pytest.mark.parametrize("max_tokens", [17, 18, 19, 20])
@pytest.mark.parametrize("window", [8, 7])
def test_next_turn_hits_a_decode_write_back_whole(request, window, max_tokens):
    """A decode worker's write-back (whole conversation so far) holds the window rows a hit on all its full blocks
    needs, whatever the answer's length modulo the block size and whether the window is a multiple of it: the
    next turn reuses every full block, exactly."""
    model = request.getfixturevalue("model" if window == 8 else "model_window_7")
    prompt = PROMPTS[2] + [5, 6, 7, 8, 9, 10, 11]
    src = engine(model, batched=8)
    rid = src.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=max_tokens), hold_kv=True)
    answer = run(src, rid)[0]
    ids, _, _ = src.kv_port.tier_blocks(rid)
    kv, has_window = src.kv_port.unpack(*staged(src, rid, ids))
    assert not all(has_window)                        # the early window rows stay home
    src.kv_port.release_held(rid)
    turn = prompt + answer + [12, 13, 14]
    expected = engine(model, swa=False).generate([turn], GREEDY)[0]
    dst = engine(model)
    assert dst.kv_port.import_tier_blocks(turn, "", 0, kv, has_window) == len(ids) == (len(turn) - 4) // BS
    got, last = run(dst, dst.add_request(turn, GREEDY))
    assert got == expected and last.num_cached_tokens == len(ids) * BS


@pytest.mark.parametrize("with_reimport", [True, False])
def test_a_tier_import_evicted_while_its_request_waits_is_published_again(model, with_reimport):
    """A request's tier blocks are imported as free cached blocks when it is added; a long prefill running first
    reuses the small window pool's free blocks and evicts their window rows. With the import kept as the request's
    ``reimport`` the scheduler publishes it again before admitting it: still a full hit, same tokens (without, the
    hit is lost: what this guards)."""
    prompt = PROMPTS[2] + [5, 6, 7, 8, 9, 10, 11]   # 40 tokens: 9 reusable blocks
    other = [(11 * j) % 190 + 12 for j in range(60)]
    expected = engine(model, swa=False).generate([prompt], GREEDY)[0]
    src = engine(model)
    rid = src.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=1), hold_kv=True)
    run(src, rid)
    ids, _, _ = src.kv_port.tier_blocks(rid)
    kv, has_window = src.kv_port.unpack(*staged(src, rid, ids))
    dst = engine(model, window_blocks=7, batched=16)    # a chunk and its window need all 7
    reimport = lambda: dst.kv_port.import_tier_blocks(prompt, "", 0, kv[:9], has_window[:9])  # noqa: E731
    assert reimport() == 9
    dst.add_request(other, GREEDY, "other")
    for _ in range(4):                                  # the other prompt's prefill chunks cycle the window pool
        dst.step()
    assert dst.kv_port.missing_blocks(prompt)[0] < 9    # the import's window rows are gone
    rid = dst.add_request(prompt, GREEDY, "x", reimport=reimport if with_reimport else None)
    got, last = run(dst, rid)
    assert got == expected
    assert last.num_cached_tokens == (36 if with_reimport else 0)
