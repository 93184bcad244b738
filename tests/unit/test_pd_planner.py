"""The online P:D planner (services/router/policy/pd_planner.py): what it switches or scales, and the bounds on flapping."""
import pytest

from services.router.policy.pd_planner import Planner, PlannerConfig, PoolWorker, pressures
from services.router.policy.types import CostModel

COST = CostModel(prefill_b=1e-3)  # 1,000 prompt tokens per second per prefill worker
CFG = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=3, cooldown_s=10.0, dwell_s=60.0)


def prefill(wid, queued=0, switchable=True, draining=False):
    return PoolWorker(wid, "prefill", switchable, queued_prefill_tokens=queued, max_num_seqs=8, draining=draining)


def decode(wid, running=0, step_s=0.01, kv=0.1, switchable=True):
    return PoolWorker(wid, "decode", switchable, num_running=running, kv_usage=kv, step_s=step_s, max_num_seqs=8)


PREFILL_SHORT = [prefill("p0", queued=2000), decode("d0", 1), decode("d1", 0), decode("d2", 1)]
DECODE_SHORT = [prefill("p0"), prefill("p1"), prefill("p2"), decode("d0", 8, step_s=0.12)]


def test_pressures_are_the_ttft_and_tpot_against_their_slos():
    p, d = pressures(CFG, COST, PREFILL_SHORT)
    assert p == pytest.approx(2.0)               # 2,000 queued tokens on one worker: 2 s for a 1 s SLO
    assert d == pytest.approx((1 / 8 + 0.1 + 1 / 8) / 3)  # per worker: max(step/SLO, KV, occupancy)
    assert pressures(CFG, COST, DECODE_SHORT)[1] == pytest.approx(1.2)   # 0.12 s steps for a 0.1 s SLO
    draining = [prefill("p0", queued=2000, draining=True), prefill("p1")]
    assert pressures(CFG, COST, draining)[0] == pytest.approx(2.0)       # its queue counts, its capacity not


def test_a_short_role_takes_the_least_loaded_switchable_worker_after_a_sustained_streak():
    planner = Planner(CFG, COST)
    assert planner.decide(0.0, PREFILL_SHORT) == [] and planner.decide(1.0, PREFILL_SHORT) == []
    (action,) = planner.decide(2.0, PREFILL_SHORT)    # the third evaluation in a row
    assert (action.kind, action.worker_id, action.role, action.reason) == ("switch", "d1", "prefill",
                                                                           "prefill_pressure")
    assert action.prefill_pressure == pytest.approx(2.0)
    planner = Planner(CFG, COST)
    actions = [planner.decide(float(t), DECODE_SHORT) for t in range(3)]
    assert [a.worker_id for a in actions[2]] == ["p0"] and actions[2][0].role == "decode"


def test_nothing_moves_inside_the_band_or_when_the_donor_would_be_short():
    planner = Planner(CFG, COST)
    calm = [prefill("p0", queued=600), decode("d0", 2), decode("d1", 2)]  # 0.6: between low and high
    assert all(planner.decide(float(t), calm) == [] for t in range(10))
    busy_donor = [prefill("p0", queued=2000), decode("d0", 4), decode("d1", 4)]  # decode 0.5 -> 1.0 after giving
    assert all(planner.decide(float(t), busy_donor) == [] for t in range(10))
    last_decode = [prefill("p0", queued=2000), decode("d0", 0)]  # min_decode 1
    assert all(planner.decide(float(t), last_decode) == [] for t in range(10))
    fixed = [prefill("p0", queued=2000), decode("d0", 0, switchable=False), decode("d1", 0, switchable=False)]
    assert all(planner.decide(float(t), fixed) == [] for t in range(10))  # no scaling configured either


def test_more_of_the_same_shortage_waits_a_third_of_the_cooldown_a_reversal_all_of_it():
    cfg = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=1, cooldown_s=30.0, dwell_s=0.0)
    planner = Planner(cfg, COST)
    short = [prefill("p0", queued=20_000), *(decode(f"d{i}", 1) for i in range(4))]
    assert [a.worker_id for a in planner.decide(0.0, short)] == ["d0"]
    still = [prefill("p0", queued=20_000), prefill("d0", queued=20_000), *(decode(f"d{i}", 1) for i in (1, 2, 3))]
    assert planner.decide(9.0, still) == [] and [a.worker_id for a in planner.decide(10.0, still)] == ["d1"]
    reverse = [prefill("p0"), prefill("d0"), prefill("d1"), decode("d2", 8, step_s=0.2), decode("d3", 8, step_s=0.2)]
    assert planner.decide(30.0, reverse) == [] and planner.decide(40.0, reverse) != []


def test_an_interrupted_streak_starts_over():
    planner = Planner(CFG, COST)
    calm = [prefill("p0"), decode("d0"), decode("d1")]
    for t, load in enumerate([PREFILL_SHORT, PREFILL_SHORT, calm, PREFILL_SHORT, PREFILL_SHORT]):
        assert planner.decide(float(t), load) == []
    assert planner.decide(5.0, PREFILL_SHORT) != []


def test_flapping_is_bounded_by_cooldown_and_dwell():
    """The load flips every 3 s for 10 minutes: reversals at most one per cooldown (more of the same shortage one
    per third of it), a worker never switches back within its dwell time, and at least one worker per role."""
    cfg = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=2, cooldown_s=20.0, dwell_s=45.0)
    planner = Planner(cfg, COST)
    roles = {"w0": "prefill", "w1": "decode", "w2": "decode", "w3": "decode"}
    decisions = []
    for t in range(600):
        prefill_heavy = (t // 3) % 2 == 0
        pool = [PoolWorker(w, r, True, queued_prefill_tokens=3000 if (r == "prefill" and prefill_heavy) else 0,
                           num_running=0 if prefill_heavy else 8, step_s=0.01 if prefill_heavy else 0.2,
                           max_num_seqs=8) for w, r in roles.items()]
        for a in planner.decide(float(t), pool):
            decisions.append(a)
            roles[a.worker_id] = a.role
    assert decisions, "the planner never acted"
    for a, b in zip(decisions, decisions[1:]):   # a reversal waits the whole cooldown, more of the same a third
        assert b.at - a.at >= (cfg.cooldown_s / 3 if a.role == b.role else cfg.cooldown_s)
    reversals = sum(a.role != b.role for a, b in zip(decisions, decisions[1:]))
    assert reversals <= 600 / cfg.cooldown_s and len(decisions) <= 3 * 600 / cfg.cooldown_s + 1
    last: dict[str, float] = {}
    for a in decisions:
        assert a.at - last.get(a.worker_id, -1e9) >= cfg.dwell_s
        last[a.worker_id] = a.at
    assert min(list(roles.values()).count(r) for r in ("prefill", "decode")) >= 1


def test_scaling_where_no_worker_can_switch_and_shrinking_an_idle_role():
    cfg = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=1, cooldown_s=0.0, max_prefill=2, max_decode=3)
    planner = Planner(cfg, COST)
    fixed = [prefill("p0", queued=2000, switchable=False), decode("d0", 4, switchable=False)]
    (up,) = planner.decide(0.0, fixed)
    assert (up.kind, up.role, up.delta) == ("scale", "prefill", 1)
    at_max = [*fixed, prefill("p1", queued=2000, switchable=False)]
    assert planner.decide(1.0, at_max) == []                      # max_prefill reached
    idle = [prefill("p0", switchable=False), decode("d0", switchable=False, step_s=0.0, kv=0.0),
            decode("d1", switchable=False, step_s=0.0, kv=0.0)]
    (down,) = planner.decide(2.0, idle)
    assert (down.kind, down.role, down.delta, down.reason) == ("scale", "decode", -1, "decode_idle")
    stats = planner.stats()
    assert stats["decisions"] == {"scale:decode:decode_idle": 1, "scale:prefill:prefill_pressure": 1}
    assert [a["kind"] for a in stats["recent"]] == ["scale", "scale"]


def test_a_bad_config_is_refused():
    for bad in ({"low": 0.9, "high": 0.8}, {"sustain": 0}, {"ttft_slo_s": 0}, {"max_decode": -1}):
        with pytest.raises(ValueError):
            PlannerConfig(**bad)


def test_a_far_shorter_role_takes_a_worker_even_if_the_donor_ends_above_low():
    """Prefill is drowning (pressure ~20) and decode, one worker smaller, would sit at 0.6 (above low, under
    high): the switch is made; at 0.45 vs 0.7 (not twice) it is not."""
    cfg = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=1, cooldown_s=0.0)
    drowning = [prefill("p0", queued=20_000), decode("d0", 3), decode("d1", 3), decode("d2", 3, switchable=False),
                decode("d3", 3, switchable=False)]            # decode 0.375 -> 0.5 after giving one
    assert pressures(cfg, COST, drowning)[1] == pytest.approx(0.375)
    assert [a.worker_id for a in Planner(cfg, COST).decide(0.0, drowning)] == ["d0"]
    mild = [prefill("p0", queued=900), *drowning[1:]]         # 0.9 vs 0.5 after: not twice
    assert Planner(cfg, COST).decide(0.0, mild) == []


def test_kv_usage_presses_only_on_its_way_to_preemption():
    well_used = [prefill("p0"), decode("d0", 1, kv=0.8), decode("d1", 1, kv=0.8)]
    assert pressures(CFG, COST, well_used)[1] == pytest.approx(0.3 / 0.45)
    nearly_full = [prefill("p0"), decode("d0", 1, kv=0.95), decode("d1", 1, kv=0.95)]
    assert pressures(CFG, COST, nearly_full)[1] == pytest.approx(1.0)


def test_scale_ups_still_starting_count_against_the_maximum():
    """Workers take longer to start than the cooldown: the planner never asks past max_prefill meanwhile."""
    cfg = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=1, cooldown_s=10.0, scale_settle_s=60.0,
                        max_prefill=3)
    planner = Planner(cfg, COST)
    short = [prefill("p0", queued=5000, switchable=False), decode("d0", 4, switchable=False)]
    ups = [a for t in range(0, 50, 5) for a in planner.decide(float(t), short)]
    assert [a.delta for a in ups] == [1, 1]                   # 1 + 2 starting = 3 = max_prefill
    assert planner.decide(70.0, short) != []                  # they never came: asked again once settled


def test_a_scale_up_stops_counting_once_its_worker_reports():
    cfg = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, sustain=1, cooldown_s=0.0, scale_settle_s=120.0,
                        max_decode=4)
    planner = Planner(cfg, COST)
    short = [prefill("p0", switchable=False), decode("d0", 8, step_s=0.2, switchable=False)]
    assert [a.delta for a in planner.decide(0.0, short)] == [1]
    assert planner.decide(5.0, short) != []                   # 1 + 1 starting < 4: one more
    started = [*short, decode("d1", 8, step_s=0.2, switchable=False)]
    assert planner.decide(10.0, started) != []                # 2 reported + 1 still starting = 3 < 4
    assert planner.decide(11.0, started) == []                # 2 reported + 2 starting = 4
