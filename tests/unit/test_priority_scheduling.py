"""The engine's priority scheduling policy (``--scheduling-policy priority``, vLLM's): a full pool and a
higher-priority arrival preempt the lowest-priority, latest running sequence, every sequence still ends with its
uninterrupted greedy tokens; waiting requests start by (priority, arrival); with every priority equal the
schedule is FCFS's step for step; a priority out of range is refused."""
import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.errors import DeepinferError
from shared.sampling import SamplingParams
from tests.tiny_model import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, max_position_embeddings=256)


def engine(model, policy: str, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=kw.pop("num_kv_blocks", 64),
                                         scheduling_policy=policy, **kw))


def params(priority: int = 0, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)


def prompt(i: int, n: int = 30) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 5 for j in range(n)]


def run(eng: LLMEngine, until_done: bool = True) -> tuple[dict[str, list[int]], list[list[tuple[str, int]]]]:
    """Step to the end: each request's tokens, and per step what ran ((request id, tokens) in batch order)."""
    tokens: dict[str, list[int]] = {}
    steps = []
    while eng.has_unfinished():
        outs = eng.step()
        steps.append([(o.request_id, len(o.new_token_ids)) for o in outs])
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, steps


def test_equal_priorities_schedule_as_fcfs(model):
    traces = []
    for policy in ("fcfs", "priority"):
        eng = engine(model, policy, num_kv_blocks=14, max_num_batched_tokens=32)   # tight: preemptions happen
        for i in range(5):
            eng.add_request(prompt(i), params(priority=3), request_id=f"r{i}")
        traces.append((run(eng), eng.num_preemptions))
    (fcfs, fcfs_preempted), (prio, prio_preempted) = traces
    assert fcfs == prio and fcfs_preempted == prio_preempted > 0


def test_a_high_priority_arrival_preempts_the_lowest_and_all_end_exact(model):
    reference = engine(model, "fcfs")
    want = {f"low{i}": reference.generate([prompt(i)], params())[0] for i in range(3)}
    want["high"] = reference.generate([prompt(9)], params())[0]
    eng = engine(model, "priority", num_kv_blocks=18)   # three 42-token sequences fill it
    got: dict[str, list[int]] = {}

    def step() -> None:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    for i in range(3):
        eng.add_request(prompt(i), params(priority=5), request_id=f"low{i}")
    for _ in range(12):
        step()
    assert [r.request_id for r in eng.scheduler.running] == ["low0", "low1", "low2"]
    assert eng.block_manager.num_free_blocks == 0
    eng.add_request(prompt(9), params(priority=0), request_id="high")
    step()
    assert [r.request_id for r in eng.scheduler.running] == ["high", "low0", "low1"]   # low2, the latest, made room
    assert [r.request_id for r in eng.scheduler.waiting] == ["low2"] and "high" in got
    assert eng.requests["low2"].stats.num_preemptions == 1
    while eng.has_unfinished():
        step()
    assert got == want


def test_waiting_requests_start_by_priority_then_arrival(model):
    eng = engine(model, "priority", max_num_seqs=1)
    order = []
    eng.add_request(prompt(1), params(9, max_tokens=3), request_id="early-batch")
    eng.step()   # it runs: a seat is not taken back (only KV pressure preempts)
    for rid, priority in (("batch", 9), ("chat-a", 0), ("batch-2", 9), ("chat-b", 0)):
        eng.add_request(prompt(len(rid)), params(priority, max_tokens=3), request_id=rid)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["early-batch", "chat-a", "chat-b", "batch", "batch-2"]
    fcfs = engine(model, "fcfs", max_num_seqs=1)
    with pytest.raises(DeepinferError, match="priority"):
        fcfs.add_request(prompt(1), SamplingParams(priority=2**31))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="edf")
