"""Collision-proof hits (shared/kv/block_hash.py): the 64-bit keys the caches index may collide, but a block is
served only when its full chained digest (every earlier token, the model fingerprint, the salt) and its tokens
match. Collisions are forced by narrowing the key to 1 bit (``KEY_MASK``) or to nothing (every key 0)."""
import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import Request
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from shared.kv import block_hash
from shared.kv.block_hash import DIGEST_BYTES, BlockChain, block_key, chain_digests, hash_prompt_blocks
from services.cache_tier.store import FakeClock, StoreConfig, StoredBlock, TieredBlockStore
from services.cache_tier.store import record
from shared import protocol, subjects
from tests.tiny_model import tiny_model

BS = 4
FP, OTHER_FP = "a" * 32, "b" * 32
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def colliding_prefixes(fp: str = FP) -> tuple[list[int], list[int], list[int]]:
    """Blocks ``a0 != b0`` and ``c`` such that under 1-bit keys the chains ``a0 + c`` and ``b0 + c`` have equal keys
    block by block (what a 64-bit collision of two first blocks does to every later block of the two chains), and
    the key of ``b0 + c``'s second block differs from its first (so both can be cached at once)."""
    c = [7, 8, 9, 10]
    for i in range(1, 128):
        a0, b0 = [i, 1, 2, 3], [i, 4, 5, 6]
        kx = [block_key(d) for d in chain_digests(a0 + c, BS, fp)]
        ky = [block_key(d) for d in chain_digests(b0 + c, BS, fp)]
        if kx == ky and ky[0] != ky[1]:
            return a0, b0, c
    raise AssertionError("no colliding prefixes found")


def test_the_digest_chains_the_prefix_the_model_and_the_salt():
    tokens = list(range(12))
    d = chain_digests(tokens, BS, FP)
    assert [len(x) for x in d] == [DIGEST_BYTES] * 3 and hash_prompt_blocks(tokens, BS, FP) == [block_key(x) for x in d]
    assert chain_digests(tokens + [99], BS, FP, done=d[:1]) == d                        # incremental = from scratch
    other_prefix = chain_digests([50] + tokens[1:], BS, FP)
    assert other_prefix[1] != d[1] and other_prefix[2] != d[2]                        # same tokens, other prefix
    assert not set(chain_digests(tokens, BS, OTHER_FP)) & set(d)                       # another model build
    assert not set(chain_digests(tokens, BS, FP, "tenant")) & set(d)                   # another tenant
    chain = BlockChain.of(FP, d)
    assert chain[1:].keys == tuple(block_key(x) for x in d[1:]) and chain[1:].packed_digests() == b"".join(d[1:])


def test_device_cache_never_serves_a_block_of_another_prefix_under_a_colliding_hash(monkeypatch):
    monkeypatch.setattr(block_hash, "KEY_MASK", 1)
    a0, b0, c = colliding_prefixes()
    bm = BlockManager(num_blocks=16, block_size=BS)

    def run(rid: str, tokens: list[int]) -> Request:
        req = Request(rid, tokens, PARAMS, block_size=BS, model_fingerprint=FP)
        hits, _ = bm.get_computed_blocks(req)
        bm.allocate_slots(req, req.num_tokens - len(hits) * BS, hits)
        bm.free(rid)
        return req

    y0 = run("y0", b0 + [1])           # caches b0 under key k0
    x = run("x", a0 + c + [1])         # a0 collides with b0 (not cached: k0 is taken); a0+c's block 1 is cached
    y = Request("y", b0 + c + [1], PARAMS, block_size=BS, model_fingerprint=FP)
    assert y.block_hashes == x.block_hashes and y0.block_hashes[0] == y.block_hashes[0]
    colliding = bm.blocks[bm.cached[y.block_hashes[1]]]
    # what a check of (parent hash, tokens) would have accepted: same key, same parent key, same tokens
    assert colliding.key[1] == tuple(c) and colliding.key[0] == x.block_digests[1] != y.block_digests[1]
    hits, num_tokens = bm.get_computed_blocks(y)
    assert hits == [bm.cached[y.block_hashes[0]]] and num_tokens == BS   # b0 only: a0+c's block is not served


def test_engine_output_is_exact_under_colliding_hashes(monkeypatch):
    """End to end on a tiny model: after the other prefix's block was cached under a colliding hash, the
    engine recomputes it, and greedy output equals an engine without a prefix cache."""
    monkeypatch.setattr(block_hash, "KEY_MASK", 1)
    model = tiny_model(seed=9)
    cfg = dict(block_size=BS, num_kv_blocks=32, max_num_batched_tokens=32)
    eng = LLMEngine(model, EngineConfig(**cfg))
    a0, b0, c = colliding_prefixes(eng.fingerprint)
    expected = LLMEngine(model, EngineConfig(enable_prefix_caching=False, **cfg)).generate([b0 + c + [1]], PARAMS)
    one = SamplingParams(max_tokens=1, temperature=0)             # no generated token completes a block
    eng.generate([b0 + [1]], one)
    eng.generate([a0 + c + [1]], one)
    rid = eng.add_request(b0 + c + [1], PARAMS)
    got, cached = [], None
    while eng.has_unfinished():
        for out in eng.step():
            got += out.new_token_ids
            cached = out.num_cached_tokens if out.finished else cached
    assert [got] == expected and cached == BS, rid


async def test_tier_store_never_serves_another_prefix_or_build_under_a_colliding_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(block_hash, "KEY_MASK", 0)                   # every key is 0
    c = [7, 8, 9, 10]
    x1 = chain_digests([1, 2, 3, 4] + c, BS, FP)[1]
    y1 = chain_digests([5, 6, 7, 8] + c, BS, FP)[1]
    z1 = chain_digests([1, 2, 3, 4] + c, BS, OTHER_FP)[1]             # the same tokens under another build
    stored = StoredBlock(0, c, "uint8", [8], bytes(range(8)), digest=x1, fingerprint=FP)
    config = StoreConfig(directory=str(tmp_path / "kv"), dram_bytes=1 << 20, ssd_bytes=1 << 20,
                         segment_bytes=64 << 10, max_block_bytes=16 << 10)
    async with await TieredBlockStore.open(config, FakeClock()) as store:
        await store.put(stored, "chat")
        assert await store.get(0, c, "chat", y1, FP) is None          # another prefix: refused
        assert await store.get(0, c, "chat", z1, OTHER_FP) is None    # another build: refused
        assert await store.get(0, c, "chat", x1, OTHER_FP) is None
        assert await store.get(0, c, "chat") is None                  # a get naming no identity
        assert await store.get(0, c, "chat", x1, FP) == stored
        assert store.stats()["dram_identity_mismatches"] == 4
    async with await TieredBlockStore.open(config, FakeClock()) as store:   # the directory kept: from SSD
        assert await store.get(0, c, "chat", y1, FP) is None and await store.get(0, c, "chat", z1, OTHER_FP) is None
        assert store.stats()["ssd_identity_mismatches"] == 2
        assert await store.get(0, c, "chat", x1, FP) == stored


def test_records_written_before_identities_decode_to_a_block_no_digest_get_matches():
    """An SSD record of the old format (3-item meta: no digest, no fingerprint) still decodes, as a block with
    an empty identity, which a worker's get (always naming both) never matches."""
    import msgpack
    import zlib

    from shared.retention import BlockMeta

    block = StoredBlock(42, [1, 2], "uint8", [4], b"abcd")
    meta_bytes = msgpack.packb([[1, 2], "uint8", [4]])
    body_crc = zlib.crc32(block.payload, zlib.crc32(meta_bytes, 42))
    old = b"".join((record._prefix(record.KIND_BLOCK, 42, BlockMeta("chat", 1e9, 0.0), len(meta_bytes), 4),
                    meta_bytes, block.payload, record._U32.pack(body_crc)))
    decoded, _ = record.decode_block(old, 42, 1 << 20)
    assert decoded == block and decoded.digest == b"" and decoded.fingerprint == ""
    assert not decoded.matches([1, 2], bytes(DIGEST_BYTES), FP)
    new, _ = record.decode_block(record.encode_block(StoredBlock(42, [1, 2], "uint8", [4], b"abcd", b"d" * 32, FP),
                                                     BlockMeta("chat", 1e9, 0.0)), 42, 1 << 20)
    assert new.digest == b"d" * 32 and new.fingerprint == FP


def test_cache_messages_refuse_keys_that_are_not_their_digests():
    d = chain_digests(list(range(8)), BS, FP)
    keys = [block_key(x) for x in d]
    base = dict(transfer_id="t-1", worker_id="w-1", retention="chat", block_hashes=keys, token_ids=list(range(8)),
                block_size=BS, dtype="float32", block_shape=[2, 4], transports=["stream"])
    get = protocol.CacheGet(**base, block_digests=b"".join(d), model_fingerprint=FP)
    assert get.digests() == d and protocol.decode(protocol.encode(get), protocol.CacheGet) == get
    bad = [dict(block_digests=b"".join(reversed(d)), model_fingerprint=FP),   # keys not the digests'
           dict(block_digests=b"".join(d)[:-1], model_fingerprint=FP),        # truncated
           dict(block_digests=b"".join(d)),                                   # a digest without a build
           dict(model_fingerprint=FP),                                        # a build without digests
           dict(block_digests=b"".join(d), model_fingerprint="not-hex")]
    for fields in bad:
        with pytest.raises(DeepinferError) as err:
            protocol.CacheGet(**base, **fields)
        assert err.value.code == ErrorCode.INVALID_REQUEST, fields
    assert protocol.CacheGet(**base).digests() == [b""] * 2                      # no identity: a namespace of its own


async def test_a_tier_reply_of_another_build_is_never_fetched():
    """Defence in depth: a tier (an older or faulty one) that stages blocks of another build than the get named
    is refused (``model_mismatch``, counted as a failed pull) before anything is fetched."""
    import time
    from types import SimpleNamespace

    from services.worker.tier_client import TierClient

    class FakeNats:
        def __init__(self, reply):
            self.reply, self.published = reply, []

        async def request(self, subject, data, timeout):
            self.asked = protocol.decode(data, protocol.CacheGet)
            return SimpleNamespace(data=protocol.encode(self.reply))

        async def publish(self, subject, data):
            self.published.append(subject)

    class NoFetch:
        async def fetch(self, handle, timeout):
            raise AssertionError("fetched blocks of another build")

    chain = BlockChain.of(FP, chain_digests(list(range(12)), BS, FP))
    for served in (OTHER_FP, ""):
        nc = FakeNats(protocol.CacheGetReply(num_blocks=2, dram_blocks=2, transport="stream", handle={"t": 1},
                                             model_fingerprint=served))
        client = TierClient(nc, "w-1", "cache-0", "h", {"stream": NoFetch()})
        client._tier = SimpleNamespace(draining=False, transports=["stream"], host="h")
        client._tier_seen = time.monotonic()
        assert await client.pull(0, chain, list(range(12)), BS, [2, 4], "float32", "", "chat") is None
        assert nc.asked.model_fingerprint == FP and nc.asked.digests() == list(chain.digests)
        assert client.counters.pull_failures == 1 and nc.published == [subjects.cache("release", "cache-0")]


async def test_a_prompt_longer_than_one_get_or_put_is_pulled_in_part_and_never_fails_its_request(monkeypatch):
    """A context of more blocks than a CacheGet/CachePut carries (``MAX_TIER_BLOCKS``: a 77K-token prompt at block
    size 16 had 4,812 blocks against 4,096, and the request failed with invalid_request): the pull asks for the
    first ``MAX_TIER_BLOCKS`` blocks (the rest is computed), a write-back of such a run is dropped and counted."""
    import time
    from types import SimpleNamespace

    import torch

    from services.worker import tier_client as tc

    monkeypatch.setattr(tc, "MAX_TIER_BLOCKS", 2)

    class RecordingNats:
        async def request(self, subject, data, timeout):
            self.asked = protocol.decode(data, protocol.CacheGet)
            return SimpleNamespace(data=protocol.encode(protocol.CacheGetReply(num_blocks=0)))

    nc = RecordingNats()
    client = tc.TierClient(nc, "w-1", "cache-0", "h", {"stream": object()})
    client._tier = SimpleNamespace(draining=False, transports=["stream"], host="h")
    client._tier_seen = time.monotonic()
    prompt = list(range(24))
    chain = BlockChain.of(FP, chain_digests(prompt, BS, FP))  # 6 blocks
    assert await client.pull(1, chain, prompt, BS, [2, 4], "float32", "", "chat") is None
    assert nc.asked.block_hashes == list(chain.keys[1:3]) and nc.asked.token_ids == prompt[4:12]
    kv = torch.zeros(8, 2, 4)
    assert not await client.write_back(kv, [0, 1, 2], chain[:3], prompt[:12], BS, "", "chat")
    assert client.counters.writes_dropped == 1
