"""Log-probabilities (``shared/logprobs.py``): the raw model distribution at every generated position and every
prompt position after the first, exact through chunked prefill, speculative decoding and the wire; prompt
logprobs skip the prefix cache (every position must be computed) and are bounded."""
from __future__ import annotations

import pytest
import torch

from shared import protocol
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.speculator import SpecConfig, Speculator
from shared.errors import DeepinferError
from shared.logprobs import MAX_PROMPT_LOGPROB_ENTRIES, Logprobs, of_tokens
from shared.sampling import SamplingParams
from shared.spec.types import Proposal, TokenFeatures
from tests.tiny_model import all_logits, tiny_model

PROMPT = [(5 * i) % 80 + 3 for i in range(29)]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def engine(model, budget=8, spec=None):
    eng = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=budget))
    eng.set_speculator(spec)
    return eng


def collect(eng, prompt=PROMPT, params=PARAMS):
    rid = eng.add_request(prompt, params)
    tokens, lps, prompt_lps, cached = [], Logprobs(), None, None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            if out.logprobs is not None:
                lps.extend(out.logprobs)
            assert out.prompt_logprobs is None or prompt_lps is None       # on the first output only
            prompt_lps = prompt_lps or out.prompt_logprobs
            cached = out.num_cached_tokens if out.finished else cached
    return tokens, lps, prompt_lps, cached


def test_values_are_the_raw_distribution_through_chunked_prefill(model):
    tokens, lps, prompt_lps, _ = collect(engine(model))
    ref = torch.log_softmax(all_logits(model, PROMPT + tokens).float(), -1)                 # [T, V]
    seq = PROMPT + tokens
    assert len(prompt_lps) == len(PROMPT) - 1 and len(lps) == len(tokens)
    want = [ref[i, seq[i + 1]].item() for i in range(len(seq) - 1)]
    assert prompt_lps.token_logprobs + lps.token_logprobs == pytest.approx(want, abs=1e-6)
    assert prompt_lps.top_ids[4] == ref[4].topk(2).indices.tolist()
    assert lps.top_ids[0] == ref[len(PROMPT) - 1].topk(3).indices.tolist()
    assert lps.top_ids[0][0] == tokens[0]                                                   # greedy: the top one


class Echo:
    """Drafts the reference continuation with every third token wrong."""
    name = "echo"

    def __init__(self, tokens):
        self.tokens, self.calls = tokens, 0

    def propose(self, sequences, k):
        out = []
        for seq in sequences:
            done = len(seq.token_ids) - len(PROMPT)
            self.calls += 1
            draft = [t if (i + self.calls) % 3 else (t + 1) % 80 for i, t in enumerate(self.tokens[done:done + k])]
            out.append(Proposal(draft, [TokenFeatures(position=i) for i in range(len(draft))]))
        return out


def test_speculative_decoding_reports_what_plain_decoding_does(model):
    plain = collect(engine(model, budget=64))
    spec = Speculator(Echo(plain[0]), SpecConfig(k=4))
    got = collect(engine(model, budget=64, spec=spec))
    assert spec.counters.accepted > 0 and got[0] == plain[0]
    assert got[1].token_logprobs == pytest.approx(plain[1].token_logprobs, abs=1e-9)
    assert got[1].top_ids == plain[1].top_ids


def test_prompt_logprobs_compute_every_position_and_are_bounded(model):
    eng = engine(model, budget=64)
    first = collect(eng)
    again = collect(eng)                                     # the prompt's blocks are cached now
    assert again[3] == 0 and again[2].token_logprobs == pytest.approx(first[2].token_logprobs, abs=1e-9)
    plain = collect(eng, params=SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert plain[3] > 0 and plain[2] is None                 # without prompt logprobs the cache serves
    with pytest.raises(DeepinferError, match="prompt_logprobs"):
        eng.add_request([3 + i % 100 for i in range(2000)], SamplingParams(max_tokens=1, prompt_logprobs=20))
    assert 2000 * 21 > MAX_PROMPT_LOGPROB_ENTRIES
    with pytest.raises(DeepinferError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_logprobs_travel_in_token_chunks():
    lps = of_tokens(torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]), [2, 1], k=2)
    assert lps.top_ids == [[2, 1], [0, 1]] or lps.top_ids == [[2, 1], [0, 2]]
    chunk = protocol.TokenChunk(request_id="r", seq=0, token_ids=[2, 1], logprobs=lps, prompt_logprobs=lps.head(1))
    back = protocol.decode(protocol.encode(chunk), protocol.TokenChunk)
    assert back.logprobs == lps and back.prompt_logprobs.token_logprobs == lps.token_logprobs[:1]
    with pytest.raises(DeepinferError, match="one entry per token"):
        protocol.TokenChunk(request_id="r", seq=0, token_ids=[2], logprobs=lps)
