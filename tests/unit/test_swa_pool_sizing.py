"""What a sliding-window model's prefix cache keeps for repeats (``shared/engine/hybrid_kv.py``'s sizing,
``BlockManager``'s recycled blocks): a tiny float64 Gemma-3-shaped model (window 8, block size 4, one full layer
and six window layers).

- The KV budget is split for prompts of ``swa_kv_context`` tokens (default ``min(max_model_len, 4096)``): after
  N other prompts that all fit the full pool, a repeat still hits. Split for ``max_model_len`` (the old rule), the
  window pool holds the last windows of only a few prompts and the same repeat misses.
- Window blocks a prefill slid past are reused before the blocks other prompts' ends left behind.
"""
import pytest
import torch

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.hybrid_kv import SWA_KV_CONTEXT, HybridBlockManager
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import Request
from shared.model.llama import LlamaModel
from shared.sampling import SamplingParams
from tests.gemma_factory import gemma_config, gemma_weights

BS, PROMPT = 4, 64
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def model_of(max_len: int = 512, window: int = 8) -> LlamaModel:
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, window=window, num_layers=7,
                          max_position_embeddings=max_len)
    return LlamaModel(config, gemma_weights(config, seed=3, dtype=torch.float64), torch.float64, torch.device("cpu"))


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return model_of()


def prompt(k: int) -> list[int]:
    return [(13 * k + 7 * j + (j * j) % 5) % 200 + 10 for j in range(PROMPT)]


def repeat_hit(model, context: int, others: int) -> tuple[int, list[int]]:
    """Prompt 0, then ``others`` other prompts, then prompt 0 again: ``(its cached tokens, pool sizes)``."""
    eng = LLMEngine(model, EngineConfig(block_size=BS, kv_cache_bytes=1 << 20, max_model_len=512,
                                        swa_kv_context=context, max_num_batched_tokens=64))
    expected = eng.generate([prompt(0)], GREEDY)[0]
    for k in range(1, others + 1):
        eng.generate([prompt(k)], GREEDY)
    rid, last, got = eng.add_request(prompt(0), GREEDY), None, []
    while eng.has_unfinished():
        for out in eng.step():
            got += out.new_token_ids
            last = out
    assert got == expected
    return last.num_cached_tokens, eng.block_manager.pool_sizes


def test_a_repeat_hits_after_other_prompts_that_fit_the_full_pool(model):
    per_prompt = -(-(PROMPT + GREEDY.max_tokens) // BS)         # full blocks each prompt leaves cached
    cached, (num_full, _) = repeat_hit(model, PROMPT, others=8)
    assert 9 * per_prompt <= num_full                             # all nine prompts fit the full pool
    assert cached == PROMPT - BS                                  # the whole prompt but its last block
    cached, (num_full, num_window) = repeat_hit(model, 512, others=8)  # split for max_model_len
    assert 9 * per_prompt <= num_full and cached == 0, (num_full, num_window)


def test_past_the_full_pool_the_repeat_misses_as_lru_says(model):
    cached, (num_full, _) = repeat_hit(model, PROMPT, others=10)
    assert 11 * -(-(PROMPT + GREEDY.max_tokens) // BS) > num_full and cached == 0


def test_the_default_split_is_for_prompts_of_4096_tokens_or_the_context():
    long_model = model_of(32768, window=512)

    def pools(**kw) -> list[int]:
        return LLMEngine(long_model, EngineConfig(block_size=16, kv_cache_bytes=8 << 20, max_num_batched_tokens=64,
                                                  **kw)).block_manager.pool_sizes
    assert SWA_KV_CONTEXT == 4096
    assert pools() == pools(swa_kv_context=4096) != pools(swa_kv_context=32768)
    assert pools(max_model_len=1024) == pools(max_model_len=1024, swa_kv_context=1024)


def test_blocks_a_window_slid_past_mid_prompt_are_reused_before_other_prompts_ends():
    bm = HybridBlockManager(num_full_blocks=64, num_window_blocks=8, block_size=BS, window=8, max_step_tokens=8)
    a = Request("a", list(range(10, 34)), GREEDY, block_size=BS, model_fingerprint="m")   # 24 tokens: 6 blocks
    for step in range(3):                                         # three 8-token chunks
        assert bm.allocate_slots(a, 8) is not None
        a.num_computed_tokens += 8
    kept = [b for b in bm.window_block_ids("a") if b != bm.win.null]
    bm.free("a")
    recycled = list(bm.win.free_queue.recycled)
    assert recycled and not set(recycled) & set(kept)             # released mid-prompt: blocks 0..2
    order = list(bm.win.free_queue)
    assert all(order.index(r) < order.index(k) for r in recycled for k in kept)
    # a prompt's end survives the next prompt's prefill: the repeat still finds its window rows
    b = Request("b", list(range(100, 124)), GREEDY, block_size=BS, model_fingerprint="m")
    for step in range(3):
        assert bm.allocate_slots(b, 8) is not None
        b.num_computed_tokens += 8
    again = Request("a2", list(range(10, 34)), GREEDY, block_size=BS, model_fingerprint="m")
    assert bm.cached_prefix(again) == 6                           # its window rows (blocks 4, 5) survived


def test_a_pool_without_windows_never_recycles():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Request("a", list(range(16)), GREEDY, block_size=BS, model_fingerprint="m")
    assert bm.allocate_slots(a, 16) is not None
    bm.free("a")
    assert not bm.free_queue.recycled and len(bm.free_queue) == 8
