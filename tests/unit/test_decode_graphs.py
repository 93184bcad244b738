"""Decode steps through the CUDA-graph path (shared/engine/decode_graphs.py): the padded, static-buffer forward
pass runs eagerly on CPU and must give every request the tokens it gets without it; on CUDA the captured
graphs must give the eager engine's tokens."""
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.decode_graphs import buckets
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.engine.speculator import SpecConfig, Speculator
from shared.model.llama import LlamaModel
from tests.tiny_model import random_weights, tiny_config, tiny_model
from tests.unit.test_spec_engine import PROMPTS, OracleDrafter, run_all

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prompts(vocab: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (3 + 5 * i,), generator=gen).tolist() for i in range(n)]


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(1) == [1]


def test_padded_decode_path_gives_the_eager_tokens(monkeypatch):
    """Seven requests (bucket 8: one padding row) plus a sliding-window layer; the padding row's slot is -1,
    so no other sequence's cache is written: a prefix-cache hit after the run still gives the same tokens."""
    model = tiny_model(seed=5, layer_sliding_windows=(None, 12))
    batch = prompts(model.config.vocab_size, 7)
    plain = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64)).generate(batch, GREEDY)
    config = EngineConfig(block_size=8, num_kv_blocks=64, decode_graphs="eager", decode_graph_max_batch=16)
    engine = LLMEngine(model, config)
    graphs = engine.runner.graphs
    sizes = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *a: sizes.append(len(ids)) or real_run(ids, *a))
    assert engine.generate(batch, GREEDY) == plain
    assert 7 in sizes  # the seven-row decode steps took the padded path (bucket 8)
    assert engine.generate(batch[:3], GREEDY) == plain[:3]  # cached prompts, cache not corrupted


def test_batches_beyond_the_largest_bucket_run_eagerly(monkeypatch):
    model = tiny_model(seed=5)
    batch = prompts(model.config.vocab_size, 6)
    plain = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64)).generate(batch, GREEDY)
    engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64, decode_graphs="eager",
                                           decode_graph_max_batch=4))
    sizes, forwards = [], []
    real_run, real_forward = engine.runner.graphs.run, model.forward
    monkeypatch.setattr(engine.runner.graphs, "run", lambda ids, *a: sizes.append(len(ids)) or real_run(ids, *a))
    monkeypatch.setattr(model, "forward", lambda ids, *a: forwards.append(len(ids)) or real_forward(ids, *a))
    lengths = [2, 4, 6, 8, 10, 10]  # requests finish one after another: batches of 6, 4, 3, 2
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for p, n in zip(batch, lengths)]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert [got[i] for i in ids] == [p[:n] for p, n in zip(plain, lengths)]
    assert sizes and max(sizes) <= 4  # small steps replayed the padded path ...
    assert 6 in forwards  # ... six-row decode steps ran the plain forward pass


def test_verifying_drafts_through_the_padded_path_keeps_greedy_exact(monkeypatch):
    """Steps verifying drafted tokens (k + 1 decode rows per request) replay the same path."""
    model = tiny_model(seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = run_all(LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64)), PROMPTS, params)
    engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64, decode_graphs="eager"))
    spec = Speculator(OracleDrafter(PROMPTS, reference), SpecConfig(k=4))
    engine.set_speculator(spec)
    sizes = []
    real_run = engine.runner.graphs.run
    monkeypatch.setattr(engine.runner.graphs, "run", lambda ids, *a: sizes.append(len(ids)) or real_run(ids, *a))
    assert run_all(engine, PROMPTS, params) == reference
    assert spec.counters.accepted > 0 and max(sizes) > len(PROMPTS)  # verification rows went through it


def test_decode_graph_settings_are_validated():
    with pytest.raises(ValueError, match="decode_graphs"):
        EngineConfig(decode_graphs="always")
    with pytest.raises(ValueError, match="decode_graph_max_batch"):
        EngineConfig(decode_graph_max_batch=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_give_the_eager_tokens():
    config = tiny_config()
    model = LlamaModel(config, random_weights(config, seed=5, dtype=torch.float32), torch.float32,
                       torch.device("cuda"))
    batch = prompts(config.vocab_size, 5)
    eager = LLMEngine(model, EngineConfig(block_size=16, num_kv_blocks=64, decode_graphs="off"))
    captured = LLMEngine(model, EngineConfig(block_size=16, num_kv_blocks=64, decode_graph_max_batch=8))
    assert captured.runner.graphs is not None and captured.runner.graphs.captured
    assert captured.generate(batch, GREEDY) == eager.generate(batch, GREEDY)
