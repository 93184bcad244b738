"""Speculative decoding in the engine: greedy output equals plain greedy token for token whatever the drafter
proposes; rejected drafts leave the block manager as if never proposed; stop rules, preemption and a broken
drafter behave; the acceptance rule keeps sampled tokens distributed exactly as the target's."""
import dataclasses

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.engine.spec_verify import verify
from shared.engine.speculator import SpecConfig, Speculator
from shared.spec.types import Proposal, TokenFeatures
from tests.tiny_model import tiny_model

BS = 8
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 120 + 1 for i in range(n)] for j, n in ((1, 9), (2, 30), (3, 17))]


def engine(model, blocks=64, spec=None, batched=64):
    eng = LLMEngine(model, EngineConfig(block_size=BS, num_kv_blocks=blocks, max_num_batched_tokens=batched))
    eng.set_speculator(spec)
    return eng


class OracleDrafter:
    """Proposes the reference continuation, wrong at every ``wrong_every``-th drafted position (so proposals
    are partly accepted, partly rejected)."""
    name = "oracle"

    def __init__(self, prompts, outputs, wrong_every=3):
        self.ref = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.wrong_every, self.calls = wrong_every, 0

    def propose(self, sequences, k):
        out = []
        for seq in sequences:
            tokens = list(seq.token_ids)
            prompt = next(p for p in self.ref if tuple(tokens[:len(p)]) == p)
            done = len(tokens) - len(prompt)
            draft = self.ref[prompt][done:done + k]
            self.calls += 1
            draft = [(t + 1) % 100 if (i + self.calls) % self.wrong_every == 0 else t for i, t in enumerate(draft)]
            out.append(Proposal(draft, [TokenFeatures(position=i) for i in range(len(draft))]))
        return out


def run_all(eng, prompts, params):
    ids = [eng.add_request(p, params) for p in prompts]
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
            bm = eng.block_manager
            for rid in bm.req_to_blocks:       # rollback: exactly the blocks of the tokens with KV
                req = eng.requests.get(rid)
                if req is not None and not req.spec_token_ids:
                    assert len(bm.block_ids(rid)) <= -(-(req.num_computed_tokens + 1) // BS)
    return [got[i] for i in ids]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def reference(model):
    return run_all(engine(model), PROMPTS, PARAMS)


def test_greedy_output_equals_plain_decoding_and_saves_forwards(model, reference):
    spec = Speculator(OracleDrafter(PROMPTS, reference), SpecConfig(k=4))
    eng = engine(model, spec=spec)
    assert run_all(eng, PROMPTS, PARAMS) == reference
    c = spec.counters
    assert 0 < c.accepted < c.drafted and c.proposals > 0
    assert spec.stats()["tokens_per_forward"] > 1.5
    plain = engine(model)
    run_all(plain, PROMPTS, PARAMS)
    # the prefix cache ends up holding exactly the same blocks, and every block is free again
    assert set(eng.block_manager.cached) == set(plain.block_manager.cached)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_drafter_that_is_always_wrong_changes_nothing(model, reference):
    class Wrong:
        name = "wrong"

        def propose(self, sequences, k):
            return [Proposal([0] * k, [TokenFeatures()] * k) for _ in sequences]
    spec = Speculator(Wrong(), SpecConfig(k=3))
    assert run_all(engine(model, spec=spec), PROMPTS, PARAMS) == reference
    assert spec.counters.accepted == 0 and spec.counters.drafted > 0


def test_preemption_with_speculation_keeps_greedy_exact(model, reference):
    spec = Speculator(OracleDrafter(PROMPTS, reference, wrong_every=4), SpecConfig(k=5))
    eng = engine(model, blocks=9, spec=spec, batched=16)     # 9 blocks for 3 requests needing 5+7+6
    assert run_all(eng, PROMPTS, PARAMS) == reference
    assert eng.num_preemptions > 0


def test_stop_rules_hold_inside_an_accepted_proposal(model, reference):
    stop_at = reference[1][5]
    params = dataclasses.replace(PARAMS, ignore_eos=False, stop_token_ids=(stop_at,))
    plain = run_all(engine(model), PROMPTS, params)
    spec = Speculator(OracleDrafter(PROMPTS, reference, wrong_every=100), SpecConfig(k=5))
    assert run_all(engine(model, spec=spec), PROMPTS, params) == plain
    short = dataclasses.replace(PARAMS, max_tokens=7)
    assert [len(o) for o in run_all(engine(model, spec=Speculator(OracleDrafter(PROMPTS, reference), SpecConfig(k=5))),
                                    PROMPTS, short)] == [7, 7, 7]


def test_a_broken_drafter_or_a_large_batch_means_plain_decoding(model, reference):
    class Broken:
        name = "broken"

        def propose(self, sequences, k):
            raise RuntimeError("drafter down")
    spec = Speculator(Broken(), SpecConfig(k=3))
    assert run_all(engine(model, spec=spec), PROMPTS, PARAMS) == reference
    assert spec.counters.drafter_errors > 0 and spec.counters.drafted == 0
    crowded = Speculator(OracleDrafter(PROMPTS, reference), SpecConfig(k=3, max_batch=2))
    assert run_all(engine(model, spec=crowded), PROMPTS, PARAMS) == reference
    opted_out = Speculator(OracleDrafter(PROMPTS, reference), SpecConfig(k=3))
    assert run_all(engine(model, spec=opted_out), PROMPTS, dataclasses.replace(PARAMS, speculative=False)) == reference
    assert opted_out.counters.drafted == 0


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft", [[2, 5], [0, 0], [7, 3]])
def test_sampled_tokens_follow_the_target_distribution(draft):
    """First emitted token ~ p0; second (given the first was the accepted draft) ~ p1; 40k fixed-seed draws."""
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(len(draft) + draft[0]))
    params = SamplingParams(temperature=0.8, max_tokens=8)
    p0, p1 = (torch.softmax(logits[i] / 0.8, -1) for i in range(2))
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(40_000):
        out = verify(logits, draft, params, gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    # chi-square, 7 degrees of freedom: 24.3 is the 0.1% critical value
    assert chi_square(first, p0) < 24.3
    assert chi_square(second, p1) < 24.3


def test_greedy_verification_is_the_longest_matching_prefix():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0, max_tokens=8)
    assert verify(logits, [3, 1, 4], params, None) == [3, 1, 4, 2]     # all accepted + bonus
    assert verify(logits, [3, 0, 4], params, None) == [3, 1]           # correction at the first mismatch
    assert verify(logits[:1], [], params, None) == [3]


def test_a_crowded_batch_speculates_for_its_most_urgent_requests_only(model, reference):
    """Three running, ``max_batch`` 2: with one priority nobody speculates; with one request more urgent than the
    others, it alone does; every output equals plain decoding."""
    for priorities, drafting in (((5, 5, 5), set()), ((5, 0, 5), {1})):
        spec = Speculator(OracleDrafter(PROMPTS, reference), SpecConfig(k=3, max_batch=2))
        eng = engine(model, spec=spec)
        ids = [eng.add_request(p, dataclasses.replace(PARAMS, priority=pr)) for p, pr in zip(PROMPTS, priorities)]
        got = {i: [] for i in ids}
        drafted: set[int] = set()
        while eng.has_unfinished():
            crowded = len(eng.scheduler.running) == 3
            for out in eng.step():
                got[out.request_id] += out.new_token_ids
            if crowded:
                drafted |= {j for j, i in enumerate(ids) if i in eng.requests and
                            eng.requests[i].stats.num_spec_steps > 0}
        assert [got[i] for i in ids] == reference
        assert drafted == drafting, (priorities, drafted)
