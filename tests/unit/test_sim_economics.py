"""The seed's economics in the simulator (simulator/economics.py, simulator/what_if.py): a run's revenue is
Σ price × tokens of its ledger in dollars, rent is GPU-hours × the GPU-hour price, the margin their difference;
the what-if grid runs one simulation per cell in the spec's order, a larger tier never serves fewer hits, a ttl
shorter than the workload's reuse distance loses hits, and bad specs are refused with what is wrong."""
from __future__ import annotations

import argparse
import json

import pytest

from cli.simulate import add_parser, run
from shared.accounting import Prices, UsageLine
from shared.errors import DeepinferError
from simulator.economics import Economics
from simulator.simulate import simulate
from simulator.what_if import Cell, parse_grid, what_if
from simulator.workloads import agent_workload


@pytest.fixture(scope="module")
def trace():
    return agent_workload(duration_s=240.0, seed=2)


def test_summary_is_prices_times_tokens_against_the_rent():
    line = UsageLine()
    line.add(3_000_000, 2_000_000, 500_000, None)
    prices = Prices(cached_per_mtok=0.5, uncached_per_mtok=2.0, output_per_mtok=8.0)   # yuan, as DeepSeek's list
    eco = Economics(gpu_hour_usd=2.0, currency_per_usd=8.0).summary(line, prices, gpu_hours=0.25)
    revenue = (2 * 0.5 + 1 * 2.0 + 0.5 * 8.0) / 8.0
    assert eco["revenue_usd"] == pytest.approx(revenue) and eco["gpu_cost_usd"] == pytest.approx(0.5)
    assert eco["margin_usd"] == pytest.approx(revenue - 0.5)
    assert eco["revenue_per_gpu_hour_usd"] == pytest.approx(revenue / 0.25)
    assert eco["cost_profit_margin"] == pytest.approx((revenue - 0.5) / 0.5)
    assert eco["usd_per_mtok_served"] == pytest.approx(revenue / 3.5) and eco["miss_over_hit_price"] == 4.0
    with pytest.raises(ValueError, match="currency_per_usd"):
        Economics(currency_per_usd=0)


def test_a_runs_ledger_adds_up_to_its_economics(trace):
    prices = Prices(0.02, 1.0, 2.0)
    res = simulate(trace, "cache_aware", num_workers=4, kv_capacity_blocks=400, prices=prices,
                   economics=Economics(3.0, 2.0), tier_ssd_blocks=2000, tier_dram_blocks=250, retention="agent")
    total = res["accounting"]["total"]
    served = [trace[i] for i in res["_served_idx"]]
    assert total["prompt_tokens"] == sum(r.input_length for r in served) == \
        total["cached_tokens"] + total["uncached_tokens"]
    assert total["output_tokens"] == sum(r.output_length for r in served)
    eco = res["economics"]
    want = prices.cost(total["cached_tokens"], total["uncached_tokens"], total["output_tokens"]) / 2.0
    assert eco["revenue_usd"] == pytest.approx(want, rel=1e-6)
    assert eco["gpu_cost_usd"] == pytest.approx(res["gpu_hours"] * 3.0, rel=1e-6)
    assert eco["revenue_per_gpu_hour_usd"] == pytest.approx(want / res["gpu_hours"], rel=1e-4)


def test_grid_cells_in_spec_order_and_refusals():
    cells = parse_grid("tier=0,0.5;pd=0:4,1:3", tier=0.1, retention="3d", prefill=0, decode=4)
    assert cells == [Cell(0.0, "3d", 0, 4), Cell(0.0, "3d", 1, 3), Cell(0.5, "3d", 0, 4), Cell(0.5, "3d", 1, 3)]
    assert parse_grid("", tier=0.1, retention="7d", prefill=2, decode=6) == [Cell(0.1, "7d", 2, 6)]
    for bad, match in (("tiers=0", "axis"), ("pd=4", "prefill:decode"), ("pd=1:0", "prefill:decode"),
                       ("tier=-1", "fraction"), ("tier=0;tier=1", "twice")):
        with pytest.raises(ValueError, match=match):
            parse_grid(bad, 0.0, "3d", 0, 4)
    with pytest.raises(DeepinferError, match="retention"):
        parse_grid("retention=3 days", 0.0, "3d", 0, 4)


def test_a_larger_tier_and_a_longer_ttl_never_serve_fewer_hits(trace):
    cells = parse_grid("tier=0,0.2,1;retention=3d,1s", 0.0, "3d", 0, 4)
    rows = what_if(trace, cells, "cache_aware", "llama70b-h200", kv_capacity_blocks=150)
    assert [(r["tier"], r["retention"]) for r in rows] == [(c.tier, c.retention) for c in cells]
    by = {(r["tier"], r["retention"]): r["hit_rate"] for r in rows}
    assert by[(0.0, "3d")] <= by[(0.2, "3d")] <= by[(1.0, "3d")]
    assert by[(1.0, "3d")] > by[(0.0, "3d")]   # the tier matters at this KV capacity
    assert by[(1.0, "1s")] < by[(1.0, "3d")]   # 1 s ttl: blocks expire before the session's next turn
    assert all(r["revenue_per_gpu_hour_usd"] > 0 and r["gpu_hours"] > 0 for r in rows)


def test_the_cli_prints_the_grid_and_refuses_a_bad_spec(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    base = ["simulate", "--workload", "agent", "--limit", "80", "--policy", "cache_aware", "--workers", "4"]
    out: list[str] = []
    plot = tmp_path / "what_if.png"
    code = run(parser.parse_args(base + ["--what-if", "tier=0,0.5;pd=0:4,1:3", "--gpu-hour-price", "3",
                                         "--plot", str(plot)]),
               lambda *a, **k: out.append(" ".join(map(str, a))))
    assert code == 0 and plot.stat().st_size > 0
    rows = [json.loads(line)["what_if"] for line in out if line.startswith("{")]
    assert [(r["tier"], r["pd"]) for r in rows] == [(0.0, "0:4"), (0.0, "1:3"), (0.5, "0:4"), (0.5, "1:3")]
    assert any("margin $/GPU-h" in line for line in out)
    errors: list[str] = []
    assert run(parser.parse_args(base + ["--what-if", "pd=oops"]),
               lambda *a, **k: errors.append(" ".join(map(str, a)))) == 2
    assert "prefill:decode" in errors[-1]


def test_a_simulation_shows_progress_only_where_asked(trace, monkeypatch, capsys):
    """``deepinfer simulate`` draws a bar over the trace's requests when bars are shown, nothing otherwise."""
    for forced, seen in (("0", False), ("1", True)):
        monkeypatch.setenv("DEEPINFER_PROGRESS", forced)
        simulate(trace, "cache_aware", num_workers=4, kv_capacity_blocks=400)
        assert ("simulating" in capsys.readouterr().err) is seen
