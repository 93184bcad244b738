"""The agent workload (simulator/workloads.agent_workload): deterministic under a seed, the seed's 77K-token mean
input, chained block ids like the Mooncake trace, sessions that end; written as Mooncake JSONL it reads back
unchanged; ``deepinfer simulate --workload agent`` replays it with the agent retention class and a ledger that
adds up."""
from __future__ import annotations

import argparse
import json
import math
import statistics

from cli.simulate import add_parser, run
from simulator.trace import load_trace, write_trace
from simulator.workloads import agent_workload


def test_deterministic_under_a_seed_with_the_seeds_mean_input():
    a, b, other = agent_workload(seed=3), agent_workload(seed=3), agent_workload(seed=4)
    assert a == b and a != other
    for seed in range(3):
        mean = statistics.mean(r.input_length for r in agent_workload(seed=seed))
        assert 70_000 < mean < 85_000, (seed, mean)


def test_ids_are_chained_and_sessions_end():
    reqs = agent_workload(duration_s=200.0, seed=1)
    assert [r.idx for r in reqs] == list(range(len(reqs)))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(reqs, reqs[1:]))
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_length / 512) and r.input_length <= 180_000
        assert 32 <= r.output_length <= 256
        for i, h in enumerate(r.hash_ids):   # an id always stands after the same prefix
            assert prefix_of.setdefault(h, r.hash_ids[:i]) == r.hash_ids[:i]
    shared = {r.hash_ids[0] for r in reqs}
    assert shared <= {0, 16, 32, 48}   # every session starts on one of the 4 tool preambles
    lengths = sorted({r.input_length for r in reqs})
    assert lengths[0] < 12_000 and lengths[-1] > 100_000   # sessions grow, and fresh ones keep starting


def test_written_trace_reads_back(tmp_path):
    reqs = agent_workload(duration_s=60.0, seed=2)
    path = tmp_path / "agent.jsonl"
    assert write_trace(reqs, str(path)) == len(reqs)
    back = load_trace(str(path))
    assert [(r.input_length, r.output_length, r.hash_ids) for r in back] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in reqs]
    assert max(abs(x.arrival_s - y.arrival_s) for x, y in zip(back, reqs)) < 1e-3


def test_simulate_replays_agent_sessions_with_the_agent_class(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    path = tmp_path / "out.jsonl"
    code = run(parser.parse_args(["simulate", "--workload", "agent", "--limit", "120", "--policy", "cache_aware",
                                  "--workers", "4", "--tier-frac", "0.5", "--json", "--write-trace", str(path)]),
               print)
    res = json.loads(capsys.readouterr().out.splitlines()[0])
    assert code == 0 and res["retention"] == "agent" and res["requests"] == 120 == len(load_trace(str(path)))
    line = res["accounting"]["by_tenant"]["default"]["agent"]
    assert line["cached_tokens"] + line["uncached_tokens"] == line["prompt_tokens"]
    assert abs(line["cost"] - (line["cached_tokens"] * 0.02 + line["uncached_tokens"] * 1.0) / 1e6) < 1e-4
    assert res["hit_rate_tokens"] > res["hit_rate_no_tier"] > 0
