"""The prompt window pin (``LLMEngine.add_request(pin_prompt_window=True)``, ``HybridBlockManager.pinned``): a
decode worker keeps the window rows its prefill left until it has copied the prompt for the cache tier."""
from tests.unit.test_swa_kv import GREEDY, PROMPTS, WINDOW, engine, model, reference, run  # noqa: F401 (fixtures)


def test_a_pinned_prompt_window_is_kept_until_lifted_or_a_window_later(model, reference):
    """``pin_prompt_window`` keeps the window rows the prompt's prefill left while decoding (for the tier copy at
    the first token); lifting the pin releases them at the next step, and a pin nobody lifts lapses a window
    later. Output is unchanged."""
    eng = engine(model, batched=16)
    prompt = PROMPTS[2]                                     # 33 tokens: its last prefill chunk starts at 32
    rid = eng.add_request(prompt, GREEDY, pin_prompt_window=True)
    bm, got = eng.block_manager, []
    first_kept = lambda: next(i for i, b in enumerate(bm.window_block_ids(rid)) if b != bm.win.null)  # noqa: E731
    got += run(eng, rid, until=4)[0]
    assert first_kept() == bm.drop(32) < bm.drop(len(prompt) + 3)     # held though no query sees it
    eng.requests[rid].window_pin = None
    got += run(eng, rid, until=1)[0]
    assert first_kept() == bm.drop(len(prompt) + 4)
    got += run(eng, rid)[0]
    assert got == reference[2]
    other = eng.add_request(PROMPTS[1], GREEDY, pin_prompt_window=True)           # never lifted
    assert run(eng, other, until=WINDOW + 2)[0]
    last_q0 = eng.requests[other].num_computed_tokens - 1            # the position its last step computed
    assert next(i for i, b in enumerate(bm.window_block_ids(other)) if b != bm.win.null) == bm.drop(last_q0) > \
        bm.drop(len(PROMPTS[1]))
