"""The simulator's elastic cluster (simulator/elastic.py): live migration and the online P:D planner run
on simulated ticks; the shifting workload (simulator/workloads.py); the CLI flags; no change when off."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from cli.simulate import add_parser, run
from simulator.simulate import MigrationConfig, PlannerConfig, TraceRequest, json_line, simulate
from simulator.workloads import Phase, shifting_workload

BS = 512
PLANNER = PlannerConfig(tpot_slo_s=0.05)  # the simulator's default TPOT SLO; cooldown 30 s, dwell 120 s


def _sharing(convs: int = 6, turns: int = 6, root: int = 8) -> list[TraceRequest]:
    out, t = [], 0.0
    for k in range(turns):
        for c in range(convs):
            ids = tuple(c * 10_000 + j for j in range(root + k))
            out.append(TraceRequest(len(out), t, len(ids) * BS, 40 + 7 * c, ids))
            t += 0.25
    return out


@pytest.fixture(scope="module")
def shifting():
    return shifting_workload()  # chat 120 s at 32/s, agent turns 120 s at 3/s, chat 120 s


@pytest.fixture(scope="module")
def elastic_run(shifting):
    return simulate(shifting, "kv_cost", num_workers=4, prefill_workers=4, migration=MigrationConfig(),
                    planner=PLANNER)


def test_shifting_workload_is_deterministic_and_shifts():
    a, b = shifting_workload(seed=1), shifting_workload(seed=1)
    assert a == b and a != shifting_workload(seed=2)
    assert [r.idx for r in a] == list(range(len(a)))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert all(len(r.hash_ids) == math.ceil(r.input_length / BS) for r in a)
    seen_at: dict[int, int] = {}
    for r in a:  # chained ids: an id always stands at the same position
        for pos, h in enumerate(r.hash_ids):
            assert seen_at.setdefault(h, pos) == pos
    chat1 = [r for r in a if r.arrival_s < 120]
    agent = [r for r in a if 120 <= r.arrival_s < 240]
    chat2 = [r for r in a if r.arrival_s >= 240]
    mean = lambda rs, f: sum(f(r) for r in rs) / len(rs)  # noqa: E731
    for chat in (chat1, chat2):
        assert mean(chat, lambda r: r.input_length) < 6_000 and mean(chat, lambda r: r.output_length) > 500
    assert mean(agent, lambda r: r.input_length) > 25_000 and mean(agent, lambda r: r.output_length) < 50
    assert 3_000 < len(chat1) < 4_700 and 250 < len(agent) < 480
    with pytest.raises(ValueError):
        shifting_workload(phases=(Phase("batch", 10, 1),))


def test_elastic_needs_a_disaggregated_cluster():
    with pytest.raises(ValueError):
        simulate(_sharing(), "kv_cost", num_workers=2, migration=MigrationConfig())
    with pytest.raises(ValueError):
        simulate(_sharing(), "kv_cost", num_workers=2, planner=PLANNER)


def test_off_equals_the_old_simulator():
    """Pinned figures of the plain simulator (same trace, same options), which the elastic options left off do
    not change. TPOT moved when a hand-off began to join its decode worker's batch at the next step boundary
    instead of after the worker's multi-step (kv_cost TPOT p99 0.012788825 -> 0.007919386, makespan 9.468098 ->
    9.480088; round robin p99 0.011707877 -> 0.007818661): the rest is as before the elastic cluster existed."""
    old = {"kv_cost": (0.529101, 0.124690948, 0.298850276, 0.007725384, 0.007919386, 9.480088, 0.084267),
           "round_robin": (0.793651, 0.063617714, 0.182356749, 0.007698295, 0.007818661, 9.388672, 0.083455)}
    for name, figures in old.items():
        res = simulate(_sharing(), name, "llama70b-h200", num_workers=2, prefill_workers=2, kv_capacity_blocks=60)
        assert (res["served"], res["rejected"], res["slo_met"]) == (36, 0, 36)
        assert tuple(res[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                                      "makespan_s", "gpu_hours")) == figures
        assert "migrations" not in res and "planner" not in res
        same = simulate(_sharing(), name, "llama70b-h200", num_workers=2, prefill_workers=2, kv_capacity_blocks=60,
                        migration=None, planner=None)
        assert same == res


def test_same_inputs_same_result(shifting, elastic_run):
    again = simulate(shifting, "kv_cost", num_workers=4, prefill_workers=4, migration=MigrationConfig(),
                     planner=PLANNER)
    assert again == elastic_run and json_line(again) == json_line(elastic_run)


def test_planner_follows_the_shift_and_back(elastic_run):
    decisions = elastic_run["planner"]["decisions"]
    to_prefill = [d for d in decisions if d["kind"] == "switch" and d["role"] == "prefill"]
    during_agent = [d for d in to_prefill if 120 <= d["t_s"] < 240]
    assert during_agent, decisions
    assert all(d["reason"] == "prefill_pressure" and d["prefill_pressure"] >= PLANNER.high for d in during_agent)
    back = [d for d in decisions
            if d["kind"] == "switch" and d["role"] == "decode" and d["t_s"] > during_agent[0]["t_s"]]
    assert back and back[0]["decode_pressure"] >= PLANNER.high, decisions
    # every switch completed (its drain ended), in time order; a reversal never closer than the cooldown, more
    # of the same never closer than a third of it
    assert all(d["done_s"] is not None and d["done_s"] >= d["t_s"] for d in decisions)
    for a, b in zip(decisions, decisions[1:]):
        assert b["t_s"] - a["t_s"] >= PLANNER.cooldown_s / (3 if a["role"] == b["role"] else 1)
    reversals = sum(a["role"] != b["role"] for a, b in zip(decisions, decisions[1:]))
    assert reversals <= elastic_run["makespan_s"] / PLANNER.cooldown_s + 1
    counts = elastic_run["planner"]["counts"]
    assert sum(counts.values()) == len(decisions)
    net = len(to_prefill) - sum(d["role"] == "decode" for d in decisions)
    assert (elastic_run["planner"]["final_prefill"], elastic_run["planner"]["final_decode"]) == (4 + net, 4 - net)


def _drain_trace() -> list[TraceRequest]:
    """40 long decodes (4,000 tokens) from t=0, then from t=5 s a minute of agent turns: the planner switches a
    decode worker still running long streams to prefill."""
    longs = [TraceRequest(0, 0.5 * i, 1024, 4000, (10_000_000 + 2 * i, 10_000_001 + 2 * i)) for i in range(40)]
    agent = [dataclasses.replace(r, arrival_s=5.0 + r.arrival_s)
             for r in shifting_workload(phases=(Phase("agent", 60, 3.0),), seed=5)]
    return [dataclasses.replace(r, idx=i) for i, r in enumerate(sorted(longs + agent, key=lambda r: r.arrival_s))]


def test_migration_drains_and_serves_every_request_once(shifting, elastic_run):
    trace = _drain_trace()
    runs = {name: simulate(trace, "kv_cost", num_workers=4, prefill_workers=2, kv_capacity_blocks=2000,
                           migration=mig, planner=PLANNER)
            for name, mig in (("migrate", MigrationConfig()), ("stay", None))}
    mig = runs["migrate"]["migrations"]
    assert mig["by_reason"]["drain"] > 0 and mig["moves"] == sum(mig["by_reason"].values())
    assert mig["moves"] + mig["cancelled"] == mig["ordered"] and mig["pause_s_total"] > 0
    assert "migrations" not in runs["stay"]  # without migration a draining worker's streams finish there
    first = {name: res["planner"]["decisions"][0] for name, res in runs.items()}
    assert all(d["kind"] == "switch" and d["role"] == "prefill" for d in first.values())
    took = {name: d["done_s"] - d["t_s"] for name, d in first.items()}
    assert took["migrate"] < 10 < took["stay"], took  # moving the streams away ends the drain sooner
    for res, n in ((runs["migrate"], len(trace)), (runs["stay"], len(trace)), (elastic_run, len(shifting))):
        assert res["served"] == res["requests"] == n
        assert sorted(res["_served_idx"]) == list(range(n))  # every request served exactly once


def test_scale_up_waits_for_startup_and_idle_scales_down():
    trace = shifting_workload(phases=(Phase("agent", 60, 3.0), Phase("chat", 150, 2.0)))
    cfg = PlannerConfig(tpot_slo_s=0.05, max_prefill=3, max_decode=2, cooldown_s=30)
    res = simulate(trace, "kv_cost", num_workers=1, prefill_workers=1, migration=MigrationConfig(), planner=cfg,
                   startup_s=20)
    decisions = res["planner"]["decisions"]
    ups = [d for d in decisions if d["kind"] == "scale" and d["delta"] == 1]
    downs = [d for d in decisions if d["kind"] == "scale" and d["delta"] == -1]
    assert ups and all(d["role"] == "prefill" and d["done_s"] == pytest.approx(d["t_s"] + 20) for d in ups)
    assert [d["worker"] for d in ups] == [f"w{2 + i:03d}" for i in range(len(ups))]  # new workers, new ids
    assert downs and all(d["reason"] == "prefill_idle" and d["t_s"] > 60 for d in downs)
    assert res["planner"]["final_prefill"] == 1 + len(ups) - len(downs) >= cfg.min_prefill
    assert sorted(res["_served_idx"]) == list(range(len(trace)))
    # GPU time counts each worker from its decision to its removal: less than the peak pool for the whole run
    peak = 2 + len(ups)
    assert 2 * res["makespan_s"] < res["gpu_hours"] * 3600 / 8 < peak * res["makespan_s"]


def test_timings_are_reported_apart_from_the_result():
    timings: dict = {}
    res = simulate(_sharing(), "kv_cost", num_workers=2, prefill_workers=2, timings=timings)
    assert timings["placements"] == res["requests"] and 0 < timings["place_s"] < timings["wall_s"]
    assert "place_s" not in res


def _cli(*argv: str):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def test_cli_elastic_flags(capsys):
    args = _cli("--workload", "shifting", "--prefill", "2", "--decode", "2", "--policy", "kv_cost", "--migrate",
                "--planner", "--limit", "400", "--speed", "2")
    assert run(args, print) == 0
    out = capsys.readouterr().out
    line = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
    assert line["requests"] == 400 and line["served"] == 400
    assert set(line["migrations"]) >= {"moves", "by_reason", "pause_s_total"}
    assert set(line["planner"]) >= {"decisions", "counts"}
    assert "planner" in out.splitlines()[-1] and "final P:D" in out.splitlines()[-1]
    assert run(_cli("--workload", "shifting", "--workers", "2", "--migrate", "--limit", "10"), print) == 2
    assert "disaggregated" in capsys.readouterr().err
