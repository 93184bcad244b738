"""The confidence-head loop end to end: an engine speculating with fixed k writes an acceptance log, a head is
fitted on it, and the same workload with the head verifies fewer drafted tokens per proposal while accepting
about as many (and the output stays exactly plain greedy)."""
from shared.engine.speculator import SpecConfig, Speculator
from shared.spec.acceptance_log import AcceptanceLog, read_log
from shared.spec.confidence import ConfidenceHead, FixedK
from shared.spec.types import Proposal, TokenFeatures
from tests.unit.test_spec_engine import PARAMS, PROMPTS, engine, run_all
from tests.tiny_model import tiny_model


class HintingDrafter:
    """Proposes the reference continuation; drafted tokens past position 1 are wrong 3 times in 4, and the
    drafter knows it a little (a lower, noisy top-1 probability): what a head can learn."""
    name = "hinting"

    def __init__(self, outputs):
        self.ref = {tuple(p): o for p, o in zip(PROMPTS, outputs)}
        self.calls = 0

    def propose(self, sequences, k):
        out = []
        for seq in sequences:
            prompt = next(p for p in self.ref if tuple(seq.token_ids[:len(p)]) == p)
            done = len(seq.token_ids) - len(prompt)
            tokens, feats = [], []
            for i, t in enumerate(self.ref[prompt][done:done + k]):
                self.calls += 1
                wrong = i >= 2 and self.calls % 4 != 0
                tokens.append((t + 1) % 100 if wrong else t)
                noise = (self.calls * 37 % 11) / 40
                feats.append(TokenFeatures(top1_prob=(0.25 if wrong else 0.7) + noise, entropy=1.0, position=i))
            out.append(Proposal(tokens, feats))
        return out


def test_a_head_trained_on_the_engines_log_trims_verification_not_acceptance(tmp_path):
    model = tiny_model(seed=3)
    reference = run_all(engine(model), PROMPTS, PARAMS)
    log = AcceptanceLog(tmp_path / "acceptance.jsonl")
    fixed = Speculator(HintingDrafter(reference), SpecConfig(k=5), FixedK(5), log)
    assert run_all(engine(model, spec=fixed), PROMPTS, PARAMS) == reference
    log.close()
    x, y = read_log(tmp_path / "acceptance.jsonl")
    assert len(x) == fixed.counters.drafted and y.sum() == fixed.counters.accepted
    head = ConfidenceHead.fit(x, y, threshold=0.3)
    trimmed = Speculator(HintingDrafter(reference), SpecConfig(k=5), head)
    assert run_all(engine(model, spec=trimmed), PROMPTS, PARAMS) == reference
    a, b = fixed.stats(), trimmed.stats()
    assert b["verified_per_proposal"] < 0.8 * a["verified_per_proposal"]
    assert b["accepted_per_proposal"] > 0.9 * a["accepted_per_proposal"]
