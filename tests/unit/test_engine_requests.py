"""Request validation, sampling options and stop rules on a tiny float64 model."""
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampler import probabilities
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from tests.tiny_model import all_logits, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, max_position_embeddings=64, eos_token_ids=(3,))


def engine_for(model, **kw):
    return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=kw.pop("num_kv_blocks", 32), **kw))


@pytest.mark.parametrize("make, code, fragment", [
    (lambda: ([], SamplingParams()), ErrorCode.INVALID_REQUEST, "prompt is empty"),
    (lambda: ([1] * 64, SamplingParams()), ErrorCode.PROMPT_TOO_LONG, "context window"),
    (lambda: ([1, 500], SamplingParams()), ErrorCode.INVALID_REQUEST, "token ids"),
    (lambda: ([1], SamplingParams(max_tokens=0)), ErrorCode.INVALID_REQUEST, "max_tokens"),
    (lambda: ([1], SamplingParams(max_tokens=-3)), ErrorCode.INVALID_REQUEST, "max_tokens"),
    (lambda: ([1], SamplingParams(temperature=-0.1)), ErrorCode.INVALID_REQUEST, "temperature"),
    (lambda: ([1], SamplingParams(top_p=0.0)), ErrorCode.INVALID_REQUEST, "top_p"),
    (lambda: ([1], SamplingParams(top_p=1.5)), ErrorCode.INVALID_REQUEST, "top_p"),
    (lambda: ([1], SamplingParams(temperature=float("nan"))), ErrorCode.INVALID_REQUEST, "temperature"),
    (lambda: ([1], SamplingParams(stop_token_ids=(500,), min_tokens=1)), ErrorCode.INVALID_REQUEST,
     "stop_token_ids"),
])
def test_bad_input_is_rejected_and_engine_keeps_serving(model, make, code, fragment):
    engine = engine_for(model)
    good = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tokens = [t for out in engine.step() for t in out.new_token_ids]  # running when the bad one arrives
    with pytest.raises(DeepinferError) as err:
        prompt, params = make()
        engine.add_request(prompt, params)
    assert err.value.code == code and fragment in err.value.message
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == good
            tokens += out.new_token_ids
    assert tokens == engine_for(model).generate([[1, 2, 3, 4, 5]], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True))[0]


def test_request_larger_than_kv_pool_is_rejected(model):
    engine = engine_for(model, num_kv_blocks=2)
    with pytest.raises(DeepinferError) as err:
        engine.add_request([1] * 10, SamplingParams(max_tokens=20))
    assert err.value.code == ErrorCode.PROMPT_TOO_LONG and "KV cache capacity" in err.value.message


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine_for(model).generate([[1, 2, 3]], params)[0]
    crowd = engine_for(model).generate([[9, 9], [1, 2, 3], [4]], [
        SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True), params,
        SamplingParams(max_tokens=5, temperature=0.5, ignore_eos=True)])[1]
    assert alone == crowd
    other_seed = engine_for(model).generate([[1, 2, 3]], SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))[0]
    assert other_seed != alone


def test_top_k_one_equals_greedy(model):
    greedy = engine_for(model).generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    topk1 = engine_for(model).generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                                                   ignore_eos=True))
    assert greedy == topk1


def test_probabilities_top_k_top_p_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.allclose(p[:2].sum(), torch.tensor(1.0))
    full = logits.softmax(-1)  # [0.636, 0.234, 0.086, ...]: top_p=0.8 keeps exactly the first two
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (p[2:] == 0).all() and torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the top token is always kept


def test_sampled_frequencies_match_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.8, seed=0)
    probs = probabilities(logits, params)
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.multinomial(probs, n, replacement=True, generator=g), minlength=4).double()
    chi2 = (((counts - n * probs.double()) ** 2) / (n * probs.double())).sum().item()
    assert chi2 < 16.27  # chi-square, 3 dof, p = 0.001


def test_stop_token_ids_eos_and_max_tokens(model):
    engine = engine_for(model)
    free_run = engine.generate([[1, 2]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_at = free_run[3]
    engine.add_request([1, 2], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,),
                                              ignore_eos=True), request_id="s")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert [t for o in outs for t in o.new_token_ids] == free_run[:free_run.index(stop_at) + 1]
    assert outs[-1].num_output_tokens == free_run.index(stop_at) + 1
    last = engine.generate([[1, 2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert last == [free_run[:4]]


def test_min_tokens_masks_eos_and_stop_ids(model):
    engine = engine_for(model)
    free = engine.generate([[1, 2]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop = free[1]
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop,), min_tokens=6)
    out = engine.generate([[1, 2]], params)[0]
    assert len(out) >= 6 and stop not in out[:6] and 3 not in out[:6]  # 3 is the model's EOS
    logits = all_logits(model, [1, 2, free[0]])[-1].clone()  # [V] where the stop id was the argmax
    logits[[stop, 3]] = float("-inf")
    assert out[:2] == [free[0], int(logits.argmax())]  # the best token that is allowed, exactly
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop,),
                                                    ignore_eos=True))[0] == free[:2]  # without it: stops there
    with pytest.raises(DeepinferError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_abort_frees_blocks(model):
    engine = engine_for(model)
    rid = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
