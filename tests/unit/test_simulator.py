"""Cluster simulator: exact hit rates on a hand-made trace, determinism, policy ordering, rejection, eviction."""
from __future__ import annotations

import argparse
import json

import pytest

from cli.simulate import add_parser, run
from services.router.policy.profiles import (LLAMA70B_H200, PROFILES, Profile, calibrate, calibrate_chunks, calibrate_decode,
                                   get_profile)
from simulator.simulate import TraceRequest, format_table, json_line, load_trace, simulate

BS = 512


def _req(idx: int, t: float, ids: list[int], out: int = 4) -> dict:
    return {"timestamp": int(t * 1000), "input_length": len(ids) * BS, "output_length": out, "hash_ids": ids}


HAND = [  # far apart: each request finishes before the next arrives
    _req(0, 0, [1, 2, 3]),
    _req(1, 100, [1, 2, 4]),  # 2 of 3 reused
    _req(2, 200, [1, 2, 3, 5]),  # 3 of 4
    _req(3, 300, [6, 7]),  # 0 of 2
    _req(4, 400, [1, 8]),  # 1 of 2
]  # 6 of 14 blocks were seen before


def _write(tmp_path, rows) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sharing_trace(convs: int = 7, turns: int = 12, root: int = 6) -> list[TraceRequest]:
    """Multi-turn conversations: turn k of conversation c re-sends the whole history plus one new block."""
    out, t = [], 0.0
    for k in range(turns):
        for c in range(convs):
            ids = tuple(c * 10_000 + j for j in range(root + k))
            out.append(TraceRequest(len(out), t, len(ids) * BS, 8, ids))
            t += 0.5
    return out


def test_load_trace_and_speed(tmp_path):
    path = _write(tmp_path, HAND)
    tr = load_trace(path)
    assert [r.hash_ids for r in tr][1] == (1, 2, 4) and tr[2].arrival_s == 200.0
    assert load_trace(path, limit=2, speed=4.0)[1].arrival_s == 25.0
    window = load_trace(path, limit=2, offset=3)
    assert [(r.idx, r.hash_ids, r.arrival_s) for r in window] == [(3, (6, 7), 300.0), (4, (1, 8), 400.0)]
    with pytest.raises(ValueError):
        load_trace(path, offset=-1)


def test_exact_hit_rate_one_worker(tmp_path):
    tr = load_trace(_write(tmp_path, HAND))
    res = simulate(tr, "round_robin", "llama70b-h200", num_workers=1, kv_capacity_blocks=1000,
                   ttft_slo_s=None, tpot_slo_s=None)
    assert res["hit_rate"] == pytest.approx(6 / 14, abs=1e-6)
    assert res["ideal_hit_rate"] == pytest.approx(6 / 14, abs=1e-6)
    assert res["served"] == 5 and res["rejected"] == 0 and res["slo_attainment"] == 1.0
    assert res["cached_input_tokens"] == 6 * BS


def test_exact_hit_rate_round_robin_two_workers(tmp_path):
    # w0 gets requests 0, 2, 4; w1 gets 1, 3: hits 0 + 0 + 3 + 0 + 1 of 14
    tr = load_trace(_write(tmp_path, HAND))
    res = simulate(tr, "round_robin", "llama70b-h200", num_workers=2, kv_capacity_blocks=1000)
    assert res["hit_rate"] == pytest.approx(4 / 14, abs=1e-6)
    assert res["ideal_hit_rate"] == pytest.approx(6 / 14, abs=1e-6)
    best = simulate(tr, "predictive", "llama70b-h200", num_workers=2, kv_capacity_blocks=1000)
    assert best["hit_rate"] == pytest.approx(6 / 14, abs=1e-6)


def test_same_seed_same_metrics():
    tr = _sharing_trace()
    for name in ("kv_cost", "predictive"):
        a = simulate(tr, name, "llama70b-h200", num_workers=4, kv_capacity_blocks=40, seed=3)
        b = simulate(tr, name, "llama70b-h200", num_workers=4, kv_capacity_blocks=40, seed=3)
        assert a == b
        assert json_line(a) == json_line(b)


def test_round_robin_reuses_less_than_cache_policies():
    tr = _sharing_trace()
    hits = {name: simulate(tr, name, "llama70b-h200", num_workers=4, kv_capacity_blocks=200)["hit_rate"]
            for name in ("round_robin", "cache_aware", "kv_cost", "predictive")}
    for name in ("cache_aware", "kv_cost", "predictive"):
        assert hits[name] > hits["round_robin"] + 0.2, hits


def test_impossible_slo_sheds_load_with_predictive():
    """Predictive sheds load: with an impossible SLO it still serves requests that find an idle worker (their
    blocks warm the cache), and rejects what would queue behind others."""
    burst = [TraceRequest(idx=i, arrival_s=0.0, input_length=2048, output_length=8,
                          hash_ids=tuple(range(100 * i, 100 * i + 4))) for i in range(8)]
    res = simulate(burst, "predictive", "llama70b-h200", num_workers=2, kv_capacity_blocks=100, ttft_slo_s=1e-6)
    # the first finds an idle cluster; from then on half the cluster is queued, so the rest are shed
    assert res["served"] == 1 and res["rejected"] == 7
    assert res["slo_attainment"] == 0.0 and res["goodput_rps"] == 0.0
    rr = simulate(burst, "round_robin", "llama70b-h200", num_workers=2, kv_capacity_blocks=100, ttft_slo_s=1e-6)
    assert rr["rejected"] == 0 and rr["served"] == len(burst) and rr["slo_attainment"] == 0.0


def test_tiny_capacity_evicts():
    tr = _sharing_trace()
    big = simulate(tr, "predictive", "llama70b-h200", num_workers=2, kv_capacity_blocks=1000)
    tiny = simulate(tr, "predictive", "llama70b-h200", num_workers=2, kv_capacity_blocks=12)
    assert tiny["hit_rate"] < big["hit_rate"] - 0.2
    assert big["hit_rate"] == pytest.approx(big["ideal_hit_rate"], abs=1e-6)  # everything fits: ideal reached
    assert tiny["served"] == len(tr)


def test_cache_tier_serves_evicted_prefixes():
    tr = _sharing_trace()
    no_tier = simulate(tr, "round_robin", "llama70b-h200", num_workers=4, kv_capacity_blocks=12)
    tier = simulate(tr, "round_robin", "llama70b-h200", num_workers=4, kv_capacity_blocks=12,
                    cache_tier_blocks=10_000)
    assert tier["hit_rate"] == pytest.approx(tier["ideal_hit_rate"], abs=1e-6)
    assert tier["hit_rate"] > no_tier["hit_rate"]
    assert tier["local_hit_rate"] < tier["hit_rate"]


def test_mixed_steps_follow_the_engines_token_budget():
    """A long prompt arriving mid-decode is chunked at the step budget and stalls the decode it shares steps
    with, exactly as the engine's scheduler runs them (times worked out by hand from the profile)."""
    prof = Profile("hand", prefill_a=0.0, prefill_b=1e-3, prefill_c=0.1, decode_base_s=0.05, decode_per_seq_s=0.0,
                   decode_per_kv_token_s=0.0, kv_bytes_per_token=1, transfer_gbps=1.0, chunk_tokens=100,
                   tier_dram_gbps=1.0, tier_ssd_gbps=1.0)
    tr = [TraceRequest(0, 0.0, 10, 4, (1,)), TraceRequest(1, 0.15, 250, 2, tuple(range(10, 26)))]
    res = simulate(tr, "round_robin", prof, num_workers=1, kv_capacity_blocks=1000, block_size=16)
    # A: prefill 0.1+0.010 -> first token 0.11; decode step to 0.16; two mixed steps (A's decode + 99 of B's
    # tokens, 0.1+0.099 each) to 0.359 and 0.558 where A ends. B: last 52 tokens 0.152 -> first token 0.710
    # (TTFT 0.56), one decode step -> 0.760.
    assert res["_ttfts"] == pytest.approx([0.11, 0.56])
    assert res["_tpots"] == pytest.approx([(0.558 - 0.11) / 3, 0.05])
    assert res["makespan_s"] == pytest.approx(0.76)


def test_disaggregated_cluster_serves_everything():
    tr = _sharing_trace(convs=4, turns=4)
    for name in ("round_robin", "predictive", "kv_cost"):
        res = simulate(tr, name, "llama70b-h200", num_workers=2, prefill_workers=2, kv_capacity_blocks=100)
        assert res["served"] + res["rejected"] == len(tr) and res["served"] > 0
        assert res["ttft_p50_s"] > 0 and res["tpot_p50_s"] > 0


def test_metrics_are_sane():
    tr = _sharing_trace(convs=4, turns=4)
    res = simulate(tr, "kv_cost", "smollm2-cpu", num_workers=2, kv_capacity_blocks=100, ttft_slo_s=1e9,
                   tpot_slo_s=1e9)
    assert res["slo_attainment"] == 1.0
    assert res["goodput_rps"] == pytest.approx(len(tr) / res["makespan_s"], abs=1e-6)
    assert res["ttft_p50_s"] <= res["ttft_p90_s"] <= res["ttft_p99_s"]
    assert res["gpu_hours"] == pytest.approx(2 * res["makespan_s"] / 3600, rel=1e-4)
    expect = (res["cached_input_tokens"] * 0.02 + res["uncached_input_tokens"] * 1.0) / 1e6
    assert res["revenue"] == pytest.approx(expect, rel=1e-5)
    table = format_table([res])
    assert "kv_cost" in table and "ideal_hit" in table


def test_profiles_and_calibrate():
    assert set(PROFILES) == {"smollm2-cpu", "llama70b-h200"}
    cpu = get_profile("smollm2-cpu")
    assert 5.5 < cpu.prefill_s(1024) < 6.8 and cpu.prefill_s(0) == 0.0  # measured 6.15 s at 1024, 1 thread
    assert cpu.decode_step_s(1, 100) == pytest.approx(0.0488 + 0.00383 + 100 * 8.76e-6)
    assert LLAMA70B_H200.kv_bytes_per_token == 327_680
    assert 0.3 < LLAMA70B_H200.prefill_s(15_000) < 1.5  # a 15k-token prompt on a TP8 H200 worker
    assert 0.004 < LLAMA70B_H200.decode_step_s(32, 32 * 16_000) < 0.05
    # a 50-token chunk after 100 cached tokens: flash skips the masked half (2a); the CPU engine's is measured
    assert LLAMA70B_H200.chunk_s(100, 50) == pytest.approx(LLAMA70B_H200.prefill_a * (150**2 - 100**2)
                                                           + LLAMA70B_H200.prefill_b * 50)
    assert cpu.chunk_s(100, 50) == pytest.approx(cpu.prefill_a * 50 * 50 + 2.89e-6 * 50 * 100 + cpu.prefill_b * 50)
    assert cpu.chunk_s(0, 50) + cpu.prefill_c == pytest.approx(cpu.prefill_s(50))
    a, b, c = calibrate([(t, 1e-7 * t * t + 2e-3 * t + 0.01) for t in (64, 256, 512, 1024, 2048)])
    assert (a, b, c) == pytest.approx((1e-7, 2e-3, 0.01), rel=1e-6)
    a, b, c = calibrate([(100, 0.1), (200, 0.2), (400, 0.4), (800, 0.79)])  # slightly concave: a clamps to 0
    assert a >= 0 and b > 0 and c >= 0
    exact = [(x, n, 3e-6 * n * n + 2.5e-6 * n * x + 2e-3 * n + 0.09) for x in (0, 512, 2048) for n in (64, 512, 1024)]
    assert calibrate_chunks(exact) == pytest.approx((3e-6, 2.5e-6, 2e-3, 0.09), rel=1e-6)
    steps = [(b, k, 0.05 + 0.004 * b + 9e-6 * k) for b, k in ((1, 64), (8, 512), (16, 8000), (32, 2000))]
    assert calibrate_decode(steps) == pytest.approx((0.05, 0.004, 9e-6), rel=1e-6)
    with pytest.raises(ValueError):
        calibrate_decode([(1, 64, 0.0), (2, 64, 0.1), (3, 64, 0.2)])  # a step cannot take no time


def test_cli_runs(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--trace", _write(tmp_path, HAND), "--workers", "2", "--policy",
                              "round_robin,predictive", "--kv-capacity-blocks", "100", "--json"])
    assert run(args, print) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["policy"] for x in lines] == ["round_robin", "predictive"]
    args = parser.parse_args(["simulate", "--trace", _write(tmp_path, HAND), "--policy", "nope"])
    assert run(args, print) == 2


def test_cli_plots_ttft_cdfs(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    png = tmp_path / "ttft.png"
    args = parser.parse_args(["simulate", "--trace", _write(tmp_path, HAND), "--workers", "2", "--policy", "all",
                              "--kv-capacity-blocks", "100", "--json", "--plot", str(png)])
    assert run(args, lambda *a, **k: None) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
