"""The draft-model drafter proposes exactly its draft model's greedy continuation of its anchored window (the
last ``window`` tokens with ``stride=1``; positions relative to the window's start), whatever the batching; float64
tiny models make the comparisons exact. Kept state across calls: ``test_draft_state.py``."""
import random

import pytest
import torch

from shared.errors import DeepinferError, ErrorCode
from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from shared.spec.draft_model import DraftModelDrafter, load_drafter, self_speculative
from shared.spec.types import DraftInput
from tests.model_factory import NATURAL_VOCAB, write_tiny_hf_folder
from tests.tiny_model import all_logits

WINDOW, K = 12, 5
STRIDE = WINDOW // 2  # the drafter's default
LENGTHS = [1, 3, 11, 12, 13, 30]  # shorter than, equal to and longer than the window


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a smaller draft: same tokenizer and vocabulary, different seeds and sizes (float64)."""
    root = tmp_path_factory.mktemp("pair")
    target_dir = write_tiny_hf_folder(root / "target", seed=1, num_layers=3, hidden=64, heads=4, kv_heads=2)
    draft_dir = write_tiny_hf_folder(root / "draft", seed=2, num_layers=1, hidden=32, heads=2, kv_heads=1,
                                     ffn=64)
    config, weights, _ = load_model_files(target_dir)
    target = LlamaModel(config, weights, torch.float64, torch.device("cpu"))
    return target, draft_dir, root


def sequences(seed: int = 0) -> list[DraftInput]:
    rng = random.Random(seed)
    return [DraftInput(f"s{i}", [rng.randrange(NATURAL_VOCAB) for _ in range(n)]) for i, n in enumerate(LENGTHS)]


def greedy(model: LlamaModel, prompt: list[int], k: int) -> list[int]:
    """Reference with no KV cache at all: recompute every position from scratch (positions from 0), argmax."""
    out: list[int] = []
    for _ in range(k):
        out.append(int(all_logits(model, prompt + out)[-1].argmax()))
    return out


def visible(tokens, stride: int) -> list[int]:
    """What the draft sees: the sequence from the anchor on, which hops by ``stride`` once past the window."""
    return list(tokens[max(0, len(tokens) - WINDOW) // stride * stride:])


@pytest.mark.parametrize("stride", [1, None])
def test_proposals_are_the_draft_models_greedy_window_continuation(pair, stride):
    target, draft_dir, _ = pair
    drafter = load_drafter(draft_dir, target, window=WINDOW, block_size=4, stride=stride)
    assert drafter.model.dtype == torch.float64 and drafter.model.config.num_layers == 1
    assert drafter.stride == (stride or STRIDE)
    seqs = sequences()
    got = drafter.propose(seqs, K)
    for seq, proposal in zip(seqs, got):
        tail = visible(seq.token_ids, stride or STRIDE)
        if stride == 1:  # exactly the last window, as a per-step rebuild sees it
            assert tail == list(seq.token_ids[-WINDOW:])
        assert proposal.tokens == greedy(drafter.model, tail, K)
        # features: softmax of the draft's logits over window + drafted tokens, recomputed without a cache
        logits = all_logits(drafter.model, tail + proposal.tokens[:-1])[len(tail) - 1:]  # [K, V]
        probs = logits.softmax(-1)
        expected_top1 = probs.gather(-1, torch.tensor(proposal.tokens)[:, None])[:, 0]
        expected_entropy = -(probs * probs.log()).sum(-1)
        assert [f.top1_prob for f in proposal.features] == pytest.approx(expected_top1.tolist(), rel=1e-9)
        assert [f.entropy for f in proposal.features] == pytest.approx(expected_entropy.tolist(), rel=1e-9)


def test_batched_and_sliced_equal_one_at_a_time(pair):
    target, draft_dir, _ = pair
    seqs = sequences(seed=1)
    alone = load_drafter(draft_dir, target, window=WINDOW, block_size=4)
    expected = [alone.propose([s], K)[0] for s in seqs]
    for max_batch in (16, 4, 1):  # one forward per step for all, slices of 4 (6 = 4 + 2), one by one
        drafter = DraftModelDrafter(alone.model, window=WINDOW, max_batch=max_batch, block_size=4)
        got = drafter.propose(seqs, K)
        assert [p.tokens for p in got] == [p.tokens for p in expected]
        for g, e in zip(got, expected):
            assert sum((f.as_list() for f in g.features), []) == pytest.approx(
                sum((f.as_list() for f in e.features), []), rel=1e-9)
    # states are kept across calls (a repeated sequence only refeeds its last token): still the same proposals
    assert [p.tokens for p in alone.propose(list(reversed(seqs)), K)] == [p.tokens for p in reversed(expected)]


def test_features_ranges_positions_and_edge_cases(pair):
    target, draft_dir, _ = pair
    drafter = load_drafter(draft_dir, target, window=WINDOW, block_size=4)
    for proposal in drafter.propose(sequences(seed=2), K):
        assert len(proposal.tokens) == len(proposal.features) == K
        assert all(0.0 < f.top1_prob <= 1.0 for f in proposal.features)
        assert all(f.entropy >= 0.0 for f in proposal.features)
        assert [f.position for f in proposal.features] == list(range(K))
        assert all(f.ngram_len == 0 for f in proposal.features)
    empty, one = drafter.propose([DraftInput("e", []), DraftInput("o", [5, 6])], 1)
    assert empty.tokens == [] and len(one.tokens) == 1
    assert [p.tokens for p in drafter.propose(sequences(), 0)] == [[]] * len(LENGTHS)
    assert drafter.propose([], K) == []
    # the draft's positions stay inside its RoPE table: k is capped at max_position_embeddings - window + 1
    edge = DraftModelDrafter(drafter.model, window=drafter.model.config.max_position_embeddings - 2)
    assert len(edge.propose([DraftInput("x", [7] * 600)], K)[0].tokens) == 3


def test_self_speculation_with_all_layers_is_the_target_itself(pair):
    target, _, _ = pair
    full = load_drafter("self:3", target, window=64)
    for seq in sequences(seed=3):  # every sequence is shorter than the window: positions are the target's own
        assert full.propose([seq], K)[0].tokens == greedy(target, list(seq.token_ids), K)
    draft = self_speculative(target, 2)
    assert draft.config.num_layers == 2 and len(draft.config.layer_sliding_windows) == 2
    assert target.config.num_layers == 3 and len(target.layers) == 3  # the target is untouched
    assert draft.layers[1] is target.layers[1] and draft.layers[0].qkv is target.layers[0].qkv
    assert draft.lm_head is target.lm_head and draft.final_norm is target.final_norm
    assert draft.embed.data_ptr() == target.embed.data_ptr()


@pytest.mark.parametrize("spec", ["self:0", "self:4", "self:x", "self:"])
def test_bad_self_spec_is_refused(pair, spec):
    target, _, _ = pair
    with pytest.raises(DeepinferError) as err:
        load_drafter(spec, target)
    assert err.value.code == ErrorCode.INVALID_REQUEST


def test_vocabulary_mismatch_is_refused(pair):
    target, _, root = pair
    other = write_tiny_hf_folder(root / "other-vocab", seed=3, num_layers=1, hidden=32, vocab=NATURAL_VOCAB + 5)
    with pytest.raises(DeepinferError) as err:
        load_drafter(other, target)
    assert err.value.code == ErrorCode.INVALID_REQUEST
    assert f"{NATURAL_VOCAB + 5}" in err.value.message and f"{NATURAL_VOCAB}" in err.value.message
