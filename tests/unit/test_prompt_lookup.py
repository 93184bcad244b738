"""Prompt-lookup drafter: longest suffix n-gram first, most recent occurrence, up to k tokens, exact features."""
from __future__ import annotations

import numpy as np
import pytest

from shared.spec.prompt_lookup import PromptLookupDrafter, find_match
from shared.spec.types import DraftInput, TokenFeatures


def propose(tokens, k=5, **kw):
    return PromptLookupDrafter(**kw).propose([DraftInput("s", tokens)], k)[0]


def test_longest_suffix_ngram_wins():
    # suffix [2, 3] occurs at 1 (-> 4 5) ; suffix [3] alone occurs later at 7 (-> 9): the 2-gram wins
    seq = [1, 2, 3, 4, 5, 6, 7, 3, 9, 2, 3]
    p = propose(seq, k=3)
    assert p.tokens == [4, 5, 6]
    assert p.features == [TokenFeatures(1.0, 0.0, 2, 0), TokenFeatures(1.0, 0.0, 2, 1), TokenFeatures(1.0, 0.0, 2, 2)]


def test_most_recent_occurrence_and_max_ngram():
    seq = [7, 8, 1, 7, 8, 2, 7, 8]  # [7, 8] at 0 (-> 1) and at 3 (-> 2): the latest, 3, wins
    assert propose(seq, k=1).tokens == [2]
    assert propose(seq, k=2, max_ngram=1).tokens == [2, 7]  # 1-gram [8] latest at 4
    assert propose(seq, k=2, max_ngram=1).features[0].ngram_len == 1


def test_continuation_stops_at_k_and_at_the_end_of_the_sequence():
    seq = [5, 6, 7, 8, 9, 5, 6]
    assert propose(seq, k=2).tokens == [7, 8]
    assert propose(seq, k=10).tokens == [7, 8, 9, 5, 6]  # runs into the suffix, not past the end
    assert [f.position for f in propose(seq, k=10).features] == [0, 1, 2, 3, 4]


def test_repeating_pattern_proposes_its_period():
    assert propose([1, 2, 1, 2, 1, 2], k=4).tokens == [1, 2]  # 4-gram [1,2,1,2] at 0 -> tokens 4.. = [1, 2]


def test_no_match_k_zero_and_short_sequences_give_empty():
    assert propose([1, 2, 3, 4], k=5).tokens == []
    assert propose([1, 2, 1], k=0).tokens == []
    assert propose([], k=5).tokens == []
    assert propose([3], k=5).tokens == []
    assert propose([3, 3], k=5).tokens == [3]
    assert propose([1, 2, 3, 1, 2], k=5, min_ngram=3).tokens == []  # only a 2-gram matches


def test_max_context_limits_the_search():
    seq = [9, 4] + [0] * 10 + [9]  # 9 followed by 4 only beyond the window
    assert propose(seq, k=1).tokens == [4]
    assert propose(seq, k=1, max_context=8, max_ngram=2).tokens == []


def test_batch_keeps_order_and_is_deterministic():
    drafter = PromptLookupDrafter()
    seqs = [DraftInput("a", [1, 2, 1]), DraftInput("b", [4, 5, 6]), DraftInput("c", (3, 4, 3))]
    first = drafter.propose(seqs, 3)
    assert [p.tokens for p in first] == [[2, 1], [], [4, 3]]
    assert drafter.propose(seqs, 3) == first


def test_find_match_agrees_with_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30)))
        for n in range(1, 5):
            want = None
            for j in range(len(tokens) - n):  # ends at j + n - 1 <= len - 2
                if list(tokens[j:j + n]) == list(tokens[len(tokens) - n:]):
                    want = j
            assert find_match(tokens, n) == want


def test_bad_bounds_raise():
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        PromptLookupDrafter(min_ngram=0)
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=4, max_context=4)
