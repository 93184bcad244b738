"""The draft model keeps its KV across calls and stays exact: over decode-like steps with acceptances, rejections,
hand-offs (an unrelated sequence under a known id), evictions and sequences longer than the window, every proposal
equals the draft's greedy continuation of the anchored window recomputed from scratch (no cache at all), and a
kept state holds the KV a rebuild of the same span gives. Multi-layer float64 tiny models make this exact."""
import copy
import random
import tempfile

import pytest
import torch

from shared.errors import DeepinferError
from shared.model import kv_cache
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.spec.draft_model import DraftModelDrafter
from shared.spec.draft_state import anchor_of, common_prefix
from shared.spec.types import DraftInput
from tests.tiny_model import all_logits, tiny_model

W, K, BS = 12, 4, 4
VOCAB = 128  # tiny_model's


@pytest.fixture(scope="module", params=["full", "sliding"])
def model(request):
    """A 3-layer draft; ``sliding``: every layer a 5-token sliding window (Mistral-style) too."""
    windows = (5, 5, 5) if request.param == "sliding" else (None, None, None)
    return tiny_model(seed=7, num_layers=3, layer_sliding_windows=windows)


def greedy(model, tokens, stride: int, k: int = K) -> list[int]:
    """Reference: the anchored window recomputed from scratch at every drafted token (positions from 0)."""
    ctx = list(tokens[max(0, len(tokens) - W) // stride * stride:])
    out: list[int] = []
    for _ in range(k):
        out.append(int(all_logits(model, ctx + out)[-1].argmax()))
    return out


def state_kv(drafter: DraftModelDrafter, seq_id: str) -> torch.Tensor:
    """``[L, 2, kvh, n, D]``: the KV a drafter holds for the ``n`` tokens of one sequence's state."""
    st = drafter.states
    state = st.get(seq_id)
    first, nb = st.first_block(state), st.blocks_per_state
    kv = st.kv[first:first + nb].permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [L, 2, kvh, nb * bs, D]
    return kv[:, :, :, :len(state.token_ids)]


def kv_at(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    """``[L, 2, kvh, T, D]``: KV of ``ids`` run as one fresh chunk at the given RoPE positions."""
    n = len(ids)
    kv = kv_cache.allocate(-(-n // BS), model.config, BS, model.dtype, model.device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32),
                             prefills=[PrefillChunk(0, n, n, torch.arange(-(-n // BS)))], block_size=BS)
    model.forward(torch.tensor(ids), torch.tensor(positions), meta, kv, torch.tensor([n - 1]))
    return kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)[:, :, :, :n]


def advance(rng: random.Random, tokens: list[int], drafted: list[int]) -> list[int]:
    """What the engine appends after verifying a proposal: an accepted prefix, then the target's own token (a
    rejection: it differs from the next drafted one)."""
    accepted = rng.randint(0, len(drafted))
    bonus = rng.randrange(VOCAB)
    if accepted < len(drafted) and bonus == drafted[accepted]:
        bonus = (bonus + 1) % VOCAB
    return tokens + drafted[:accepted] + [bonus]


@pytest.mark.parametrize("stride", [1, 5])
def test_steps_with_rejections_handoffs_and_evictions_equal_a_rebuild(model, stride):
    rng = random.Random(stride)
    seqs = {"a": [rng.randrange(VOCAB) for _ in range(3)], "b": [rng.randrange(VOCAB) for _ in range(20)],
            "c": [rng.randrange(VOCAB)]}
    drafters = [DraftModelDrafter(model, W, stride=stride, block_size=BS),  # one forward per step for all
                DraftModelDrafter(model, W, stride=stride, block_size=BS, max_batch=2, max_states=3),
                DraftModelDrafter(model, W, stride=stride, block_size=BS, max_batch=1, max_states=1)]  # evicts every call
    for step in range(14):
        if step == 4:  # hand-off: "b" now names an unrelated, longer sequence
            seqs["b"] = [rng.randrange(VOCAB) for _ in range(27)]
        if step == 6:
            seqs["d"] = [rng.randrange(VOCAB) for _ in range(40)]
        live = [sid for sid in seqs if not (step in (7, 8) and sid == "a")]  # "a" sits two steps out
        inputs = [DraftInput(sid, list(seqs[sid])) for sid in live]
        got = [d.propose(inputs, K) for d in drafters]
        for j, inp in enumerate(inputs):
            expected = greedy(model, inp.token_ids, stride)
            assert [g[j].tokens for g in got] == [expected] * len(drafters), (step, inp.seq_id)
            for g in got[1:]:
                assert sum((f.as_list() for f in g[j].features), []) == pytest.approx(
                    sum((f.as_list() for f in got[0][j].features), []), rel=1e-9)
            seqs[inp.seq_id] = advance(rng, seqs[inp.seq_id], expected)
    full, small, single = (d.stats() for d in drafters)
    assert full["fed_tokens"] <= small["fed_tokens"] < single["fed_tokens"]
    assert stride == 1 or full["fed_tokens"] < small["fed_tokens"]
    assert full["evictions"] == 0 and small["evictions"] > 0 and single["states"] == 1
    # what every drafter holds is what a fresh drafter computes for the same span, in one chunk
    for sid, tokens in seqs.items():
        fresh = DraftModelDrafter(model, W, stride=stride, block_size=BS)
        fresh.propose([DraftInput(sid, tokens)], K)
        kept = drafters[0]
        kept.propose([DraftInput(sid, tokens)], K)
        assert kept.states.get(sid).token_ids == fresh.states.get(sid).token_ids
        torch.testing.assert_close(state_kv(kept, sid), state_kv(fresh, sid), rtol=0, atol=1e-12)


def test_only_what_the_state_lacks_is_fed(model):
    d = DraftModelDrafter(model, W, stride=4, block_size=BS)
    tokens = [5, 9, 14, 3, 7]

    def step(seq: list[int]) -> tuple[list[int], int, int]:
        before = d.stats()
        drafted = d.propose([DraftInput("s", seq)], K)[0].tokens
        assert drafted == greedy(model, seq, 4)
        after = d.stats()
        return drafted, after["fed_tokens"] - before["fed_tokens"], after["rebuilds"] - before["rebuilds"]

    drafted, fed, rebuilt = step(tokens)
    assert (fed, rebuilt) == (5, 1)                       # no state: the whole (short) window
    tokens = tokens + drafted[:2] + [(drafted[2] + 1) % VOCAB]
    drafted, fed, rebuilt = step(tokens)
    assert (fed, rebuilt) == (1, 0)                       # 2 accepted drafts were kept, only the bonus is new
    tokens = tokens + drafted + [0]
    drafted, fed, rebuilt = step(tokens)
    assert (fed, rebuilt) == (2, 0)                       # all k accepted: the last draft had no KV yet
    drafted, fed, rebuilt = step(tokens)
    assert (fed, rebuilt) == (1, 0)                       # asked again, unchanged: the last token is fed again
    short = tokens[:-3]
    drafted, fed, rebuilt = step(short)
    assert (fed, rebuilt) == (1, 0)                       # rolled back: truncated to the common prefix
    tokens = short + [(drafted[0] + 1) % VOCAB, 1, 2]
    assert len(tokens) == 13 and anchor_of(len(tokens), W, 4) == 0
    drafted, fed, rebuilt = step(tokens)
    assert (fed, rebuilt) == (3, 0)                       # a chunk over the cached context (13 <= W + 4 - 1)
    tokens = tokens + [4, 5, 6]
    drafted, fed, rebuilt = step(tokens)
    assert (fed, rebuilt) == (W, 1)                       # the anchor hops by 4: rebuilt from the new anchor
    assert d.states.get("s").anchor == 4


def test_one_forward_per_step_for_every_sequence_of_a_slice(model):
    d = DraftModelDrafter(model, W, stride=4, block_size=BS)
    counted = copy.copy(model)
    calls = []
    counted.forward = lambda *args: calls.append(len(args[0])) or model.forward(*args)
    d.model = counted
    seqs = [DraftInput("short", [1, 2, 3]), DraftInput("long", list(range(30))), DraftInput("one", [9])]
    d.propose(seqs, K)
    assert calls == [3 + 14 + 1] + [3] * (K - 1)          # 30 tokens: anchor 16 (hops of 4), 14 visible
    calls.clear()
    grown = [DraftInput(s.seq_id, list(s.token_ids) + [7]) for s in seqs]  # every draft rejected at once
    got = d.propose(grown, K)
    assert calls == [3] + [3] * (K - 1)                   # three decode rows, then the drafting steps
    assert [p.tokens for p in got] == [greedy(model, s.token_ids, 4) for s in grown]


def test_bounded_states_lru_release_and_duplicate_ids(model):
    d = DraftModelDrafter(model, W, stride=4, block_size=BS, max_batch=2, max_states=3)
    room = d.states.blocks_per_state  # nothing reserved before the first call
    assert room == 0
    seqs = {sid: [ord(sid) + i for i in range(n)] for sid, n in (("a", 5), ("b", 30), ("c", 2), ("d", 9))}
    for sid in "abc":  # the pool grows 1 -> 2 -> 3 states, copying what it holds
        d.propose([DraftInput(sid, seqs[sid])], K)
    nb = d.states.blocks_per_state
    assert nb * BS >= W + 4 + K - 2 and d.states.kv.shape[0] == 3 * nb and len(d.states) == 3
    before = d.stats()["fed_tokens"]
    got = d.propose([DraftInput("a", seqs["a"] + [0])], K)[0]
    assert got.tokens == greedy(model, seqs["a"] + [0], 4) and d.stats()["fed_tokens"] == before + 1
    d.propose([DraftInput("d", seqs["d"])], K)         # a fourth sequence evicts the least recently used: "b"
    assert d.states.get("b") is None and d.stats()["evictions"] == 1 and len(d.states) == 3
    assert all(len(d.states.get(s).token_ids) <= nb * BS for s in "acd")
    assert d.release(["c", "nope"]) == 1 and len(d.states) == 2 and d.states.get("c") is None
    # one id twice in a call (two sequences behind one id): each gets its own exact proposal
    twice = [DraftInput("a", seqs["b"]), DraftInput("a", seqs["a"] + [0, 1])]
    assert [p.tokens for p in d.propose(twice, K)] == [greedy(model, s.token_ids, 4) for s in twice]
    # a larger k grows each state's room: every state is dropped and rebuilt on demand
    assert d.propose([DraftInput("a", seqs["a"])], K + 8)[0].tokens == greedy(model, seqs["a"], 4, K + 8)
    assert len(d.states) == 1 and d.states.blocks_per_state > nb
    for bad in (dict(stride=0), dict(max_batch=4, max_states=3), dict(block_size=0)):
        with pytest.raises(DeepinferError):
            DraftModelDrafter(model, W, **bad)


def test_a_failing_forward_leaves_every_state_usable(model):
    d = DraftModelDrafter(model, W, stride=4, block_size=BS)
    tokens = list(range(10, 19))
    first = d.propose([DraftInput("s", tokens)], K)[0].tokens
    failing, calls = copy.copy(model), []

    def forward(*args):
        calls.append(1)
        if len(calls) == 2:  # the first drafting step, after the new tokens' KV was written
            raise RuntimeError("device lost")
        return model.forward(*args)

    failing.forward, d.model = forward, failing
    tokens = tokens + first[:1] + [99]
    with pytest.raises(RuntimeError):
        d.propose([DraftInput("s", tokens)], K)
    assert d.states.get("s").token_ids == tokens[:-1]  # what it kept before the call's writes
    tokens = tokens + [3]
    assert d.propose([DraftInput("s", tokens)], K)[0].tokens == greedy(model, tokens, 4)


def test_evicting_the_oldest_kv_is_not_a_rebuild(model):
    """Why the window hops instead of sliding by one token: keeping the KV of tokens ``1..W`` computed with token
    0 in view is not what a rebuild from token 1 computes, even with absolute RoPE positions. Only layer 0's KV
    (a function of the token and its position alone) agrees; deeper layers saw the dropped token."""
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(W + 1)]
    kept = kv_at(model, ids, list(range(W + 1)))[:, :, :, 1:]  # [L, 2, kvh, W, D]
    rebuilt = kv_at(model, ids[1:], list(range(1, W + 1)))  # same absolute positions, token 0 dropped
    torch.testing.assert_close(kept[0], rebuilt[0], rtol=0, atol=1e-12)
    assert (kept[1:] - rebuilt[1:]).abs().max() > 1e-3


def test_anchor_and_common_prefix():
    assert [anchor_of(n, 12, 4) for n in (0, 5, 12, 13, 15, 16, 17, 20)] == [0, 0, 0, 0, 0, 4, 4, 8]
    assert [anchor_of(n, 12, 1) for n in (5, 12, 13, 20)] == [0, 0, 1, 8]
    assert all(12 <= n - anchor_of(n, 12, 4) <= 15 for n in range(12, 60))
    assert [common_prefix(a, b) for a, b in (([], [1]), ([1, 2], [1, 2, 3]), ([1, 2, 3], [1, 5]),
                                             ([4], [5]))] == [0, 2, 1, 0]


def test_the_engine_releases_a_finished_requests_draft_state():
    """A request that finishes (or is aborted) leaves no draft state behind in the engine's drafter."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling import SamplingParams
    from shared.engine.speculator import SpecConfig, Speculator
    from shared.spec.confidence import FixedK
    from shared.spec.draft_model import DraftModelDrafter, self_speculative
    from tests.model_factory import write_tiny_hf_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_hf_folder(tmp, seed=3)
        engine = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=64))
    drafter = DraftModelDrafter(self_speculative(engine.model, 1))
    engine.set_speculator(Speculator(drafter, SpecConfig(k=3), FixedK(3)))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7, 8, 9, 10, 11]], params)
    assert drafter.stats()["states"] == 0
    rid = engine.add_request([5, 6, 7, 8, 9, 10, 12], params)
    for _ in range(4):
        engine.step()
    assert drafter.stats()["states"] == 1
    engine.abort(rid)
    assert drafter.stats()["states"] == 0
