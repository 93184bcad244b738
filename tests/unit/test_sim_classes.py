"""SLO classes in the simulator (``simulator/classes.py``): a seeded mix, the router's gate and the engines'
priority order and seat rule; attainment per class against each class's own targets."""
import dataclasses

import pytest

from services.router.policy.profiles import get_profile
from simulator.classes import ClassMix
from simulator.simulate import simulate
from simulator.trace import TraceRequest


def test_a_mix_is_parsed_and_drawn_deterministically():
    mix = ClassMix.parse("interactive=1,batch=3")
    assert dict(mix.shares) == {"interactive": 0.25, "batch": 0.75}
    drawn = mix.assign(4000, seed=3)
    assert drawn == mix.assign(4000, seed=3) and drawn != mix.assign(4000, seed=4)
    assert 0.22 < drawn.count("interactive") / 4000 < 0.28 and set(drawn) == {"interactive", "batch"}
    assert mix.priority("interactive") < mix.priority("batch")
    assert mix.ttft_target("interactive", 2.0) is None           # more urgent than the default: not refused
    assert ClassMix.parse("standard=1", ttft_slo_s=2.0).ttft_target("standard", 2.0) == 2.0
    assert ClassMix.parse("batch=1", on=False).ttft_target("batch", 2.0) == 2.0   # off: the deployment's one
    assert ClassMix.parse("batch=1", on=False).priority("batch") == 0
    for bad in ("gold=1", "batch=0", "batch=x", ""):
        with pytest.raises(ValueError):
            ClassMix.parse(bad)


def one_seat_run(on: bool) -> dict:
    """One worker with one seat: a long batch request, then an interactive one while it decodes."""
    profile = dataclasses.replace(get_profile("smollm2-cpu"), max_num_seqs=1)
    trace = [TraceRequest(0, 0.0, 256, 400, (1,)), TraceRequest(1, 1.0, 64, 8, (2,))]
    mix = _Fixed(ClassMix.parse("interactive=1,batch=1", on=on), {0: "batch", 1: "interactive"})
    return simulate(trace, "least_loaded", profile, num_workers=1, kv_capacity_blocks=64, block_size=64,
                    ttft_slo_s=None, tpot_slo_s=None, classes=mix)


class _Fixed:
    """A mix whose draw is given (the scenario's classes), everything else the wrapped mix's."""

    def __init__(self, mix: ClassMix, classes: dict[int, str]) -> None:
        self.mix, self.classes = mix, classes

    def __getattr__(self, name):
        return getattr(self.mix, name)

    def assign(self, n: int, seed: int) -> list[str]:
        return [self.classes[i] for i in range(n)]


def test_an_urgent_request_takes_the_only_seat_back_with_classes_on():
    on, off = one_seat_run(True), one_seat_run(False)
    assert on["preemptions"] == 1 and off["preemptions"] == 0
    fast, slow = on["classes"]["interactive"]["ttft_p50_s"], off["classes"]["interactive"]["ttft_p50_s"]
    assert fast < 0.5 < slow, (fast, slow)      # off: it waits for the batch request's 400 tokens
    assert on["served"] == off["served"] == 2    # the preempted one is recomputed and ends
    assert on["classes"]["batch"]["ttft_p50_s"] == off["classes"]["batch"]["ttft_p50_s"]   # it started first
    assert on == one_seat_run(True)              # deterministic


def test_per_class_results_cover_every_request_of_a_workload():
    from simulator.workloads import shifting_workload

    trace = shifting_workload(chat_s=10.0, agent_s=10.0, chat_rps=8.0)
    mix = ClassMix.parse("interactive=0.2,standard=0.3,batch=0.5", ttft_slo_s=2.0)
    res = simulate(trace, "predictive", num_workers=2, classes=mix)
    assert sum(row["requests"] for row in res["classes"].values()) == len(trace)
    assert sum(row["served"] for row in res["classes"].values()) == res["served"]
    assert res["classes_on"] and res == simulate(trace, "predictive", num_workers=2, classes=mix)
