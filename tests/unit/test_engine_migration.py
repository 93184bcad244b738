"""Live migration between engines (shared/engine/kv_port.py): a running request detached from one engine
and imported into another goes on exactly as it would have: greedy tokens equal the uninterrupted run's, a
seeded sampled stream equals its unmigrated twin, and a reattached request loses nothing."""
import dataclasses

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from tests.tiny_model import tiny_model

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, temperature=0.9, top_k=40, seed=1234, ignore_eos=True)


def engine(model, blocks=64):
    return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=64))


def run(eng, rid, until=None) -> list[int]:
    """Step ``eng`` until ``rid`` finished (or produced ``until`` tokens); ``rid``'s new tokens."""
    got: list[int] = []
    while eng.has_unfinished() and (until is None or len(got) < until):
        got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return got


def migrate(src, dst, rid, params, **kw):
    moved = src.kv_port.detach(rid)
    kv = src.kv_port.kv_cache[torch.tensor(moved.block_ids)]   # [blocks, L, 2, kvh, bs, D]
    used = dst.kv_port.import_running(rid, moved.prompt_token_ids, moved.output_token_ids, params, kv,
                              model_fingerprint=src.fingerprint, generator_state=moved.generator_state, **kw)
    src.kv_port.drop_detached(rid)
    return moved, used


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("after", [1, 7, 8, 13])
def test_a_migrated_request_continues_exactly(params, after):
    model = tiny_model(seed=11)
    prompt = [(5 * i + 3) % 128 for i in range(21)]
    twin = engine(model)
    twin.add_request(prompt, params, "x")
    expected = run(twin, "x")
    src, dst = engine(model), engine(model)
    src.add_request([9, 8, 7, 6], dataclasses.replace(GREEDY, max_tokens=50), "other")  # a batch around it
    src.add_request(prompt, params, "x")
    got = run(src, "x", until=after)
    dst.add_request([1, 2, 3], dataclasses.replace(GREEDY, max_tokens=50), "there")
    moved, used = migrate(src, dst, "x", params)
    assert used and moved.output_token_ids == got
    got += run(dst, "x")
    assert got == expected
    assert "x" not in src.requests and not src.block_manager.block_ids("x")  # the source freed it
    assert run(src, "other") and src.block_manager.num_free_blocks == src.block_manager.num_blocks


def test_reattach_puts_it_back_as_it_was():
    model = tiny_model(seed=11)
    prompt = list(range(3, 30))
    expected = engine(model).generate([prompt], GREEDY)[0]
    src = engine(model)
    src.add_request(prompt, GREEDY, "x")
    got = run(src, "x", until=5)
    moved = src.kv_port.detach("x")
    assert len(moved.block_ids) == -(-(len(prompt) + len(got) - 1) // 8)
    src.add_request([1, 2], dataclasses.replace(GREEDY, max_tokens=3), "y")
    assert run(src, "y") and "x" in src.kv_port.detached          # the batch went on without it
    src.kv_port.reattach("x")
    assert got + run(src, "x") == expected


def test_only_a_decoding_request_detaches_and_abort_frees_a_detached_one():
    model = tiny_model(seed=11)
    src = engine(model)
    src.add_request(list(range(3, 30)), GREEDY, "x")
    with pytest.raises(DeepinferError) as info:        # queued: no live KV yet
        src.kv_port.detach("x")
    assert info.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(DeepinferError):
        src.kv_port.detach("nobody")
    run(src, "x", until=2)
    src.kv_port.detach("x")
    with pytest.raises(DeepinferError):
        src.kv_port.detach("x")                                # already detached
    assert src.abort("x") and not src.kv_port.detached
    assert src.block_manager.num_free_blocks == src.block_manager.num_blocks


def test_no_room_on_the_target_recomputes_the_same_tokens():
    model = tiny_model(seed=11)
    prompt, params = list(range(1, 40)), dataclasses.replace(GREEDY, max_tokens=10)
    expected = engine(model).generate([prompt], params)[0]
    src, dst = engine(model), engine(model, blocks=7)
    src.add_request(prompt, params, "x")
    got = run(src, "x", until=4)
    dst.add_request(list(range(50, 70)), dataclasses.replace(GREEDY, max_tokens=30), "busy")
    dst.step()  # holds 3 of 7 blocks: the 6 needed for x do not fit
    _, used = migrate(src, dst, "x", params)
    assert not used
    assert got + run(dst, "x") == expected


def test_bad_imports_are_refused_before_anything_is_allocated():
    model = tiny_model(seed=11)
    src, dst = engine(model), engine(model)
    src.add_request(list(range(3, 20)), SEEDED, "x")
    run(src, "x", until=3)
    moved = src.kv_port.detach("x")
    kv = src.kv_port.kv_cache[torch.tensor(moved.block_ids)]
    free = dst.block_manager.num_free_blocks
    for outputs, params, state in (([], SEEDED, b""), (moved.output_token_ids + [10**6], SEEDED, b""),
                                   (moved.output_token_ids, GREEDY, moved.generator_state),
                                   (moved.output_token_ids, SEEDED, b"\0" * (32 << 10))):
        with pytest.raises(DeepinferError):
            dst.kv_port.import_running("x", moved.prompt_token_ids, outputs, params, kv, model_fingerprint=src.fingerprint,
                               generator_state=state)
    with pytest.raises(DeepinferError) as info:
        dst.kv_port.import_running("x", moved.prompt_token_ids, moved.output_token_ids, SEEDED, kv[:-1],
                           model_fingerprint=src.fingerprint)
    assert info.value.code == ErrorCode.TRANSFER_FAILED
    assert dst.block_manager.num_free_blocks == free and not dst.requests


def test_pre_copied_blocks_ship_ahead_and_the_switch_sends_only_the_rest():
    """Pre-copy: the full blocks go to the target's prefix cache while the source decodes on; the stop-and-copy
    ships the blocks from ``first_block``; the continuation is exact. Blocks gone meanwhile: refused, nothing
    changed on the target."""
    model = tiny_model(seed=11)
    prompt = [(3 * i + 1) % 128 for i in range(37)]
    expected = engine(model).generate([prompt], GREEDY)[0]
    src, dst = engine(model), engine(model)
    src.add_request(prompt, GREEDY, "x")
    got = run(src, "x", until=3)
    ids, tokens, salt = src.kv_port.full_blocks("x")
    assert len(ids) == (len(prompt) + len(got) - 1) // 8 and tokens == prompt + got
    kept = dst.kv_port.import_tier_blocks(tokens, salt, 0, src.kv_port.kv_cache[torch.tensor(ids)])
    assert kept == len(ids)
    got += run(src, "x", until=6)                   # the source decoded on while the copy travelled
    assert src.kv_port.holds_blocks("x", ids)
    moved = src.kv_port.detach("x")
    tail = src.kv_port.kv_cache[torch.tensor(moved.block_ids[kept:])]
    fresh = engine(model)
    with pytest.raises(DeepinferError) as info:     # a target without the pre-copied blocks refuses
        fresh.kv_port.import_running("x", moved.prompt_token_ids, moved.output_token_ids, GREEDY, tail,
                             model_fingerprint=src.fingerprint, first_block=kept)
    assert info.value.code == ErrorCode.TRANSFER_FAILED and not fresh.requests
    assert fresh.block_manager.num_free_blocks == fresh.block_manager.num_blocks
    assert dst.kv_port.import_running("x", moved.prompt_token_ids, moved.output_token_ids, GREEDY, tail,
                              model_fingerprint=src.fingerprint, first_block=kept)
    src.kv_port.drop_detached("x")
    assert got + run(dst, "x") == expected
