"""The engine serves a Gemma 3-shaped model exactly (tiny random float64 model, window 6 on five of every six
layers): chunked prefill across the window boundary equals one-shot prefill, batching/prefix hits/preemption
equal running alone, paged decode equals dense recompute; the fingerprint covers every Gemma knob."""
import dataclasses
import hashlib
import json

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.model import kv_cache
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.model.fingerprint import config_digest, model_fingerprint
from shared.model.llama import LlamaModel
from tests.gemma_factory import gemma_config, gemma_weights
from tests.tiny_model import all_logits, tiny_config
from tests.unit.test_engine_exactness import GREEDY, dense_greedy, make_requests, run_alone

CPU = torch.device("cpu")
BLOCK = 8


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, window=6, num_layers=7, query_pre_attn_scalar=24,
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    return LlamaModel(config, gemma_weights(config, seed=5, dtype=torch.float64), torch.float64, CPU)


def chunked_logits(model: LlamaModel, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits ``[T, V]`` at every position, prefilled ``chunk`` tokens at a time through the paged KV cache."""
    n = len(ids)
    num_blocks = -(-n // BLOCK)
    kv = kv_cache.allocate(num_blocks, model.config, BLOCK, model.dtype, CPU)
    table = torch.arange(num_blocks)
    rows = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end), num_decode=0,
                                 decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                                 decode_context_lens=torch.zeros(0, dtype=torch.int32),
                                 prefills=[PrefillChunk(0, end - start, end, table)], block_size=BLOCK)
        rows.append(model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), meta, kv,
                                  torch.arange(end - start)))
    return torch.cat(rows)


def test_chunked_prefill_across_the_window_equals_one_shot(model):
    ids = [2] + [(13 * i + 7) % 280 + 20 for i in range(44)]  # 45 tokens: 7x the window of 6
    one_shot = all_logits(model, ids, block_size=BLOCK)
    for chunk in (3, 5, 16):  # chunk edges fall inside, on and across window boundaries (window 6)
        diff = (chunked_logits(model, ids, chunk) - one_shot).abs().max().item()
        assert diff < 1e-10, f"chunk {chunk}: max-abs logit difference {diff}"
    engines = [LLMEngine(model, EngineConfig(block_size=BLOCK, num_kv_blocks=16, max_num_batched_tokens=budget,
                                             enable_prefix_caching=False)) for budget in (4096, 5)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    assert engines[0].generate([ids], params) == engines[1].generate([ids], params)


def test_batched_equals_alone(model):
    requests = make_requests(seed=4, vocab=model.config.vocab_size, n=16)
    expected = [run_alone(model, p, m) for p, m in requests]
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK, num_kv_blocks=48, max_num_batched_tokens=40,
                                           max_num_seqs=8))
    params = [SamplingParams(max_tokens=m, **GREEDY) for _, m in requests]
    assert engine.generate([p for p, _ in requests], params) == expected
    assert engine.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0


def test_paged_decode_equals_dense_recompute(model):
    for ids in ([2, 30, 41], [2] + list(range(20, 48))):  # the second crosses the window many times while decoding
        assert run_alone(model, ids, 10) == dense_greedy(model, ids, 10)


def test_fingerprint_covers_gemma_knobs_and_keeps_llama_fingerprints(model):
    base = model_fingerprint(model, None, BLOCK)
    for change in (dict(hidden_act="silu"), dict(embed_scale=None), dict(query_pre_attn_scalar=16.0),
                   dict(rope_local_theta=None), dict(sandwich_norms=False), dict(norm_weight_offset=0.0),
                   dict(layer_sliding_windows=(6,) * 7)):
        other = LlamaModel.__new__(LlamaModel)
        other.config, other.dtype = dataclasses.replace(model.config, **change), model.dtype
        other.weights_digest = model.weights_digest
        assert model_fingerprint(other, None, BLOCK) != base, change
    # a LLaMA config (every Gemma knob at its default) digests exactly as before the knobs existed
    llama = tiny_config()
    later = {"hidden_act", "embed_scale", "query_pre_attn_scalar", "rope_local_theta", "sandwich_norms",
             "norm_weight_offset", "mla", "moe", "v4"}
    v1 = {f.name: getattr(llama, f.name) for f in dataclasses.fields(llama)
          if f.name not in later | {"model_id", "nextn_layers"}}
    assert config_digest(llama) == hashlib.blake2b(json.dumps(v1, sort_keys=True, default=list).encode(),
                                                   digest_size=32).digest()
