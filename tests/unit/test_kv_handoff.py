"""Prefill on one engine, hand the KV to another, decode there: tokens equal the monolithic engine's."""
import dataclasses

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from shared.model.llama import LlamaModel
from tests.tiny_model import random_weights, tiny_model

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def engine(model, blocks=64):
    return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=32))


def prefill(model, prompt):
    src = engine(model)
    rid = src.add_request(prompt, dataclasses.replace(PARAMS, max_tokens=1), hold_kv=True)
    outs = []
    while src.has_unfinished():
        outs += src.step()
    first = outs[-1].new_token_ids[0]
    kv = src.kv_port.export_kv(rid)
    src.kv_port.release_held(rid)
    assert src.block_manager.num_free_blocks == src.block_manager.num_blocks
    return first, kv, src.fingerprint


@pytest.mark.parametrize("prompt_len", [5, 8, 23, 40])
def test_handoff_equals_monolithic(prompt_len):
    model = tiny_model(seed=11)
    prompt = [(7 * i + 3) % 128 for i in range(prompt_len)]
    expected = engine(model).generate([prompt], PARAMS)[0]
    first, kv, fp = prefill(model, prompt)
    dst = engine(model)
    dst.add_request([1, 2, 3], PARAMS)  # something else already decoding there
    assert dst.kv_port.import_prefilled("x", prompt, first, PARAMS, kv, model_fingerprint=fp)
    got = [first]
    while dst.has_unfinished():
        got += [t for o in dst.step() if o.request_id == "x" for t in o.new_token_ids]
    assert got == expected


def test_no_room_falls_back_to_recompute_with_same_tokens():
    model = tiny_model(seed=11)
    prompt = list(range(1, 40))
    expected = engine(model).generate([prompt], PARAMS)[0]
    first, kv, fp = prefill(model, prompt)
    dst = engine(model, blocks=7)
    dst.add_request(list(range(50, 70)), dataclasses.replace(PARAMS, max_tokens=30))
    dst.step()  # holds 3 of 7 blocks: the 5 needed for the hand-off do not fit
    assert not dst.kv_port.import_prefilled("x", prompt, first, PARAMS, kv, model_fingerprint=fp)
    got = [first]
    while dst.has_unfinished():
        got += [t for o in dst.step() if o.request_id == "x" for t in o.new_token_ids]
    assert got == expected


def test_wrong_shape_is_rejected():
    model = tiny_model(seed=11)
    first, kv, fp = prefill(model, list(range(1, 20)))
    with pytest.raises(DeepinferError) as err:
        engine(model).kv_port.import_prefilled("x", list(range(1, 30)), first, PARAMS, kv, model_fingerprint=fp)
    assert err.value.code == ErrorCode.TRANSFER_FAILED


def test_first_token_outside_the_vocabulary_is_rejected_before_admission():
    model = tiny_model(seed=11)
    first, kv, fp = prefill(model, list(range(1, 20)))
    dst = engine(model)
    for bad in (model.config.vocab_size, -1):
        with pytest.raises(DeepinferError) as err:
            dst.kv_port.import_prefilled("x", list(range(1, 20)), bad, PARAMS, kv, model_fingerprint=fp)
        assert err.value.code == ErrorCode.INVALID_REQUEST and "first_token" in err.value.message
    assert not dst.requests and dst.block_manager.num_free_blocks == dst.block_manager.num_blocks


def test_check_handoff_compares_shape_and_dtype_with_this_engine():
    model = tiny_model(seed=11)
    dst = engine(model)
    prompt = list(range(1, 20))  # 3 blocks of 8
    shape = [3, *dst.kv_port.kv_cache.shape[1:]]
    dtype = str(dst.kv_port.kv_cache.dtype).removeprefix("torch.")
    dst.kv_port.check_handoff(prompt, 5, PARAMS, shape, dtype, model_fingerprint=dst.fingerprint)
    for bad_shape, bad_dtype in (([2, *shape[1:]], dtype), ([3, *shape[1:-1], shape[-1] * 2], dtype),
                                 (shape, "float16" if dtype != "float16" else "float32")):
        with pytest.raises(DeepinferError) as err:
            dst.kv_port.check_handoff(prompt, 5, PARAMS, bad_shape, bad_dtype, model_fingerprint=dst.fingerprint)
        assert err.value.code == ErrorCode.TRANSFER_FAILED


def test_kv_of_another_build_is_refused_before_admission():
    """Same architecture, same shapes, one weight changed: the KV is another build's and is never imported;
    neither is KV whose hand-off names no build (an older sender)."""
    model = tiny_model(seed=11)
    weights = random_weights(model.config, seed=11)
    weights["model.layers.0.self_attn.o_proj.weight"][0, 0] += 1.0  # one weight of another build, same name
    other = LlamaModel(model.config, weights, model.dtype, model.device)
    prompt = list(range(1, 20))
    first, kv, fp = prefill(other, prompt)
    dst = engine(model)
    assert fp != dst.fingerprint and list(kv.shape[1:]) == list(dst.kv_port.kv_cache.shape[1:])
    for claimed in (fp, ""):
        with pytest.raises(DeepinferError) as err:
            dst.kv_port.import_prefilled("x", prompt, first, PARAMS, kv, model_fingerprint=claimed)
        assert err.value.code == ErrorCode.MODEL_MISMATCH and dst.fingerprint in err.value.message
    assert not dst.requests and dst.block_manager.num_free_blocks == dst.block_manager.num_blocks
