"""The batched engine (continuous batching, chunked prefill, prefix hits, preemption) must produce exactly
the greedy tokens of each request run alone with no cache, on a float64 random model."""
import random

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.tiny_model import tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_requests(seed: int, vocab: int, n: int = 30) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared_prefixes = [[rng.randrange(vocab) for _ in range(rng.choice([16, 24, 40]))] for _ in range(3)]
    requests = []
    for i in range(n):
        length = rng.choice([3, 7, 8, 9, 17, 33, 60, 95, 150])
        tail = [rng.randrange(vocab) for _ in range(length)]
        prompt = (shared_prefixes[i % 3] + tail) if i % 2 == 0 else tail
        requests.append((prompt, rng.randint(1, 24)))
    requests.append((requests[0][0][:], 5))  # an exact repeat: fully cached prompt
    return requests


def run_alone(model, prompt, max_tokens):
    engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=False,
                                           max_num_batched_tokens=4096))
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]


@pytest.mark.parametrize("overrides", [
    {},
    {"layer_sliding_windows": (None, 12), "tie_word_embeddings": True},
    {"attention_bias": True, "num_kv_heads": 1, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
], ids=["llama", "sliding-window-tied", "qwen-bias-mqa-llama3rope"])
def test_batched_equals_alone(overrides):
    model = tiny_model(seed=1, **overrides)
    requests = make_requests(seed=2, vocab=model.config.vocab_size)
    expected = [run_alone(model, p, m) for p, m in requests]

    engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=72, max_num_batched_tokens=48,
                                           max_num_seqs=12))
    results: dict[str, list[int]] = {}
    pending = list(enumerate(requests))
    steps = 0
    while pending or engine.has_unfinished():
        # continuous batching: a few arrivals every step
        for _ in range(min(2, len(pending))):
            i, (prompt, max_tokens) = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id=str(i))
            results[str(i)] = []
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        steps += 1
        assert steps < 5000
    got = [results[str(i)] for i in range(len(requests))]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"request {i} diverged"
    assert engine.num_preemptions > 0, "the test must exercise preemption"
    assert engine.block_manager.num_hit_tokens > 0, "the test must exercise prefix-cache hits"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def dense_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference with no KV reuse at all: every token recomputes the whole sequence in one causal pass."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=False,
                                               max_num_batched_tokens=4096))
        tokens += engine.generate([tokens], SamplingParams(max_tokens=1, **GREEDY))[0]
    return tokens[len(prompt):]


@pytest.mark.parametrize("overrides", [{}, {"layer_sliding_windows": (6, None)}], ids=["full", "sliding"])
def test_paged_decode_equals_dense_recompute(overrides):
    model = tiny_model(seed=3, **overrides)
    for prompt in ([5, 9, 2], list(range(1, 30))):
        assert run_alone(model, prompt, 12) == dense_greedy(model, prompt, 12)
