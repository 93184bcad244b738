"""KVIndex: event streams, sequence gaps and resync, worker loss, longest-prefix overlap, tiers, LRU bound."""
import pytest

from shared.kv.block_hash import hash_prompt_blocks
from shared.protocol import KVEvent
from services.router.policy.kv_index import KVIndex

BS = 4


def chain(n: int, seed: int = 0, salt: str = "") -> list[int]:
    """Real chained hashes of an ``n``-block prompt; different seeds share no block."""
    return hash_prompt_blocks([seed * 100_000 + i for i in range(n * BS)], BS, "m", salt)


def ev(worker: str, seq: int, kind: str, hashes=(), tier: str = "device") -> KVEvent:
    return KVEvent(worker_id=worker, seq=seq, kind=kind, block_hashes=list(hashes), tier=tier)


P = chain(8)


def test_stored_and_removed_stream():
    idx = KVIndex()
    assert idx.apply(ev("w", 1, "stored", P[:4]))
    assert idx.overlap(P) == {"w": 4}
    assert idx.apply(ev("w", 2, "stored", P[4:6]))
    assert idx.overlap(P) == {"w": 6}
    assert idx.apply(ev("w", 3, "removed", P[5:6]))
    assert idx.overlap(P) == {"w": 5}
    assert idx.apply(ev("w", 4, "removed", [P[0], chain(1, seed=9)[0]]))  # unknown hash: ignored
    assert idx.overlap(P) == {}
    assert idx.stats() == {"entries": 4, "workers": 1, "evictions": 0, "gaps": 0, "resyncs": 0,
                           "needs_resync": 0}
    assert idx.last_seq("w") == 4 and idx.last_seq("nobody") is None


def test_duplicate_events_are_ignored():
    idx = KVIndex()
    assert idx.apply(ev("w", 1, "stored", P[:3]))
    assert idx.apply(ev("w", 2, "removed", P[2:3]))
    assert idx.apply(ev("w", 1, "stored", P[:3]))  # redelivered: must not resurrect P[2]
    assert idx.apply(ev("w", 2, "removed", P[:1]))  # redelivered seq with other content: still ignored
    assert idx.overlap(P) == {"w": 2}
    assert idx.last_seq("w") == 2 and not idx.needs_resync("w")


def test_first_event_of_an_unknown_worker_must_be_seq_1():
    idx = KVIndex()
    assert not idx.apply(ev("late", 7, "stored", P))  # joined mid-stream: earlier stores unknown
    assert idx.needs_resync("late") and idx.overlap(P) == {}


def test_gap_drops_entries_and_flags_resync():
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P[:5]))
    idx.apply(ev("b", 1, "stored", P[:3]))
    assert idx.apply(ev("a", 3, "stored", P[5:])) is False  # seq 2 was lost
    assert idx.needs_resync("a") and not idx.needs_resync("b")
    assert idx.workers_needing_resync() == ["a"]
    assert idx.overlap(P) == {"b": 3}  # a's entries can no longer be trusted
    assert idx.apply(ev("a", 4, "stored", P)) is False  # still flagged: ignored, caller retries the snapshot
    assert idx.overlap(P) == {"b": 3}
    s = idx.stats()
    assert (s["gaps"], s["needs_resync"], s["entries"]) == (1, 1, 3)


def test_resync_from_snapshot_then_continue():
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P[:2]))
    assert not idx.apply(ev("a", 5, "stored", P[6:]))
    idx.resync("a", 6, {"device": P[:4], "host": P[:7]})
    assert not idx.needs_resync("a") and idx.workers_needing_resync() == []
    assert idx.overlap(P) == {"a": 4} and idx.tier_overlap(P, "host") == 7
    assert idx.apply(ev("a", 6, "stored", P[4:])) is True  # covered by the snapshot: duplicate
    assert idx.overlap(P) == {"a": 4}
    assert idx.apply(ev("a", 7, "stored", P[4:6]))
    assert idx.overlap(P) == {"a": 6}
    assert idx.stats()["resyncs"] == 1 and idx.stats()["entries"] == 6 + 7


def test_resync_replaces_previous_state():
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P))
    idx.apply(ev("a", 2, "stored", P[:2], tier="disk"))
    idx.resync("a", 2, {"device": P[:1]})
    assert idx.overlap(P) == {"a": 1} and idx.tier_overlap(P, "disk") == 0
    assert idx.stats()["entries"] == 1


def test_worker_loss_drops_its_entries_and_sequence():
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P))
    idx.apply(ev("b", 1, "stored", P[:3]))
    idx.apply(ev("b", 2, "stored", P[:2], tier="host"))
    idx.remove_worker("b")
    idx.remove_worker("never-seen")  # no-op
    assert idx.overlap(P) == {"a": 8} and idx.tier_overlap(P, "host") == 0
    assert idx.stats()["workers"] == 1 and idx.stats()["entries"] == 8
    assert idx.apply(ev("b", 1, "stored", P[:1]))  # restarted worker starts over at seq 1
    assert idx.overlap(P) == {"a": 8, "b": 1}


def test_cleared_drops_only_that_tier():
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P))
    idx.apply(ev("a", 2, "stored", P, tier="host"))
    idx.apply(ev("b", 1, "stored", P[:2]))
    assert idx.apply(ev("a", 3, "cleared"))
    assert idx.overlap(P) == {"b": 2} and idx.tier_overlap(P, "host") == 8
    assert idx.apply(ev("a", 4, "cleared", tier="host"))
    assert idx.tier_overlap(P, "host") == 0 and idx.stats()["entries"] == 2


def test_overlap_is_longest_prefix_stopping_at_first_miss():
    idx = KVIndex()
    idx.apply(ev("w", 1, "stored", [P[0], P[1], P[3]]))
    assert idx.overlap(P) == {"w": 2}
    assert idx.overlap(P[2:]) == {}  # the first block (P2) is not held, P3 behind it does not count
    assert idx.overlap([]) == {}
    assert KVIndex().overlap(P) == {}


def test_overlap_multiple_workers():
    other = chain(8, seed=1)
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P))
    idx.apply(ev("b", 1, "stored", P[:3] + P[4:]))
    idx.apply(ev("c", 1, "stored", P[:1]))
    idx.apply(ev("d", 1, "stored", other))
    idx.apply(ev("e", 1, "stored", P[1:]))  # no first block: no prefix
    assert idx.overlap(P) == {"a": 8, "b": 3, "c": 1}
    assert idx.overlap(P[:2]) == {"a": 2, "b": 2, "c": 1}
    assert idx.overlap(other) == {"d": 8}
    # other tenants' hashes differ (cache salt): no cross-tenant hit
    assert idx.overlap(chain(8, salt="tenant-2")) == {}


def test_tier_overlap_counts_any_holder_per_block():
    idx = KVIndex()
    idx.apply(ev("a", 1, "stored", P[:2], tier="host"))
    idx.apply(ev("b", 1, "stored", P[2:4], tier="host"))
    idx.apply(ev("cache", 1, "stored", P[:6], tier="cache_tier"))
    idx.apply(ev("c", 1, "stored", P))  # device blocks do not count for slower tiers
    assert idx.tier_overlap(P, "host") == 4
    assert idx.tier_overlap(P, "cache_tier") == 6
    assert idx.tier_overlap(P, "disk") == 0
    assert idx.overlap(P) == {"c": 8}  # and slower tiers do not count for overlap


def test_lru_bound_evicts_oldest_entries():
    idx = KVIndex(max_blocks=5)
    idx.apply(ev("a", 1, "stored", P[:3]))
    idx.apply(ev("b", 1, "stored", P[:2]))
    idx.apply(ev("a", 2, "stored", P[:1]))  # re-store refreshes (a, P0)
    idx.apply(ev("b", 2, "stored", P[2:4]))  # 7 entries > 5: evict (a, P1), (a, P2)
    s = idx.stats()
    assert (s["entries"], s["evictions"]) == (5, 2)
    assert idx.overlap(P) == {"a": 1, "b": 4}
    idx.apply(ev("c", 1, "stored", P[:6]))  # evicts all of a's and b's, then c's own oldest (c, P0)
    assert idx.stats()["entries"] == 5 and idx.stats()["evictions"] == 8
    assert idx.overlap(P) == {} and idx.overlap(P[1:]) == {"c": 5}
    assert idx.tier_overlap(P, "device") == 0 and idx.tier_overlap(P[1:], "device") == 5


def test_lru_bound_keeps_newest_of_one_big_store():
    idx = KVIndex(max_blocks=3)
    idx.resync("a", 0, {"device": P})
    assert idx.stats()["entries"] == 3 and idx.stats()["evictions"] == 5
    assert idx.overlap(P) == {} and idx.overlap(P[5:]) == {"a": 3}


def test_overlap_of_unknown_first_block_does_not_scan_workers():
    """1,000 workers x 1,000 blocks: a prompt whose first block nobody holds answers {} (one lookup)."""
    shared = chain(1000)
    idx = KVIndex()
    for i in range(1000):
        idx.apply(ev(f"w{i}", 1, "stored", shared))
    assert idx.stats()["entries"] == 1_000_000
    assert idx.overlap(chain(1000, seed=5)) == {}
    assert idx.overlap(chain(1000, seed=5)[:1] + shared) == {}
    full = idx.overlap(shared)
    assert len(full) == 1000 and set(full.values()) == {1000}

    class CountingDict(dict):  # white-box: count hash lookups made by overlap()
        lookups = 0

        def get(self, key, default=None):
            CountingDict.lookups += 1
            return super().get(key, default)

    idx._holders["device"] = CountingDict(idx._holders["device"])
    assert idx.overlap(chain(1000, seed=5)) == {} and CountingDict.lookups == 1
    CountingDict.lookups = 0
    assert idx.overlap(shared[:10] + chain(5, seed=6)) == {f"w{i}": 10 for i in range(1000)}
    assert CountingDict.lookups == 11  # prompt blocks walked up to the first miss, not workers x blocks


def test_invalid_hashes_rejected():
    idx = KVIndex()
    with pytest.raises(ValueError):
        idx.resync("a", 0, {"device": [2**64]})
    with pytest.raises(ValueError):
        KVIndex(max_blocks=0)
