"""Confidence head: prefix trimming by cumulative acceptance, FixedK, persistence, training, the acceptance log."""
from __future__ import annotations

import argparse
import json
import logging
import math

import numpy as np
import pytest

from shared.spec import train_head
from shared.spec.acceptance_log import AcceptanceLog, read_log, read_log_groups
from shared.spec.confidence import DERIVED_NAMES, ConfidenceHead, FixedK, derived_row, design_matrix, load_head
from shared.spec.types import Proposal, TokenFeatures

D = len(DERIVED_NAMES)


def proposal(n, ngram=2, top1=1.0):
    return Proposal(list(range(100, 100 + n)), [TokenFeatures(top1, 0.0, ngram, i) for i in range(n)])


def constant_head(p, threshold=0.3):
    """Every token accepted with probability ``p``."""
    return ConfidenceHead(np.zeros(D), math.log(p / (1 - p)), np.zeros(D), np.ones(D), threshold)


def test_trim_keeps_the_longest_prefix_above_the_cumulative_threshold():
    head = constant_head(0.8)  # cumulative 0.8, 0.64, 0.512, 0.4096, 0.32768
    prop = proposal(5)
    for threshold, n in ((0.0, 5), (0.3, 5), (0.33, 4), (0.5, 3), (0.7, 1), (0.81, 0), (1.5, 0)):
        out = head.trim(prop, threshold)
        assert out.tokens == prop.tokens[:n] and out.features == prop.features[:n], threshold
    assert head.trim(prop).tokens == prop.tokens  # the head's own threshold, 0.3
    assert head.trim(Proposal(), 0.5) == Proposal()
    assert head.accept_prob(prop.features[0]) == pytest.approx(0.8)


def test_trim_matches_a_reference_on_random_heads():
    rng = np.random.default_rng(1)
    for _ in range(200):
        head = ConfidenceHead(rng.normal(size=D), float(rng.normal()), rng.normal(size=D), rng.uniform(0.5, 2, D))
        n = int(rng.integers(0, 6))
        prop = Proposal(list(range(n)), [TokenFeatures(float(rng.uniform()), float(rng.uniform(0, 3)),
                                                       int(rng.integers(0, 5)), i) for i in range(n)])
        threshold = float(rng.uniform())
        probs = head.accept_probs(np.asarray([f.as_list() for f in prop.features]))  # the batch path
        assert [head.accept_prob(f) for f in prop.features] == pytest.approx(probs.tolist(), rel=1e-12, abs=1e-15)
        want = int(np.count_nonzero(np.cumprod(probs) >= threshold))
        out = head.trim(prop, threshold)
        assert out == prop.trimmed(want)


def test_derived_row_matches_design_matrix():
    rows = [TokenFeatures(0.0, 2.0, 0, 0), TokenFeatures(0.3, 0.5, 3, 2), TokenFeatures(1.0, 0.0, 1, 4)]
    want = design_matrix(np.asarray([f.as_list() for f in rows]))
    assert np.allclose(np.asarray([derived_row(f) for f in rows]), want, rtol=1e-15, atol=0)


def test_fixed_k():
    prop = proposal(5)
    assert FixedK(3).trim(prop, 0.99) == prop.trimmed(3)
    assert FixedK(5).trim(prop) is prop
    assert FixedK(0).trim(prop).tokens == []
    with pytest.raises(ValueError):
        FixedK(-1)


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    head = ConfidenceHead(rng.normal(size=D), 0.25, rng.normal(size=D), rng.uniform(0.5, 2, D), 0.4,
                          {"num_rows": 7})
    path = tmp_path / "head.json"
    head.save(path)
    loaded = load_head(path)
    assert isinstance(loaded, ConfidenceHead)
    assert loaded.threshold == 0.4 and loaded.training == {"num_rows": 7} and loaded.bias == 0.25
    raw = rng.uniform(0, 3, size=(20, 4))
    assert np.array_equal(loaded.accept_probs(raw), head.accept_probs(raw))
    data = json.loads(path.read_text())
    assert data["feature_names"] == list(DERIVED_NAMES)
    data["feature_names"] = data["feature_names"][::-1]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError):
        load_head(path)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        ConfidenceHead.load(path)


def test_missing_head_falls_back_to_fixed_k(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="shared.spec.confidence"):
        for spec in (None, "", tmp_path / "absent.json"):
            head = load_head(spec, default_k=4)
            assert isinstance(head, FixedK) and head.k == 4
    assert len(caplog.records) == 3


def synthetic_log(path, num_proposals, seed):
    """Acceptance depends on ngram_len: P(accept) = 0.1 + 0.2 * ngram_len (ngram 1..4)."""
    rng = np.random.default_rng(seed)
    with AcceptanceLog(path, append=False) as alog:
        for _ in range(num_proposals):
            n, ok = int(rng.integers(1, 5)), True
            feats, acc = [], []
            for i in range(5):
                ok = ok and bool(rng.random() < 0.1 + 0.2 * n)
                feats.append(TokenFeatures(1.0, 0.0, n, i))
                acc.append(ok)
            alog.record_proposal(feats, acc, "syn")


def test_training_learns_the_feature_dependence(tmp_path):
    path = tmp_path / "log.jsonl"
    synthetic_log(path, 4000, seed=3)
    x, y, g = read_log_groups(path)
    head, summary = train_head.train(x, y, g, threshold=0.3, l2=1.0, holdout=0.25)
    held = summary["held_out"]
    assert held["accuracy"] > held["majority_accuracy"] + 0.05
    for n in (1, 2, 3, 4):  # calibrated per ngram length (within sampling noise)
        assert head.accept_prob(TokenFeatures(1.0, 0.0, n, 1)) == pytest.approx(0.1 + 0.2 * n, abs=0.06)
    sim = summary["sim_held_out"]
    assert sim["verified_untrimmed"] == 5.0 and sim["verified_trimmed"] < 4.0
    assert sim["accepted_trimmed"] <= sim["accepted_untrimmed"]
    # refitting is deterministic
    again, _ = train_head.train(x, y, g, threshold=0.3, l2=1.0, holdout=0.25)
    assert np.array_equal(again.weights, head.weights) and again.bias == head.bias


def test_conditional_mask_and_simulation_exact():
    y = np.array([1, 0, 0, 1, 1, 1, 0, 1])
    g = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    assert train_head.conditional_mask(y, g).tolist() == [True, True, False, True, True, True, True, False]
    probs = np.array([0.9, 0.5, 0.5, 0.9, 0.9, 0.2, 0.9, 0.9])  # keeps at 0.3: 2, 2, 0 tokens
    sim = train_head.simulate(probs, y, g, 0.3)
    assert sim["proposals"] == 3
    assert sim["verified_untrimmed"] == pytest.approx(8 / 3, abs=1e-3)
    assert sim["accepted_untrimmed"] == pytest.approx((1 + 2 + 1) / 3, abs=1e-3)
    assert sim["verified_trimmed"] == pytest.approx(4 / 3, abs=1e-3)
    assert sim["accepted_trimmed"] == pytest.approx(3 / 3, abs=1e-3)
    assert sim["fixed1"] == [1.0, pytest.approx(1.0)]


def test_log_is_bounded_buffered_and_reads_back(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    alog = AcceptanceLog(path, max_records=3, flush_every=10, append=False)
    for i in range(5):
        alog.record(TokenFeatures(0.5, 1.0, 0, i), i < 2, "d")
    assert path.read_text() == ""  # buffered
    assert alog.num_dropped == 2
    alog.close()
    alog.close()
    assert alog.num_written == 3 and not alog.record(TokenFeatures(), True, "d")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"f": [0.5, 1.0, 0.0, 0.0], "accepted": 1, "drafter": "d", "p": 0}
    assert [r["p"] for r in lines] == [0, 0, 0]
    x, y = read_log(path)
    assert x.shape == (3, 4) and y.tolist() == [1, 1, 0]


def test_reader_splits_proposals_on_restart_drafter_and_skips_torn_lines(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    for _ in range(2):  # a restarted writer appends with p starting over at 0
        with AcceptanceLog(path) as alog:
            alog.record_proposal([TokenFeatures(position=i) for i in range(2)], [True, False], "a")
            alog.record_proposal([TokenFeatures(position=0)], [True], "b")
    with open(path, "a") as fh:
        fh.write('{"f": [1.0, 0.0')  # torn last line
    with caplog.at_level(logging.WARNING, logger="shared.spec.acceptance_log"):
        x, y, g = read_log_groups(path)
    assert g.tolist() == [0, 0, 1, 2, 2, 3] and y.tolist() == [1, 0, 1, 1, 0, 1]
    assert "1 malformed" in caplog.text
    xa, ya, ga = read_log_groups(path, drafter="a")
    assert ga.tolist() == [0, 0, 1, 1] and xa[:, 3].tolist() == [0, 1, 0, 1]


def test_cli_run_writes_a_loadable_head(tmp_path):
    log_path, out = tmp_path / "log.jsonl", tmp_path / "head.json"
    synthetic_log(log_path, 500, seed=4)
    lines = []
    args = argparse.Namespace(log=str(log_path), out=str(out), threshold=0.3, l2=1.0, holdout=0.2,
                              drafter=None, json=False)
    assert train_head.run(args, lambda *a, **k: lines.append(" ".join(map(str, a)))) == 0
    assert json.loads(lines[0])["sim_held_out"]["proposals"] == 100
    head = load_head(out)
    assert isinstance(head, ConfidenceHead) and head.training["held_out"]["rows"] > 0
    bad = argparse.Namespace(**{**vars(args), "log": str(tmp_path / "absent.jsonl")})
    assert train_head.run(bad, lambda *a, **k: None) == 2


def test_train_head_parser():
    parser = argparse.ArgumentParser()
    train_head.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["train-head", "--log", "a.jsonl", "--out", "h.json", "--l2", "0.5"])
    assert (args.log, args.out, args.threshold, args.l2, args.holdout) == ("a.jsonl", "h.json", 0.3, 0.5, 0.2)
