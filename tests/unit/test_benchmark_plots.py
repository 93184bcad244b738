"""``--plot`` of the live benchmarks (``benchmarks/plots.py``): each benchmark's ``draw`` writes a PNG from results
shaped as its run returns them; the planner's P:D split over time follows its decisions; without matplotlib a
benchmark says so and exits 2."""
import argparse

import pytest

from benchmarks import migration_skew, openai_burst, planner_shift, plots, sim_elastic

PNG = b"\x89PNG\r\n\x1a\n"


def written(path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG) and len(data) > 10_000


def burst(ttft0: float) -> dict:
    return {"ok": 4, "errors": 0, "why": [], "wall": 1.0, "tok_s": 100.0,
            "ttft": [ttft0 + 0.1 * i for i in range(4)], "tpot": [0.02 + 0.001 * i for i in range(4)]}


def test_openai_burst_draws_each_sets_cdfs(tmp_path):
    path = tmp_path / "burst.png"
    openai_burst.draw({"distinct": {"engine": burst(0.2), "up": burst(0.4)},
                       "shared-prefix": {"engine": burst(0.1), "up": burst(0.3)}}, str(path), 64)
    assert written(path)


def test_migration_skew_draws_tokens_over_time_and_tpots(tmp_path):
    args = argparse.Namespace(streams=2, prompt_tokens=512, plot=str(tmp_path / "skew.png"))
    run = lambda k: {"_token_times": [0.1 * i * k for i in range(50)], "_tpots": [0.05, 0.07], "_joined_s": 1.5}
    migration_skew.draw(run(2), run(1), args)
    assert written(tmp_path / "skew.png")


def test_planner_shift_draws_ttft_by_send_time(tmp_path):
    args = argparse.Namespace(long_prompts=3, prompt_tokens=768, gap_s=0.5, chat=2, ttft_slo_s=2.0,
                              plot=str(tmp_path / "planner.png"))
    off = {"_ttft": [(0.0, 0.1), (0.0, 0.2), (1.0, 3.0), (1.5, 4.0), (2.0, 5.0)], "_decided_s": []}
    on = {"_ttft": [(0.0, 0.1), (0.0, 0.2), (1.0, 3.0), (1.5, 1.0), (2.0, 0.8)], "_decided_s": [1.2]}
    planner_shift.draw(off, on, args)
    assert written(tmp_path / "planner.png")


def test_the_prefill_count_follows_the_planners_decisions(tmp_path):
    res = {"makespan_s": 100.0, "_ttfts": [0.1, 0.5, 3.0], "planner": {"decisions": [
        {"t_s": 10.0, "kind": "switch", "role": "prefill", "delta": 0},
        {"t_s": 20.0, "kind": "scale", "role": "prefill", "delta": 2},
        {"t_s": 30.0, "kind": "switch", "role": "decode", "delta": 0},
        {"t_s": 40.0, "kind": "scale", "role": "decode", "delta": 1}]}}
    assert sim_elastic.prefill_over_time(res, 4, 100.0) == ([0.0, 10.0, 20.0, 30.0, 40.0, 100.0],
                                                           [4, 5, 7, 6, 6, 6])
    args = argparse.Namespace(workers=8, profile="p", policy="kv_cost", ttft_slo=2.0, prefill=4,
                              plot=str(tmp_path / "elastic.png"))
    sim_elastic.draw({"trace 2x": {"fixed 4:4": {"_ttfts": [0.2, 1.0], "makespan_s": 100.0},
                                   "planner 4:4": res}}, args)
    assert written(tmp_path / "elastic.png")


def test_without_matplotlib_a_plot_exits_2(monkeypatch, capsys):
    def missing():
        raise RuntimeError("plotting needs matplotlib, which is not installed")
    with pytest.raises(SystemExit) as exit_:
        plots.plot_or_exit(missing)
    assert exit_.value.code == 2 and "matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("forced", ["1", "0"])
def test_a_benchmarks_requests_are_gathered_in_order_under_a_bar_only_where_asked(forced, monkeypatch, capsys):
    import asyncio

    from shared import progress
    monkeypatch.setenv("DEEPINFER_PROGRESS", forced)

    async def one(i: int) -> int:
        await asyncio.sleep(0.01 * (3 - i))   # the last finishes first
        return i
    assert asyncio.run(progress.gather((one(i) for i in range(3)), "burst")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert ("burst" in err and "/3" in err) == (forced == "1")
