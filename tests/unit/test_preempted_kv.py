"""A preempted sequence's KV offered to the cache tier and resumed from it (``shared/engine/preempted_kv.py``), the
engine's half: the worker's half (a real tier over NATS) is ``tests/integration/test_preempted_resume.py``. Here the
offered copy itself comes back as the tier's answer would (the same bytes): the victim resumes with a prefix hit
over the blocks it had computed (fewer tokens computed than a recompute), ends exact, and every way an offer can
fail — no answer in time, over the byte budget, aborted while waiting — recomputes or ends cleanly."""
import types

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.kv import block_pack
from shared.sampling import SamplingParams
from tests.tiny_model import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, max_position_embeddings=256)


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=kw.pop("num_kv_blocks", 64),
                                         scheduling_policy="priority", **kw))


def params(priority: int = 0, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)


def prompt(i: int, n: int = 30) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 5 for j in range(n)]


class Worker:
    """The worker's side as the engine sees it: offers kept, a wanted victim answered with its own blocks (what
    the tier holds after the write) unless ``answer`` is off; events recorded in order."""

    def __init__(self, eng: LLMEngine, answer: bool = True) -> None:
        self.eng, self.answer = eng, answer
        self.offers, self.events, self.resumed = {}, [], set()

    def sink(self, kind: str, rid: str, payload) -> None:
        self.events.append((kind, rid))
        if kind == "offer":
            self.offers[rid] = payload

    def serve(self) -> None:
        """Between steps (as the worker's engine commands run): resume every wanted victim."""
        for kind, rid in list(self.events):
            if kind == "wanted" and self.answer and rid not in self.resumed:
                self.resumed.add(rid)
                offer = self.offers[rid]
                self.eng.kv_port.preempted.released(offer.nbytes)
                mask = block_pack.decode_mask(offer.window_mask, len(offer.chain.keys)) if offer.window_mask else None
                pulled = types.SimpleNamespace(first=0, kv=offer.kv, has_window=mask)
                self.eng.kv_port.preempted.resume(rid, pulled)


def run_preempting(model, worker_answers: bool | None, **kw):
    """Three low-priority sequences fill the pool; a high-priority arrival preempts the latest. Returns the
    engine, its outputs, the worker (None: offers off) and the tokens the engine computed in all."""
    max_bytes = kw.pop("max_bytes", 1 << 30)
    eng = engine(model, num_kv_blocks=18, **kw)
    worker = None
    if worker_answers is not None:
        worker = Worker(eng, worker_answers)
        eng.kv_port.preempted.enable(worker.sink, max_bytes=max_bytes, wait_s=0.05)
    computed = [0]
    execute = eng.runner.execute

    def counting(sched):
        computed[0] += sched.num_batched_tokens
        return execute(sched)
    eng.runner.execute = counting
    got: dict[str, list[int]] = {}
    for i in range(3):
        eng.add_request(prompt(i), params(priority=5), request_id=f"low{i}")
    steps = 0
    while eng.has_unfinished():
        if steps == 12:
            eng.add_request(prompt(9), params(priority=0), request_id="high")
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if worker is not None:
            worker.serve()
        steps += 1
    return eng, got, worker, computed[0]


@pytest.fixture(scope="module")
def want(model):
    reference = engine(model)
    out = {f"low{i}": reference.generate([prompt(i)], params())[0] for i in range(3)}
    out["high"] = reference.generate([prompt(9)], params())[0]
    return out


def test_a_victim_resumes_from_its_offered_blocks_and_ends_exact(model, want):
    eng, got, worker, computed = run_preempting(model, worker_answers=True)
    _, got_off, _, computed_off = run_preempting(model, worker_answers=None)
    assert got == want and got_off == want
    c = eng.kv_port.preempted.counters
    assert eng.num_preemptions >= 1 and c.offers == eng.num_preemptions and c.resumed + c.kept == c.offers and c.resumed >= 1
    offer = worker.offers["low2"]
    assert len(offer.token_ids) == 8 * len(offer.chain.keys) and offer.all_token_ids[:len(offer.token_ids)] == \
        offer.token_ids
    assert c.resumed_blocks >= 1
    once = 4 * (30 + 40 - 1)   # every token's KV once: what ran beyond is at most the victims' unfinished blocks
    assert once <= computed < once + 8 * eng.num_preemptions
    # the resumed victim's prefix came from its blocks: a recompute would have run them again
    assert computed_off - computed >= 8 * c.resumed_blocks
    kinds = [k for k, rid in worker.events if rid == "low2"]
    assert kinds[:2] == ["offer", "wanted"] and "gone" not in kinds


def test_an_offer_that_never_comes_back_is_recomputed_after_the_wait(model, want):
    eng, got, worker, _ = run_preempting(model, worker_answers=False)
    assert got == want
    c = eng.kv_port.preempted.counters
    assert c.offers >= 1 and c.resumed == 0 and c.recomputed == c.offers
    assert [k for k, rid in worker.events if rid == "low2"][:3] == ["offer", "wanted", "gone"]


def test_over_the_byte_budget_nothing_is_offered(model, want):
    eng, got, worker, _ = run_preempting(model, worker_answers=True, max_bytes=1)
    assert got == want
    c = eng.kv_port.preempted.counters
    assert c.offers == 0 and c.not_offered == eng.num_preemptions >= 1 and not worker.offers


def test_an_awaiting_victim_aborted_is_reported_gone(model):
    eng = engine(model, num_kv_blocks=18)
    worker = Worker(eng, answer=False)
    eng.kv_port.preempted.enable(worker.sink, max_bytes=1 << 30, wait_s=60.0)
    for i in range(3):
        eng.add_request(prompt(i), params(priority=5), request_id=f"low{i}")
    for _ in range(12):
        eng.step()
    eng.add_request(prompt(9), params(priority=0), request_id="high")
    eng.step()
    assert ("offer", "low2") in worker.events and eng.requests["low2"].resume_wait_s > 0
    eng.abort("low2")
    assert worker.events[-1] == ("gone", "low2")
    worker.answer = True
    while eng.has_unfinished():   # the others end (later victims resumed); nothing waits for the aborted one
        eng.step()
        worker.serve()
    assert "low2" not in eng.requests and eng.kv_port.preempted.counters.recomputed == 0


def test_enable_refuses_a_zero_budget(model):
    eng = engine(model)
    with pytest.raises(ValueError):
        eng.kv_port.preempted.enable(lambda *a: None, max_bytes=0, wait_s=1.0)


def test_a_sliding_window_victim_resumes_from_its_packed_run_exact():
    """KV groups (a Gemma-3-shaped model, window 8): the offer is a packed run whose window rows travel only where
    the victim still held them; its resume skips what the device kept and imports the rest; exact."""
    import torch
    from shared.model.llama import LlamaModel
    from tests.gemma_factory import gemma_config, gemma_weights
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, window=8, num_layers=7)
    swa = LlamaModel(config, gemma_weights(config, seed=3, dtype=torch.float64), torch.float64, torch.device("cpu"))

    def build(**kw):
        return LLMEngine(swa, EngineConfig(block_size=4, num_kv_blocks=kw.pop("blocks", 256), swa_kv=True,
                                           max_num_batched_tokens=32, scheduling_policy="priority", **kw))
    prompts = [prompt(i, 22) for i in range(4)]
    ref = build()
    want = [ref.generate([p], params(max_tokens=24))[0] for p in prompts]
    eng = build(blocks=40, num_window_kv_blocks=40)
    worker = Worker(eng)
    eng.kv_port.preempted.enable(worker.sink, max_bytes=1 << 30, wait_s=5.0)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, params(priority=5, max_tokens=24), request_id=f"low{i}")
    steps = 0
    while eng.has_unfinished():
        if steps == 6:
            eng.add_request(prompts[3], params(priority=0, max_tokens=24), request_id="high")
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        worker.serve()
        steps += 1
    assert [got[f"low{i}"] for i in range(3)] + [got["high"]] == want
    c = eng.kv_port.preempted.counters
    assert c.offers >= 1 and c.resumed + c.kept == c.offers and c.resumed >= 1 and c.resumed_blocks >= 1, c
    assert any(o.window_mask for o in worker.offers.values())
