"""DeepSeek V4 states through the cache tier's block format (``shared/model/v4_tier.py``, ``KVPort.tier_state_run``
/ ``import_tier_blocks``) on the tiny random V4 (window 8, CSA groups of 4, HCA groups of 16): a snapshot split
into tier blocks (entries per block, the tail on the last) joins back to the very state, also from runs written
turn by turn; an engine that imports them hits at the boundary and continues exactly as the single engine; each
block's entries are stored once; a run of another shape is refused."""
import dataclasses

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.errors import DeepinferError, ErrorCode
from shared.kv import block_pack
from shared.model import v4_state, v4_tier
from shared.model.loader import build_model, load_model_files
from shared.sampling import SamplingParams
from tests.deepseek_factory import VOCAB, write_v4_folder

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return [(37 * i + 11) % (VOCAB - 10) + 5 for i in range(n)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model_files(write_v4_folder(tmp_path_factory.mktemp("dsv4"), seed=9))


def engine(loaded, block_size: int, **kw) -> LLMEngine:
    config, weights, tokenizer = loaded
    return LLMEngine(build_model(config, weights, torch.float32, torch.device("cpu")),
                     EngineConfig(**{"block_size": block_size, "num_kv_blocks": 512, **kw}), tokenizer)


def run(eng: LLMEngine, rid: str) -> list[int]:
    got: list[int] = []
    while eng.has_unfinished():
        got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return got


def reference(loaded, ids: list[int], block_size: int) -> list[int]:
    eng = engine(loaded, block_size, enable_prefix_caching=False)
    eng.add_request(ids, GREEDY, "ref")
    return run(eng, "ref")


def snapshots(eng: LLMEngine) -> dict[int, v4_state.V4SequenceState]:
    """The prefix cache's snapshots by the tokens they cover."""
    return {s.state.num_tokens: s.state for s in eng.block_manager.snapshots.values()}


def assert_same_state(a: v4_state.V4SequenceState, b: v4_state.V4SequenceState) -> None:
    assert a.num_tokens == b.num_tokens
    config_parts = [v4_state._parts(a), v4_state._parts(b)]
    for x, y in zip(*config_parts):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("block_size", [8, 16])   # an HCA group spans two blocks / one
def test_a_snapshot_splits_into_tier_blocks_and_joins_back_exactly(loaded, block_size):
    eng = engine(loaded, block_size, max_num_batched_tokens=block_size)   # a chunk per block: a snapshot at each
    eng.add_request(prompt(83), GREEDY, "x")
    run(eng, "x")
    config, states = eng.model.config, snapshots(eng)
    assert sorted(states) == list(range(block_size, 83 + GREEDY.max_tokens, block_size))
    shape = v4_tier.block_shape(config, block_size)
    for n, state in states.items():
        k = n // block_size
        whole = v4_tier.split(state, config, block_size, 0)
        mask = [False] * (k - 1) + [True]
        assert list(whole.shape) == block_pack.packed_shape(mask, shape, 1)
        assert_same_state(v4_tier.join(whole, mask, config, block_size, k), state)
    # turn by turn: blocks 0..a-1 written at boundary a (its tail), then a..b-1 at boundary b
    a, b = sorted(states)[1] // block_size, sorted(states)[-1] // block_size
    first = v4_tier.split(states[a * block_size], config, block_size, 0)
    later = v4_tier.split(states[b * block_size], config, block_size, a)
    joined, mask = torch.cat([first, later]), [j in (a - 1, b - 1) for j in range(b)]
    assert_same_state(v4_tier.join(joined, mask, config, block_size, b), states[b * block_size])
    assert_same_state(v4_tier.join(joined, mask, config, block_size, b - 1), states[a * block_size])
    assert v4_tier.join(joined, mask, config, block_size, a - 1) is None   # no tail before block a - 1
    assert torch.equal(first[:a - 1], v4_tier.split(states[b * block_size], config, block_size, 0)[:a - 1])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("n", [37, 83])   # boundaries inside and on HCA groups
def test_an_engine_that_imports_tier_blocks_hits_and_continues_exactly(loaded, block_size, n):
    ids = prompt(n)
    expected = reference(loaded, ids, block_size)
    src = engine(loaded, block_size)
    src.add_request(ids, dataclasses.replace(GREEDY, prefill_only=True), "x", hold_kv=True)
    run(src, "x")
    count, chain, tokens, staged, rows, mask = src.kv_port.tier_state_run("x")
    k = (n - 1) // block_size
    assert count == k == len(chain) and tokens == ids[:k * block_size]
    packed = staged[rows].clone()
    has_window = block_pack.decode_mask(mask, count)
    src.kv_port.release_held("x")
    dst = engine(loaded, block_size)
    first, want = dst.kv_port.missing_blocks(ids)
    assert first == 0 and want.keys == chain.keys
    assert dst.kv_port.import_tier_blocks(ids, "", 0, packed, has_window) == k
    assert dst.kv_port.import_tier_blocks(ids, "", 0, packed, has_window) == k   # a re-import keeps the snapshot
    assert dst.kv_port.missing_blocks(ids)[0] == k   # nothing left to pull
    dst.add_request(ids, GREEDY, "y")
    outs = []
    while dst.has_unfinished():
        outs += [o for o in dst.step() if o.request_id == "y"]
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].num_cached_tokens == k * block_size


def test_the_next_turn_writes_only_its_own_blocks_and_hits_exactly(loaded):
    """Turn 1 written back when it ends (its newest snapshot, past its prompt); turn 2 (turn 1 + answer + more) on
    the same engine hits turn 1's snapshot and writes only the blocks after it; a fresh engine given both runs
    hits turn 2 at turn 1's end and turn 3 at turn 2's, each continuing exactly."""
    bs = 8
    turn1 = prompt(45)
    src = engine(loaded, bs)
    src.add_request(turn1, GREEDY, "t1", hold_kv=True)
    answer1 = run(src, "t1")
    n1, *_, run1, rows1, mask1 = src.kv_port.tier_state_run("t1")
    assert n1 == (len(turn1) + len(answer1) - 1) // bs
    src.kv_port.release_held("t1")
    turn2 = turn1 + answer1 + prompt(30)[::-1]
    src.add_request(turn2, GREEDY, "t2", hold_kv=True)
    answer2 = run(src, "t2")
    cached = src.kv_port.held["t2"].stats.num_cached_tokens
    assert cached == n1 * bs
    n2, *_, run2, rows2, mask2 = src.kv_port.tier_state_run("t2", n1)
    src.kv_port.release_held("t2")
    both = torch.cat([run1[rows1].reshape(-1, run1.shape[-1]), run2[rows2].reshape(-1, run2.shape[-1])])
    has_window = block_pack.decode_mask(mask1, n1) + block_pack.decode_mask(mask2, n2)
    turn3 = turn2 + answer2 + [5, 6, 7]
    for turn, hit in ((turn2, n1), (turn3, n1 + n2)):
        dst = engine(loaded, bs)
        assert dst.kv_port.import_tier_blocks(turn, "", 0, both, has_window) == hit
        dst.add_request(turn, GREEDY, "y")
        assert run(dst, "y") == reference(loaded, turn, bs)
    kept = len(dst.block_manager.snapshots)   # dst holds turn 3's own snapshots now
    assert dst.kv_port.import_tier_blocks(turn3, "", 0, run1[rows1].reshape(-1, run1.shape[-1]),
                                          block_pack.decode_mask(mask1, n1)) == 0   # below its own: nothing added
    assert len(dst.block_manager.snapshots) == kept
    entry_bytes = both.element_size() * both.shape[1]
    tails = v4_tier.block_shape(src.model.config, bs)[0] - 1
    assert both.numel() * both.element_size() == (n1 + n2 + 2 * tails) * entry_bytes   # nothing stored twice


def test_tier_blocks_of_another_shape_or_part_of_a_state_are_not_taken(loaded):
    eng = engine(loaded, 8)
    ids = prompt(40)
    shape = eng.kv_port.tier_block_shape
    with pytest.raises(DeepinferError) as err:
        eng.kv_port.import_tier_blocks(ids, "", 0, torch.zeros(4, shape[1] + 1), [True] * 4)
    assert err.value.code == ErrorCode.TRANSFER_FAILED
    with pytest.raises(DeepinferError):
        eng.kv_port.import_tier_blocks(ids, "", 0, torch.zeros(5, shape[1]), [False] * 4)   # rows for 4 blocks
    assert eng.kv_port.import_tier_blocks(ids, "", 1, torch.zeros(2 * shape[0], shape[1]), [True] * 2) == 0
    assert eng.kv_port.import_tier_blocks(ids, "", 0, torch.zeros(3, shape[1]), [False] * 3) == 0   # no tail
