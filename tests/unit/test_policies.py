"""Each policy's decision on hand-made cluster states: the exact worker expected."""
import pytest

from services.router.policy.policies import CacheAware, KvCost, LeastLoaded, Predictive, RoundRobin, make_policy
from services.router.policy.types import ClusterView, CostModel, Placement, Reject, RequestInfo, WorkerView

REQ = RequestInfo("r", num_prompt_tokens=160, block_hashes=tuple(range(10)), max_tokens=16)


def both(wid, running=0, waiting=0, queued=0, free=100):
    return WorkerView(wid, "both", running, waiting, queued, free, 100, 16)


def agg(*workers, overlap=None, remote=0, cost=None):
    return ClusterView(prefill=tuple(workers), decode=(), overlap=overlap or {}, remote_overlap=remote,
                       cost=cost or CostModel(prefill_b=1e-3, block_transfer_s=1e-4))


def test_round_robin_cycles_in_id_order():
    view = agg(both("b"), both("a"), both("c"))
    rr = RoundRobin()
    assert [rr.place(REQ, view).decode_worker for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_prefers_fewest_queued_tokens_then_requests():
    view = agg(both("a", queued=500), both("b", queued=100, running=9), both("c", queued=100, running=2))
    assert LeastLoaded().place(REQ, view) == Placement("c", None, None, "least loaded")


def test_cache_aware_follows_prefix_when_balanced():
    view = agg(both("a", running=3), both("b", running=4), overlap={"b": 8})
    assert CacheAware().place(REQ, view).decode_worker == "b"  # 8/10 > 0.5 match


def test_cache_aware_low_match_goes_to_most_free_cache():
    view = agg(both("a", free=10), both("b", free=90), overlap={"a": 3})
    assert CacheAware().place(REQ, view).decode_worker == "b"  # 3/10 < 0.5


def test_cache_aware_imbalance_overrides_cache():
    view = agg(both("a", running=50), both("b", running=2), overlap={"a": 10})
    assert CacheAware().place(REQ, view).decode_worker == "b"


def test_kv_cost_weighs_overlap_against_active_blocks():
    # a: 10 uncached blocks + 10 active; b: 2 uncached + 60 active; c: 10 uncached + 0 active (+11 own each)
    view = agg(both("a", free=90), both("b", free=40), both("c", free=100), overlap={"b": 8})
    assert KvCost().place(REQ, view).decode_worker == "c"
    assert KvCost(overlap_weight=10.0).place(REQ, view).decode_worker == "b"


def test_kv_cost_softmax_is_seeded():
    view = agg(both("a"), both("b"), both("c"))
    picks = lambda seed: [KvCost(temperature=1.0, seed=seed).place(REQ, view).decode_worker for _ in range(5)]
    assert picks(3) == picks(3)


def test_predictive_trades_queue_against_cache():
    cost = CostModel(prefill_b=1e-3, block_transfer_s=1e-4)
    # a holds the whole prefix but has 2000 tokens queued (2 s); b is idle with nothing cached (0.16 s)
    view = agg(both("a", queued=2000), both("b"), overlap={"a": 10}, cost=cost)
    p = Predictive().place(REQ, view)
    assert p.decode_worker == "b" and p.predicted_ttft_s == pytest.approx(0.160)
    # with a short queue the cache wins: a = 0.05 + 0.001 (1 token recomputed) < b = 0.16
    view = agg(both("a", queued=50), both("b"), overlap={"a": 10}, cost=cost)
    assert Predictive().place(REQ, view).decode_worker == "a"


def test_predictive_charges_the_recompute_it_causes():
    cost = CostModel(prefill_b=1e-3, block_transfer_s=1e-4)
    # a holds the prefix behind a 170-token queue: TTFT 0.171 s; idle b recomputes all 160 tokens: 0.160 s.
    # TTFT alone picks b; with half the recompute charged (a 0.1715, b 0.240) the cache holder wins
    view = agg(both("a", queued=170), both("b"), overlap={"a": 10}, cost=cost)
    assert Predictive(work_weight=0.0).place(REQ, view).decode_worker == "b"
    chosen = Predictive().place(REQ, view)
    assert chosen.decode_worker == "a" and chosen.predicted_ttft_s == pytest.approx(0.171)


def test_predictive_counts_pulling_from_a_slower_tier():
    cost = CostModel(prefill_b=1e-3, block_transfer_s=5e-3)
    view = agg(both("a"), both("b", queued=5), overlap={"b": 2}, remote=10, cost=cost)
    # a pulls 10 blocks (0.05 s) + 1 token; b pulls 8 (0.04) after a 0.005 s queue + 1 token: b wins
    assert Predictive().place(REQ, view).decode_worker == "b"


def test_predictive_rejects_past_the_slo():
    view = agg(both("a", queued=10_000), cost=CostModel(prefill_b=1e-3))
    slo = RequestInfo("r", 160, tuple(range(10)), 16, ttft_slo_s=1.0)
    decision = Predictive().place(slo, view)
    assert isinstance(decision, Reject) and "overloaded" in decision.reason


def test_disaggregated_pairing_and_local_prefill():
    prefill = (WorkerView("p1", "prefill", queued_prefill_tokens=0, num_free_blocks=100, num_total_blocks=100),)
    decode = (WorkerView("d1", "decode", num_running=5, num_free_blocks=20, num_total_blocks=100),
              WorkerView("d2", "decode", num_running=9, num_free_blocks=80, num_total_blocks=100))
    view = ClusterView(prefill=prefill, decode=decode, cost=CostModel(prefill_b=1e-3, block_transfer_s=1e-4))
    long_req = RequestInfo("r", 800, tuple(range(50)), 16)
    d = LeastLoaded().place(long_req, view)
    assert (d.prefill_worker, d.decode_worker) == ("p1", "d2")  # headroom first
    busy_decode = ClusterView(prefill=prefill, decode=(WorkerView("d1", "decode", queued_prefill_tokens=5000,
                                                                  num_free_blocks=90, num_total_blocks=100),),
                              cost=view.cost)
    assert Predictive().place(long_req, busy_decode).prefill_worker == "p1"
    short = RequestInfo("s", 30, (1,), 8)
    assert Predictive().place(short, view).prefill_worker is None  # short prompt: local prefill


def test_make_policy_and_empty_cluster():
    assert make_policy("predictive").name == "predictive"
    with pytest.raises(ValueError):
        make_policy("nope")
    for name in ("round_robin", "least_loaded", "cache_aware", "kv_cost", "predictive"):
        assert isinstance(make_policy(name).place(REQ, ClusterView(prefill=(), decode=())), Reject)
