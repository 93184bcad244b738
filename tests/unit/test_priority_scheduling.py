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


def stepper(eng: LLMEngine, got: dict[str, list[int]]):
    """One engine step per call, each request's tokens gathered into ``got``."""
    def step() -> None:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return step


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
    eng.step()   # it runs; the seat is taken back by the first more urgent arrival
    for rid, priority in (("batch", 9), ("chat-a", 0), ("batch-2", 9), ("chat-b", 0)):
        eng.add_request(prompt(len(rid)), params(priority, max_tokens=3), request_id=rid)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["chat-a", "chat-b", "early-batch", "batch", "batch-2"]
    assert eng.num_preemptions == 1
    fcfs = engine(model, "fcfs", max_num_seqs=1)
    with pytest.raises(DeepinferError, match="priority"):
        fcfs.add_request(prompt(1), SamplingParams(priority=2**31))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="edf")


def test_a_more_urgent_arrival_takes_a_seat_back_and_all_end_exact(model):
    """``max_num_seqs`` seats all taken by less urgent sequences (KV to spare): an urgent arrival preempts the
    latest of them for its seat at once; an arrival of equal priority waits; every sequence ends exact."""
    reference = engine(model, "fcfs")
    want = {rid: reference.generate([prompt(i)], params())[0] for i, rid in enumerate(["b0", "b1", "same", "chat"])}
    eng = engine(model, "priority", max_num_seqs=2)
    got: dict[str, list[int]] = {}
    step = stepper(eng, got)

    for i, rid in enumerate(["b0", "b1"]):
        eng.add_request(prompt(i), params(priority=1_000_000), request_id=rid)
    for _ in range(5):
        step()
    eng.add_request(prompt(2), params(priority=1_000_000), request_id="same")
    step()
    assert [r.request_id for r in eng.scheduler.running] == ["b0", "b1"] and eng.num_preemptions == 0
    eng.add_request(prompt(3), params(priority=-1_000_000), request_id="chat")
    step()
    assert [r.request_id for r in eng.scheduler.running] == ["chat", "b0"] and "chat" in got
    assert [r.request_id for r in eng.scheduler.waiting] == ["b1", "same"] and eng.num_preemptions == 1
    while eng.has_unfinished():
        step()
    assert got == want


@pytest.mark.parametrize("steps_before", range(6, 12))   # 8: the preempting step fills its block
def test_a_sequence_preempted_after_its_allocation_leaves_no_unwritten_block_cached(model, steps_before):
    """The victim was already scheduled in the step (its blocks for it published at allocation, their KV not yet
    written); taken out of the step, those blocks leave the prefix cache, so its resume recomputes them rather
    than hit garbage: every sequence ends exact."""
    reference = engine(model, "fcfs", enable_prefix_caching=False)
    want = {rid: reference.generate([prompt(i, 7)], params())[0] for i, rid in enumerate(["b0", "b1", "chat"])}
    eng = engine(model, "priority", max_num_seqs=2)
    got: dict[str, list[int]] = {}
    step = stepper(eng, got)

    for i, rid in enumerate(["b0", "b1"]):
        eng.add_request(prompt(i, 7), params(priority=9), request_id=rid)
    for _ in range(1 + steps_before):
        step()
    victim = eng.requests["b1"]
    computed = victim.num_computed_tokens
    eng.add_request(prompt(2, 7), params(priority=0), request_id="chat")
    step()
    assert eng.num_preemptions == 1 and victim.stats.num_preemptions == 1
    unwritten = victim.block_hashes[computed // 8:]
    assert not set(unwritten) & set(eng.block_manager.cached), (computed, victim.num_tokens)
    while eng.has_unfinished():
        step()
    assert got == want
