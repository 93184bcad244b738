"""Scaled live replay: deterministic token synthesis, shared prefixes, length scaling, metrics (no cluster)."""
from __future__ import annotations

import math

import pytest

from cli.replay import block_tokens, metrics_from_replay, scaled_requests
from simulator.simulate import TraceRequest

TRACE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 1250, "input_length": 100, "output_length": 100, "hash_ids": [9]},
]


def test_deterministic_and_seeded():
    a = scaled_requests(TRACE, scale=32)
    b = scaled_requests(TRACE, scale=32)
    assert a == b
    c = scaled_requests(TRACE, scale=32, seed=1)
    assert [r[1] for r in a] != [r[1] for r in c]
    assert block_tokens(7, 16) == block_tokens(7, 16)


def test_lengths_scaled():
    reqs = scaled_requests(TRACE, scale=32)
    assert [r[0] for r in reqs] == [0.0, 0.5, 1.25]
    assert [len(r[1]) for r in reqs] == [math.ceil(1100 / 32), math.ceil(1500 / 32), math.ceil(100 / 32)]
    assert [r[2] for r in reqs] == [2, 1, 4]  # max(1, ceil(out / 32))
    reqs16 = scaled_requests(TRACE, scale=16)
    assert [len(r[1]) for r in reqs16] == [69, 94, 7]


def test_token_range_and_vocab():
    for _, prompt, _ in scaled_requests(TRACE, scale=32, vocab=100):
        assert all(3 <= t < 100 for t in prompt)


def test_shared_hash_ids_share_prefix():
    r0, r1, r2 = (r[1] for r in scaled_requests(TRACE, scale=32))
    assert r0[:32] == r1[:32]  # hash ids 1, 2 = two 16-token blocks
    assert r0[32:35] != r1[32:35]  # 3 vs 4
    assert r0[:16] == block_tokens(1, 16) and r0[16:32] == block_tokens(2, 16)
    assert r2 == block_tokens(9, 16)[:4]


def test_trace_requests_and_limit():
    trs = [TraceRequest(i, d["timestamp"] / 1000, d["input_length"], d["output_length"], tuple(d["hash_ids"]))
           for i, d in enumerate(TRACE)]
    assert scaled_requests(trs) == scaled_requests(TRACE)
    assert len(scaled_requests(TRACE, limit=2)) == 2


def test_bad_scale():
    with pytest.raises(ValueError):
        scaled_requests(TRACE, scale=3)


def test_metrics_exact():
    results = [
        {"ttft_s": 0.1, "tpot_s": 0.05, "prompt_tokens": 100, "cached_tokens": 50, "output_tokens": 5,
         "sent_s": 0.0, "end_s": 1.0, "error": None},
        {"ttft_s": 0.3, "tpot_s": 0.15, "prompt_tokens": 300, "cached_tokens": 0, "output_tokens": 3,
         "sent_s": 0.5, "end_s": 2.0, "error": None},
        {"ttft_s": 0.2, "tpot_s": None, "prompt_tokens": 100, "cached_tokens": 100, "output_tokens": 1,
         "sent_s": 1.0, "end_s": 1.5, "error": None},
        {"ttft_s": None, "tpot_s": None, "prompt_tokens": 10, "cached_tokens": 0, "output_tokens": 0,
         "sent_s": 1.0, "end_s": 4.0, "error": "overloaded"},
    ]
    m = metrics_from_replay(results, ttft_slo=0.25, tpot_slo=0.1, makespan=2.0)
    assert m["requests"] == 4 and m["served"] == 3 and m["errors"] == 1 and m["rejected"] == 1
    assert m["error_codes"] == {"overloaded": 1}
    assert m["hit_rate"] == pytest.approx(150 / 500)  # token-weighted over served requests
    assert m["cached_input_tokens"] == 150 and m["uncached_input_tokens"] == 350 and m["output_tokens"] == 9
    assert m["ttft_p50_s"] == pytest.approx(0.2)
    assert m["ttft_p90_s"] == pytest.approx(0.28)
    assert m["tpot_p50_s"] == pytest.approx(0.1)
    assert m["tpot_p99_s"] == pytest.approx(0.149)
    assert m["slo_met"] == 2 and m["slo_attainment"] == pytest.approx(0.5)  # req 0 and req 2 (no TPOT)
    assert m["goodput_rps"] == pytest.approx(1.0)
    assert m["makespan_s"] == 2.0
    assert metrics_from_replay(results, None, None)["makespan_s"] == pytest.approx(4.0)  # last end - first send
    sim_keys = {"hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s",
                "slo_attainment", "goodput_rps", "rejected", "makespan_s", "requests", "served"}
    assert sim_keys <= m.keys()


def test_metrics_empty():
    m = metrics_from_replay([], 1.0, 1.0, makespan=0.0)
    assert m["requests"] == 0 and m["ttft_p50_s"] is None and m["goodput_rps"] == 0.0
