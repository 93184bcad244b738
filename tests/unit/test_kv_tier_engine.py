"""The engine's cache-tier hooks: blocks written back by one engine and imported by a fresh one are prefix-cache
hits there (reported as cached tokens) and greedy output equals the cold engine's; the block manager stays
consistent."""
import dataclasses

import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.tiny_model import tiny_model

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BS = 8


def engine(model, blocks=64, caching=True):
    return LLMEngine(model, EngineConfig(block_size=BS, num_kv_blocks=blocks, max_num_batched_tokens=32,
                                         enable_prefix_caching=caching))


def run(eng, rid):
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def written_back(model, prompt):
    """Prefill ``prompt`` on a fresh engine (held), return (BlockChain, KV [n, *block]) of its computed full
    blocks: what a worker writes to the tier."""
    src = engine(model)
    rid = src.add_request(prompt, dataclasses.replace(PARAMS, max_tokens=1), hold_kv=True)
    run(src, rid)
    ids, hashes, tokens = src.kv_port.tier_blocks(rid)
    kv = src.kv_port.kv_cache[torch.tensor(ids)].clone()
    src.kv_port.release_held(rid)
    assert len(ids) == len(prompt) // BS and tokens == prompt[:len(ids) * BS]
    return hashes, kv


def assert_consistent(bm):
    held = {b for ids in bm.req_to_blocks.values() for b in ids}
    assert held.isdisjoint(bm.free_queue) and len(held) + len(bm.free_queue) == bm.num_blocks
    for h, bid in bm.cached.items():
        assert bm.blocks[bid].block_hash == h


def test_tier_import_is_a_prefix_hit_with_exact_greedy_output():
    model = tiny_model(seed=5)
    prompt = [(11 * i + 2) % 128 for i in range(45)]          # 5 full blocks; 5 reusable ((45-1)//8)
    expected, _ = run(e := engine(model), e.add_request(prompt, PARAMS))
    hashes, kv = written_back(model, prompt)
    dst = engine(model)
    first, want = dst.kv_port.missing_blocks(prompt)
    assert first == 0 and want == hashes[:5]
    assert dst.kv_port.import_tier_blocks(prompt, "", first, kv[first:len(want)]) == 5
    assert dst.kv_port.missing_blocks(prompt)[0] == 5
    assert_consistent(dst.block_manager)
    got, final = run(dst, dst.add_request(prompt, PARAMS))
    assert got == expected
    assert final.num_cached_tokens == 5 * BS


def test_import_after_a_local_prefix_keeps_it_and_fills_the_rest():
    model = tiny_model(seed=5)
    prompt = [(3 * i + 1) % 128 for i in range(41)]
    expected, _ = run(e := engine(model), e.add_request(prompt, PARAMS))
    hashes, kv = written_back(model, prompt)
    dst = engine(model, blocks=12)
    run(dst, dst.add_request(prompt[:17], dataclasses.replace(PARAMS, max_tokens=1)))   # 2 blocks cached here
    first, want = dst.kv_port.missing_blocks(prompt)
    assert first == 2 and len(want) == 5
    # the pool's 10 other free blocks get filled first; the cached prefix must survive the import
    assert dst.kv_port.import_tier_blocks(prompt, "", first, kv[first:5]) == 3
    assert dst.kv_port.missing_blocks(prompt)[0] == 5
    got, final = run(dst, dst.add_request(prompt, PARAMS))
    assert got == expected and final.num_cached_tokens == 5 * BS
    assert_consistent(dst.block_manager)


def test_import_never_evicts_held_blocks_and_stops_when_full():
    model = tiny_model(seed=5)
    prompt = [(5 * i + 7) % 128 for i in range(49)]
    hashes, kv = written_back(model, prompt)
    dst = engine(model, blocks=8)
    rid = dst.add_request(list(range(60, 100)), dataclasses.replace(PARAMS, max_tokens=2))
    dst.step()                                    # a 32-token chunk: 4 of 8 blocks held
    held = set(dst.block_manager.block_ids(rid))
    free = dst.block_manager.num_free_blocks
    assert len(held) == 4 and free == 4 < len(kv)
    assert dst.kv_port.import_tier_blocks(prompt, "", 0, kv) == free
    assert held == set(dst.block_manager.block_ids(rid))
    assert_consistent(dst.block_manager)


def test_salted_blocks_do_not_match_another_tenant():
    model = tiny_model(seed=5)
    prompt = [(7 * i) % 128 for i in range(33)]
    hashes, kv = written_back(model, prompt)        # tenant "" (no salt)
    dst = engine(model)
    first, want = dst.kv_port.missing_blocks(prompt, "tenant-b")
    assert first == 0 and set(want.keys).isdisjoint(hashes.keys) and set(want.digests).isdisjoint(hashes.digests)


def test_mismatched_block_layout_is_refused():
    model = tiny_model(seed=5)
    dst = engine(model)
    bad = torch.zeros(2, *dst.kv_port.kv_cache.shape[2:])
    try:
        dst.kv_port.import_tier_blocks([1] * 33, "", 0, bad)
    except Exception as err:
        assert "does not match" in str(err)
    else:
        raise AssertionError("a payload of the wrong layout was imported")
