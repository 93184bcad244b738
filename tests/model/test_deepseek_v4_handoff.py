"""DeepSeek V4's per-sequence state crossing engines (``KVPort`` with a state layout, ``shared/model/v4_state.pack``)
on the tiny random V4 (window 8, CSA groups of 4, HCA groups of 16): a prefill hand-off and a live migration at
token counts inside and on compression groups continue exactly as the single engine (greedy, and a seeded stream);
the payload is the state's bytes (window, entries, pending groups), a small fraction of per-token K/V; a payload
of the wrong size or another build's is refused before anything is admitted; no room means a local recompute."""
import dataclasses

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.errors import DeepinferError, ErrorCode
from shared.model import v4_state
from shared.model.loader import build_model, load_model_files
from shared.sampling import SamplingParams
from tests.deepseek_factory import VOCAB, write_v4_folder

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=77, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return [(41 * i + 13) % (VOCAB - 10) + 5 for i in range(n)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model_files(write_v4_folder(tmp_path_factory.mktemp("dsv4"), seed=6))


def engine(loaded, **kw) -> LLMEngine:
    config, weights, tokenizer = loaded
    return LLMEngine(build_model(config, weights, torch.float32, torch.device("cpu")),
                     EngineConfig(**{"block_size": 16, "num_kv_blocks": 256, **kw}), tokenizer)


def run(eng: LLMEngine, rid: str, until: int | None = None) -> list[int]:
    got: list[int] = []
    while eng.has_unfinished() and (until is None or len(got) < until):
        got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return got


def reference(loaded, ids: list[int], params: SamplingParams) -> list[int]:
    eng = engine(loaded, enable_prefix_caching=False)
    eng.add_request(ids, params, "x")
    return run(eng, "x")


def staged(src: LLMEngine, rid: str, ids: list[int]) -> torch.Tensor:
    pages, rows, mask = src.kv_port.source(rid, ids)
    assert mask == b"" and rows == list(range(len(ids)))
    return pages[rows].clone()


@pytest.mark.parametrize("n", [3, 16, 37, 83])   # shorter than a CSA group, on a block, inside groups, 5 HCA groups
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prefill_hand_off_continues_exactly(loaded, n, params):
    ids = prompt(n)
    expected = reference(loaded, ids, params)
    src = engine(loaded)
    src.add_request(ids, dataclasses.replace(params, prefill_only=True), "x", hold_kv=True)
    first = run(src, "x")[0]
    blocks = src.kv_port.prompt_block_ids("x")
    pages = staged(src, "x", blocks)
    state = src.block_manager.state_of("x")
    assert state.num_tokens == n and list(pages.shape) == [len(blocks), *src.kv_port.block_shape]
    assert pages.numel() * pages.element_size() - state.nbytes() < src.kv_port.block_bytes   # under a page of padding
    generator = src.kv_port.held_generator_state("x")
    src.kv_port.release_held("x")
    dst = engine(loaded)
    dst.add_request(prompt(20)[::-1], dataclasses.replace(GREEDY, max_tokens=30), "other")   # a batch around it
    dst.kv_port.check_handoff(ids, first, params, list(pages.shape), dst.kv_port.dtype_name,
                              model_fingerprint=src.fingerprint)
    assert dst.kv_port.import_running("x", ids, [first], params, pages, model_fingerprint=src.fingerprint,
                                      generator_state=generator)
    assert [first] + run(dst, "x") == expected


@pytest.mark.parametrize("after", [1, 6, 13])   # the migrated state at 40, 45, 52 tokens
def test_a_live_migration_continues_exactly(loaded, after):
    ids = prompt(40)
    expected = reference(loaded, ids, SEEDED)
    src, dst = engine(loaded), engine(loaded)
    src.add_request(prompt(9), dataclasses.replace(GREEDY, max_tokens=40), "other")
    src.add_request(ids, SEEDED, "x")
    got = run(src, "x", until=after)
    assert src.kv_port.full_blocks("x")[0] == []   # nothing to pre-copy: no block of a state is final
    moved = src.kv_port.detach("x")
    pages = staged(src, "x", moved.block_ids)
    assert dst.kv_port.import_running("x", moved.prompt_token_ids, moved.output_token_ids, SEEDED, pages,
                                      model_fingerprint=src.fingerprint, generator_state=moved.generator_state)
    src.kv_port.drop_detached("x")
    assert got + run(dst, "x") == expected
    assert run(src, "other") and src.block_manager.held_blocks == 0


def test_the_payload_is_the_state_not_per_token_kv(loaded):
    """Bytes of a 83-token hand-off: the packed state (window rows, compressed entries, pending groups), as
    ``context_bytes`` computes from the config; against the K/V a GQA layer of the same head width would hold
    per token and layer, a fraction."""
    config = loaded[0]
    src = engine(loaded)
    src.add_request(prompt(83), dataclasses.replace(GREEDY, prefill_only=True), "x", hold_kv=True)
    run(src, "x")
    pages = staged(src, "x", src.kv_port.prompt_block_ids("x"))
    sent = pages.numel() * pages.element_size()
    exact = v4_state.context_bytes(config, 83, 4)
    assert exact <= sent < exact + src.kv_port.block_bytes
    assert sent < 83 * config.num_layers * 2 * config.head_dim * 4


def test_wrong_payloads_are_refused_and_no_room_recomputes(loaded):
    ids = prompt(37)
    expected = reference(loaded, ids, GREEDY)
    src = engine(loaded)
    src.add_request(ids, dataclasses.replace(GREEDY, prefill_only=True), "x", hold_kv=True)
    first = run(src, "x")[0]
    pages = staged(src, "x", src.kv_port.prompt_block_ids("x"))
    dst = engine(loaded)
    for bad in (pages[:-1], torch.cat([pages, pages[:1]])):
        with pytest.raises(DeepinferError) as err:
            dst.kv_port.import_running("y", ids, [first], GREEDY, bad, model_fingerprint=src.fingerprint)
        assert err.value.code == ErrorCode.TRANSFER_FAILED
    with pytest.raises(DeepinferError) as err:
        dst.kv_port.import_running("y", ids, [first], GREEDY, pages, model_fingerprint="another-build")
    assert err.value.code == ErrorCode.MODEL_MISMATCH
    with pytest.raises(DeepinferError) as err:
        dst.kv_port.import_tier_blocks(ids, "", 0, pages)
    assert err.value.code == ErrorCode.TRANSFER_FAILED
    assert not dst.requests and dst.block_manager.held_blocks == 0
    small = engine(loaded, num_kv_blocks=dst.block_manager.fixed_blocks + 4)
    small.add_request(prompt(30), dataclasses.replace(GREEDY, max_tokens=30), "other")
    small.step()   # holds most of the budget: the state does not fit now
    assert not small.kv_port.import_running("x", ids, [first], GREEDY, pages, model_fingerprint=src.fingerprint)
    assert [first] + run(small, "x") == expected   # recomputed here, exactly
