"""Block manager: exact block ids, reference counts, prefix hits and eviction order."""
from shared.engine.block_manager import BlockManager
from shared.engine.request import Request
from shared.sampling import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), block_size=BS, model_fingerprint="m", cache_salt=salt)


def admit(bm: BlockManager, r: Request) -> list[int]:
    hits, n = bm.get_computed_blocks(r)
    new = bm.allocate_slots(r, r.num_tokens - n, hits)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return hits


def test_allocation_ids_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))  # 2 full blocks + partial
    assert admit(bm, a) == []
    assert bm.block_ids("a") == [0, 1, 2]
    assert [bm.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    # same first 8 tokens: hits blocks 0 and 1, gets a fresh block for its own tail
    b = req("b", list(range(8)) + [99, 98, 97])
    assert admit(bm, b) == [0, 1]
    assert bm.block_ids("b") == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_hit_tokens == 8


def test_fully_cached_prompt_leaves_last_block_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(8)))
    admit(bm, a)
    bm.free("a")
    b = req("b", list(range(8)))
    hits, n = bm.get_computed_blocks(b)
    assert (hits, n) == ([0], 4)  # one token (in fact the whole last block) is recomputed for logits


def test_decode_growth_and_block_registration():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req("a", [1, 2, 3])
    admit(bm, a)
    a.append_token(4)  # block 0 becomes full
    assert bm.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert bm.cached == {a.block_hashes[0]: 0}
    a.append_token(5)
    assert bm.allocate_slots(a, 1) == [1]  # crosses into a new block


def test_eviction_order_unhashed_first_then_lru_tail_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(10)))  # blocks 0,1 hashed, 2 partial
    admit(bm, a)
    b = req("b", [50 + i for i in range(9)])  # blocks 3,4 hashed, 5 partial
    admit(bm, b)
    bm.free("a")
    bm.free("b")
    # unhashed partial blocks first (most recent first), then LRU: a's tail before a's head, then b's
    assert list(bm.free_queue) == [5, 2, 1, 0, 4, 3]
    c = req("c", [200 + i for i in range(12)])  # needs 3 blocks (12 tokens): takes 5, 2, 1
    admit(bm, c)
    assert bm.block_ids("c") == [5, 2, 1]
    assert a.block_hashes[1] not in bm.cached and bm.cached[c.block_hashes[2]] == 1  # evicted, re-hashed
    # a's second block was evicted; its first survives and is still a hit
    a2 = req("a2", list(range(10)))
    hits, n = bm.get_computed_blocks(a2)
    assert (hits, n) == ([0], 4)


def test_no_room_returns_none_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(8)))
    admit(bm, a)
    before = (list(bm.free_queue), dict(bm.cached), [b.ref_cnt for b in bm.blocks])
    big = req("big", list(range(100, 112)))
    assert bm.allocate_slots(big, 12) is None
    assert (list(bm.free_queue), dict(bm.cached), [b.ref_cnt for b in bm.blocks]) == before


def test_salt_and_token_comparison_prevent_false_hits():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, req("a", list(range(9)), salt="tenant-1"))
    other_tenant = req("b", list(range(9)), salt="tenant-2")
    assert bm.get_computed_blocks(other_tenant) == ([], 0)
    # forge a hash collision: same hash, different tokens -> token comparison rejects it
    forged = req("c", [7, 7, 7, 7, 1], salt="tenant-1")
    forged.block_hashes[0] = req("x", list(range(9)), salt="tenant-1").block_hashes[0]
    assert bm.get_computed_blocks(forged) == ([], 0)


def test_free_is_idempotent_and_shared_blocks_survive():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, req("a", list(range(9))))
    admit(bm, req("b", list(range(9))))
    bm.free("a")
    bm.free("a")
    assert [bm.blocks[i].ref_cnt for i in bm.block_ids("b")][:2] == [1, 1]
    bm.free("b")
    assert bm.num_free_blocks == 8
