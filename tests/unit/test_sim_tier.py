"""The simulator's cache tier (simulator/tier.py): the block store's DRAM + SSD model with retention
classes on the simulated clock, and its wiring into the simulator (pull costs, hit rates, accounting, CLI)."""
from __future__ import annotations

import argparse
import json

import pytest

from cli.simulate import add_parser, run
from shared.errors import DeepinferError
from shared.retention import RetentionPolicy
from services.router.policy.profiles import PROFILES, get_profile
from simulator.tier import SimTier, TierPrefix
from simulator.simulate import TraceRequest, _make_policy, Simulation, json_line, simulate

BS = 512
POLICY = RetentionPolicy({"long": 100.0, "short": 10.0, "none": 0.0})
DRAM_S, SSD_S = 1.0, 3.0


def _tier(dram: int, ssd: int) -> SimTier:
    return SimTier(dram, ssd, POLICY, DRAM_S, SSD_S)


def _sharing_trace(convs: int = 6, turns: int = 8, root: int = 6) -> list[TraceRequest]:
    """Multi-turn conversations: turn k of conversation c re-sends the whole history plus one new block."""
    out, t = [], 0.0
    for k in range(turns):
        for c in range(convs):
            ids = tuple(c * 10_000 + j for j in range(root + k))
            out.append(TraceRequest(len(out), t, len(ids) * BS, 8, ids))
            t += 0.5
    return out


def test_block_not_hit_within_ttl_expires_and_one_hit_keeps_it_alive():
    tier = _tier(dram=10, ssd=10)
    tier.put((1, 2), "short", now=0.0)  # both expire at 10
    assert tier.use((1,), "short", now=8.0) == {"dram": 1, "ssd": 0}  # block 1 now expires at 18
    assert tier.prefix((1, 2), now=9.9).sources == ("dram", "dram")
    assert tier.prefix((2,), now=10.0).blocks == 0  # expiry <= now: never served...
    assert 2 not in tier.dram and tier.stats.dram_expiries == 1  # ...and removed
    assert tier.prefix((1, 2), now=17.9).sources == ("dram",)
    assert tier.prefix((1,), now=18.0).blocks == 0
    assert len(tier.dram) == 0


def test_a_short_hit_never_shortens_a_long_block():
    tier = _tier(dram=10, ssd=10)
    tier.put((1,), "long", now=0.0)  # expires at 100
    tier.use((1,), "short", now=50.0)  # max(100, 60)
    tier.put((1,), "none", now=60.0)
    assert tier.dram[1].expiry == 100.0 and tier.dram[1].retention == "long" and tier.dram[1].last_use == 60.0
    assert tier.prefix((1,), now=99.0).blocks == 1


def test_dram_eviction_writes_back_and_an_ssd_hit_is_promoted():
    tier = _tier(dram=2, ssd=10)
    tier.put((1, 2, 3), "long", now=0.0)  # DRAM holds 2 and 3; 1 (least recent) went to SSD
    assert list(tier.dram) == [2, 3] and set(tier.ssd) == {1} and tier.stats.writebacks == 1
    held = tier.prefix((1, 2, 3, 4), now=1.0)
    assert held.sources == ("ssd", "dram", "dram")
    assert tier.use((1, 2, 3), "long", now=1.0) == {"dram": 2, "ssd": 1}
    # in prefix order: 1 is promoted, pushing out 2 (least recent, read already) to SSD; 3 is refreshed
    assert list(tier.dram) == [1, 3] and set(tier.ssd) == {1, 2}
    assert tier.stats.promotions == 1 and tier.stats.writebacks == 2
    assert tier.dram[1] is tier.ssd[1]  # one retention state for both copies
    tier.put((5,), "long", now=2.0)  # pushes out 1: a clean copy, the SSD holds it, nothing written
    assert list(tier.dram) == [3, 5] and set(tier.ssd) == {1, 2} and tier.stats.writebacks == 2
    tier.put((6,), "long", now=3.0)  # pushes out 3: written back
    assert list(tier.dram) == [5, 6] and set(tier.ssd) == {1, 2, 3} and tier.stats.writebacks == 3


def test_ssd_capacity_evicts_by_expiry_then_last_use():
    tier = _tier(dram=0, ssd=3)  # write-through: every put goes straight to SSD
    tier.put((1,), "long", now=0.0)  # expiry 100, last use 0
    tier.put((2,), "short", now=20.0)  # expiry 30: soonest, though written after 1
    tier.put((3,), "long", now=0.0 + 5.0)  # expiry 105
    tier.put((4,), "long", now=25.0)  # full: evicts 2 (expiry 30)
    assert set(tier.ssd) == {1, 3, 4} and tier.stats.ssd_evictions == 1
    tier.use((1,), "short", now=26.0)  # expiry stays 100, last use 26
    tier.put((5,), "long", now=27.0)  # evicts 1 (expiry 100 < 105, 125)
    assert set(tier.ssd) == {3, 4, 5}
    tier.use((3,), "long", now=40.0)  # 3 now expires at 140: 4 (125) goes next
    tier.put((6,), "long", now=41.0)
    assert set(tier.ssd) == {3, 5, 6} and tier.stats.ssd_evictions == 3


def test_equal_expiries_evict_least_recently_used_first():
    policy = RetentionPolicy({"a": 10.0, "b": 5.0})
    tier = SimTier(0, 2, policy, DRAM_S, SSD_S)
    tier.put((1,), "a", now=0.0)  # expiry 10, last use 0
    tier.put((2,), "b", now=5.0)  # expiry 10, last use 5
    tier.put((3,), "a", now=6.0)
    assert set(tier.ssd) == {2, 3}


def test_expired_ssd_blocks_go_before_any_live_one():
    tier = _tier(dram=0, ssd=2)
    tier.put((1,), "short", now=0.0)  # expires at 10
    tier.put((2,), "long", now=1.0)
    tier.put((3,), "long", now=50.0)
    assert set(tier.ssd) == {2, 3} and tier.stats.ssd_expiries == 1 and tier.stats.ssd_evictions == 0


def test_dram_only_blocks_never_reach_ssd():
    tier = _tier(dram=1, ssd=10)
    tier.put((1, 2, 3), "none", now=0.0)
    assert list(tier.dram) == [3] and not tier.ssd and tier.stats.dropped_dram_only == 2
    assert tier.dram[3].expiry == 0.0 and tier.prefix((3,), now=1e9).blocks == 1  # no time-based expiry
    through = _tier(dram=0, ssd=10)  # write-through drops them as well
    through.put((1,), "none", now=0.0)
    assert not through.ssd and through.stats.dropped_dram_only == 1
    tier.use((3,), "long", now=5.0)  # a durable hit makes it SSD-eligible
    tier.put((4,), "none", now=6.0)
    assert set(tier.ssd) == {3} and tier.ssd[3].expiry == 105.0 and list(tier.dram) == [4]


def test_pull_costs_mix_dram_and_ssd():
    held = TierPrefix(("dram", "ssd", "dram", "ssd", "ssd"), DRAM_S, SSD_S)
    assert held.counts() == {"dram": 2, "ssd": 3} and held.counts(2) == {"dram": 1, "ssd": 2}
    assert held.pull_s() == 2 * DRAM_S + 3 * SSD_S and held.pull_s(3) == 2 * SSD_S
    assert held.block_s() == pytest.approx((2 * DRAM_S + 3 * SSD_S) / 5)
    assert held.tokens(3, 4 * BS + 100, BS) == {"dram": 0, "ssd": BS + 100}  # last block partial
    assert TierPrefix((), DRAM_S, SSD_S).block_s() is None
    for prof in PROFILES.values():
        assert prof.tier_block_s("ssd", BS) > prof.tier_block_s("dram", BS) > 0


def test_the_view_shows_the_tier_prefix_at_its_mixed_pull_cost():
    prof = get_profile("llama70b-h200")
    tier = SimTier(2, 10, RetentionPolicy(), prof.tier_block_s("dram", BS), prof.tier_block_s("ssd", BS))
    tier.put((3, 2, 1), "chat", now=0.0)  # tail first: 3 goes to SSD, 1 and 2 stay in DRAM
    tr = TraceRequest(0, 0.0, 4 * BS, 4, (1, 2, 3, 4))
    sim = Simulation([tr], _make_policy("predictive", 0), prof, 2, 0, 100, None, tier, "chat", BS)
    view = sim.view(tr)
    assert view.remote_overlap == 3
    expect = (2 * prof.tier_block_s("dram", BS) + prof.tier_block_s("ssd", BS)) / 3
    assert view.cost.block_transfer_s == pytest.approx(expect)
    assert view.cost.prefill_b == prof.cost_model(BS).prefill_b  # the rest of the cost model is the profile's


def test_a_tier_raises_the_hit_rate_and_ssd_pulls_cost_more_time():
    tr = _sharing_trace()
    kw = dict(num_workers=4, kv_capacity_blocks=8, ttft_slo_s=None, tpot_slo_s=None)
    none = simulate(tr, "round_robin", "llama70b-h200", **kw)
    dram = simulate(tr, "round_robin", "llama70b-h200", tier_dram_blocks=10_000, **kw)
    ssd = simulate(tr, "round_robin", "llama70b-h200", tier_dram_blocks=0, tier_ssd_blocks=10_000, **kw)
    assert dram["hit_rate"] == pytest.approx(dram["ideal_hit_rate"], abs=1e-6)
    assert dram["hit_rate"] > none["hit_rate"] + 0.3
    assert ssd["hit_rate"] == dram["hit_rate"]
    pulled = dram["tier_hit_blocks"]["dram"]
    assert pulled > 0 and dram["tier_hit_blocks"]["ssd"] == 0 and ssd["tier_hit_blocks"] == {"dram": 0, "ssd": pulled}
    assert sum(ssd["_ttfts"]) > sum(dram["_ttfts"])  # same hits, slower pulls
    assert none["tier_hit_blocks"] == {"dram": 0, "ssd": 0} and none["tier"] == {}
    with pytest.raises(ValueError):
        simulate(tr, "round_robin", "llama70b-h200", cache_tier_blocks=5, tier_dram_blocks=5, **kw)


def test_retention_expires_tier_blocks_on_the_simulated_clock():
    """Two requests 100 s apart on two workers (round robin): the second reuses the first's prefix only
    through the tier, and only while the retention class keeps it."""
    tr = [TraceRequest(0, 0.0, 4 * BS, 2, (1, 2, 3, 4)), TraceRequest(1, 100.0, 4 * BS, 2, (1, 2, 3, 5))]
    kw = dict(num_workers=2, kv_capacity_blocks=100, ttft_slo_s=None, tpot_slo_s=None, tier_dram_blocks=100)
    hits = {spec: simulate(tr, "round_robin", "llama70b-h200", retention_policy=RetentionPolicy.from_spec(spec),
                           **kw)["tier_hit_blocks"]["dram"] for spec in ("chat=1h", "chat=50s")}
    assert hits == {"chat=1h": 3, "chat=50s": 0}
    none = simulate(tr, "round_robin", "llama70b-h200", retention="none", **kw)  # DRAM-only: no expiry
    assert none["tier_hit_blocks"]["dram"] == 3
    with pytest.raises(DeepinferError):
        simulate(tr, "round_robin", "llama70b-h200", retention="gold", **kw)


def test_accounting_ledger_matches_the_run():
    tr = _sharing_trace()
    res = simulate(tr, "round_robin", "llama70b-h200", num_workers=4, kv_capacity_blocks=8, tier_dram_blocks=50,
                   tier_ssd_blocks=10_000, retention="agent")
    acc = res["accounting"]
    line = acc["by_tenant"]["default"]["agent"]
    assert list(acc["by_tenant"]) == ["default"] and list(acc["by_tenant"]["default"]) == ["agent"]
    assert line["requests"] == res["served"] == len(tr)
    assert line["cached_tokens"] == res["cached_input_tokens"]
    assert line["uncached_tokens"] == res["uncached_input_tokens"]
    assert line["tier_tokens"] == {k: n * BS for k, n in res["tier_hit_blocks"].items()}  # full blocks only here
    assert line["tier_tokens"]["dram"] > 0 and line["tier_tokens"]["ssd"] > 0
    assert acc["total"]["cost"] == pytest.approx(res["revenue"], abs=1e-6)


def test_same_inputs_same_json():
    tr = _sharing_trace()
    kw = dict(num_workers=3, kv_capacity_blocks=10, tier_dram_blocks=15, tier_ssd_blocks=60, seed=2)
    a = simulate(tr, "kv_cost", "smollm2-cpu", **kw)
    b = simulate(tr, "kv_cost", "smollm2-cpu", **kw)
    assert json_line(a) == json_line(b) and a["tier"]["ssd_evictions"] > 0


def _cli(tmp_path, capsys, *flags: str) -> tuple[int, list[dict], str]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in _sharing_trace()))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    code = run(parser.parse_args(["simulate", "--trace", str(path), "--workers", "4", "--kv-capacity-blocks", "30",
                                  "--policy", "round_robin", *flags]), print)
    out = capsys.readouterr()
    return code, [json.loads(x) for x in out.out.splitlines() if x.startswith("{")], out.out + out.err


def test_cli_tier_flags(tmp_path, capsys):
    code, (res,), text = _cli(tmp_path, capsys, "--tier-frac", "0.5", "--retention", "agent",
                              "--retention-spec", "chat=7d,agent=1h,none=0", "--price-uncached", "2")
    distinct = 6 * (6 + 7)  # 6 conversations of 6 + 7 distinct blocks
    assert code == 0 and (res["tier_ssd_blocks"], res["tier_dram_blocks"]) == (39, 5)
    assert res["hit_rate"] > res["hit_rate_no_tier"] > 0 and "hit no-tier" in text
    assert res["accounting"]["prices"]["uncached_per_mtok"] == 2.0 and res["retention"] == "agent"
    assert distinct == res["distinct_blocks"]
    code, (alias,), text = _cli(tmp_path, capsys, "--cache-tier-blocks", "50")
    assert code == 0 and (alias["tier_dram_blocks"], alias["tier_ssd_blocks"]) == (50, 0)
    code, (plain,), text = _cli(tmp_path, capsys)
    assert code == 0 and "hit_rate_no_tier" not in plain and "hit no-tier" not in text
    assert _cli(tmp_path, capsys, "--tier-frac", "1", "--retention", "gold")[0] == 2
    assert _cli(tmp_path, capsys, "--retention-spec", "chat=soon")[0] == 2
