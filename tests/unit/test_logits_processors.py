"""Logits processors (``shared/engine/logits_processors.py``) with vLLM's semantics: the repetition penalty is HF's
``RepetitionPenaltyLogitsProcessor``, presence/frequency are OpenAI's formula over output tokens, ``min_p`` keeps
tokens of at least ``min_p`` times the top probability; greedy through the engine equals a step-by-step
reference, through speculative decoding and a prefill -> decode hand-off too; sampled verification keeps the
processed target distribution."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.logits_processors import bad_word_bans, process, tokenize_bad_words
from shared.engine.sampler import probabilities
from shared.engine.speculator import SpecConfig, Speculator
from shared.engine.spec_verify import verify
from shared.errors import DeepinferError
from shared.sampling import SamplingParams
from shared.spec.types import Proposal, TokenFeatures
from tests.tiny_model import all_logits, tiny_model

transformers = pytest.importorskip("transformers")
V = 50


def test_repetition_penalty_is_hfs_rule_over_prompt_and_output():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    prompts, outputs = [[1, 2, 3], [4, 4, 9], [7]], [[3, 5], [], [7, 8, 8]]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 2.0)]
    got = process(logits, params, prompts, outputs, eos=())
    for i, p in enumerate(params):
        hf = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        want = hf(torch.tensor([prompts[i] + outputs[i]]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i], want[0])


def test_presence_and_frequency_are_openais_formula_over_output_tokens():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    prompts, outputs = [[5, 5, 5], [2]], [[5, 6, 6, 6], [9]]
    params = [SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(presence_penalty=-0.5, frequency_penalty=-2.0)]
    got = process(logits, params, prompts, outputs, eos=())
    for i, p in enumerate(params):
        want = logits[i].clone()
        for token in set(outputs[i]):                     # the prompt's tokens are not counted
            count = outputs[i].count(token)
            want[token] -= p.frequency_penalty * count + p.presence_penalty
        torch.testing.assert_close(got[i], want)


def test_masks_biases_and_rows_that_process_nothing():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[3, 7]),
              SamplingParams(logit_bias={"4": 100, "0": -100.0}),
              SamplingParams(min_tokens=2, stop_token_ids=[11])]
    got = process(logits, params, [[1]] * 4, [[], [], [], [9]], eos=(2,))
    torch.testing.assert_close(got[0], logits[0])         # untouched
    assert torch.isinf(got[1]).sum() == V - 2 and got[1].argmax() in (3, 7)
    assert got[2].argmax() == 4 and torch.isclose(got[2, 0], logits[2, 0] - 100)
    assert torch.isinf(got[3, [2, 11]]).all() and torch.isfinite(got[3]).sum() == V - 2
    assert process(logits, params[:1], [[1]], [[]], eos=()) is logits   # nothing to do: no copy
    assert not torch.isinf(process(logits[3:], params[3:], [[1]], [[9, 9]], eos=(2,))).any()   # min reached


def test_min_p_keeps_tokens_of_at_least_min_p_times_the_top_probability():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    p = torch.softmax(logits / 0.5, -1)
    got = probabilities(logits, SamplingParams(temperature=0.5, min_p=0.1))
    kept = p >= 0.1 * p.max()
    assert (got > 0).tolist() == kept.tolist()
    torch.testing.assert_close(got[kept], p[kept] / p[kept].sum())


PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                        presence_penalty=0.7, frequency_penalty=0.4, logit_bias={"17": 3.0})
PROMPTS = [[(7 * i + j) % 90 + 3 for i in range(n)] for j, n in ((1, 11), (2, 26))]


def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy, one full forward per token, the processors applied by hand in vLLM's order (bias, HF's repetition
    rule, OpenAI's presence/frequency formula)."""
    out: list[int] = []
    for _ in range(params.max_tokens):
        row = all_logits(model, prompt + out)[-1].float()
        for token, bias in params.logit_bias.items():     # vLLM's order: the bias first, then the penalties
            row[int(token)] += bias
        row = transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
            torch.tensor([prompt + out]), row[None].clone())[0]
        for token in set(out):
            row[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        out.append(int(row.argmax()))
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


@pytest.fixture(scope="module")
def expected(model):
    return [reference(model, p, PARAMS) for p in PROMPTS]


def engine(model, spec=None):
    eng = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=64))
    eng.set_speculator(spec)
    return eng


def test_greedy_with_penalties_equals_the_reference(model, expected):
    assert engine(model).generate(PROMPTS, PARAMS) == expected
    plain = engine(model).generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert plain != expected                              # the processors changed the output


class Oracle:
    """Proposes the expected continuation, one wrong token in three."""
    name = "oracle"

    def __init__(self, expected):
        self.ref, self.calls = {tuple(p): o for p, o in zip(PROMPTS, expected)}, 0

    def propose(self, sequences, k):
        out = []
        for seq in sequences:
            tokens = list(seq.token_ids)
            prompt = next(p for p in self.ref if tuple(tokens[:len(p)]) == p)
            draft = self.ref[prompt][len(tokens) - len(prompt):][:k]
            self.calls += 1
            draft = [(t + 1) % 90 if (i + self.calls) % 3 == 0 else t for i, t in enumerate(draft)]
            out.append(Proposal(draft, [TokenFeatures(position=i) for i in range(len(draft))]))
        return out


def test_speculative_decoding_processes_every_drafted_position_as_plain_decoding(model, expected):
    spec = Speculator(Oracle(expected), SpecConfig(k=4))
    assert engine(model, spec).generate(PROMPTS, PARAMS) == expected
    assert spec.counters.accepted > 0


def test_a_hand_off_continues_the_penalties_from_the_tokens(model, expected):
    pre, dec = engine(model), engine(model)
    prompt = PROMPTS[1]
    rid = pre.add_request(prompt, dataclasses.replace(PARAMS, prefill_only=True), hold_kv=True)
    first = []
    while pre.has_unfinished():
        first += [t for out in pre.step() for t in out.new_token_ids]
    kv = pre.kv_port.export_kv(rid)
    assert dec.kv_port.import_prefilled("x", prompt, first[0], PARAMS, kv, model_fingerprint=pre.fingerprint)
    got = [first[0]]
    while dec.has_unfinished():
        got += [t for out in dec.step() for t in out.new_token_ids]
    assert got == expected[1]


def test_sampled_verification_keeps_the_processed_distribution():
    """First emitted token ~ the processed p0 (a penalty and a bias in force), 40k fixed-seed draws."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.9, max_tokens=8, presence_penalty=1.0, logit_bias={"2": 1.5})
    p0 = probabilities(process(logits[:1], [params], [[1]], [[5, 2]], eos=())[0], params)
    first = torch.zeros(8)
    for _ in range(40_000):
        first[verify(logits, [2, 5], params, gen, [1], [5, 2])[0]] += 1
    expected = p0 * first.sum()
    keep = expected > 0
    assert float(((first[keep] - expected[keep]) ** 2 / expected[keep]).sum()) < 24.3   # chi-square, 7 dof, 0.1%


def test_token_ids_out_of_the_vocabulary_are_refused(model):
    eng = engine(model)
    vocab = model.config.vocab_size
    for params in (SamplingParams(logit_bias={str(vocab): 1}), SamplingParams(allowed_token_ids=[0, vocab + 3])):
        with pytest.raises(DeepinferError, match="logit_bias and allowed_token_ids"):
            eng.add_request([1, 2, 3], params)
    assert not eng.has_unfinished()


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest():
    assert bad_word_bans([[7], [3, 4, 5], [9, 6]], [1, 3, 4]) == [7, 5]     # [9, 6]: the output ends 4, not 9
    assert bad_word_bans([[3, 4, 5]], [4]) == []                             # too short to end with [3, 4]
    logits = torch.zeros(2, V)
    params = [SamplingParams(bad_words_token_ids=[[7], [3, 4, 5]]), SamplingParams(bad_words_token_ids=[[3, 4, 5]])]
    got = process(logits, params, [[1], [1]], [[3, 4], [4, 4]], eos=())
    assert torch.isinf(got[0, [7, 5]]).all() and torch.isfinite(got[0]).sum() == V - 2
    assert torch.isfinite(got[1]).all()                                       # nothing ends with [3, 4] there


def test_bad_words_are_tokenized_as_written_and_after_a_space():
    from services.router.tokenize import load_tokenizer
    tok = load_tokenizer(None)                                                # SmolLM2's byte-level BPE
    encode = lambda text: tok.encode(text, add_special_tokens=False)          # noqa: E731
    words = tokenize_bad_words(["Paris", " the"], encode)
    assert words == [encode("Paris"), encode(" Paris"), encode("the"), encode(" the")]
    assert encode(" Paris")[0] != encode("Paris")[0]


def test_greedy_with_bad_words_equals_the_reference_and_never_says_them(model):
    plain = engine(model).generate(PROMPTS[:1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    words = [[plain[2]], [plain[5], plain[6]]]                                 # words the plain output says
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, bad_words_token_ids=words)
    want: list[int] = []
    for _ in range(params.max_tokens):       # the reference: ban by hand, one full forward per token
        row = all_logits(model, PROMPTS[0] + want)[-1].float()
        for word in words:
            if list(want[len(want) - len(word) + 1:]) == word[:-1] or len(word) == 1:
                row[word[-1]] = float("-inf")
        want.append(int(row.argmax()))
    got = engine(model).generate(PROMPTS[:1], params)[0]
    assert got == want and got != plain and plain[2] not in got
    assert all(got[i:i + 2] != words[1] for i in range(len(got) - 1))


def test_bad_words_need_the_engines_tokenizer_and_are_resolved_once(tmp_path):
    from tests.model_factory import write_tiny_hf_folder
    with pytest.raises(DeepinferError, match="bad_words needs the model's tokenizer"):
        engine(tiny_model(seed=5)).add_request([1, 2, 3], SamplingParams(bad_words=["hi"]))
    eng = LLMEngine.from_path(write_tiny_hf_folder(tmp_path / "m"), EngineConfig(block_size=8, num_kv_blocks=64))
    resolved = eng.resolve(SamplingParams(bad_words=["ing", "in"], bad_words_token_ids=[[5]]))
    encode = lambda text: eng.tokenizer.encode(text, add_special_tokens=False)   # noqa: E731
    assert resolved.bad_words == [] and resolved.bad_words_token_ids[:2] == [[5], encode("ing")]
    assert eng.resolve(resolved) is resolved                                    # idempotent: every hop may call it
