"""`deepinfer spec train-head`: fit a confidence head on an acceptance log and simulate its effect.

The log's proposals (``read_log_groups``) are split in file order: the last ``--holdout`` fraction of proposals
is held out (a later stretch of traffic, not a random shuffle of correlated neighbours). The head is fitted on
the training proposals only, on the rows verification conditions on: each proposal's tokens up to and
including its first rejection (``conditional_mask``). Rows after a rejection, if the log has them, only feed the
simulation.

Simulation, per proposal of the log (rows = its logged drafted tokens):
- verified = tokens sent to the target: all logged rows untrimmed, ``head.trim``'s prefix trimmed;
- accepted = the leading run of accepted tokens within those (the bonus token the target adds is not counted).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SWEEP = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
FIXED_KS = (1, 2, 3, 4)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from shared.spec.confidence import DEFAULT_THRESHOLD

    p = subparsers.add_parser("train-head", help="fit a speculative-decoding confidence head on an acceptance log")
    p.add_argument("--log", required=True, help="acceptance log (JSON lines, shared/spec/acceptance_log.py)")
    p.add_argument("--out", required=True, help="where to write the head (JSON)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"keep drafted tokens while their cumulative acceptance >= this (default {DEFAULT_THRESHOLD})")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the standardised weights (default 1)")
    p.add_argument("--holdout", type=float, default=0.2, help="fraction of proposals held out, the log's last")
    p.add_argument("--drafter", default=None, help="only this drafter's records (default: all)")
    p.add_argument("--json", action="store_true", help="print only the JSON summary")
    return p


def conditional_mask(y: np.ndarray, g: np.ndarray) -> np.ndarray:
    """[N] bool: rows whose earlier rows in the same proposal were all accepted (``g`` non-decreasing)."""
    rejected = (np.asarray(y) == 0).astype(np.int64)
    if len(rejected) == 0:
        return np.zeros(0, dtype=bool)
    before = np.cumsum(rejected) - rejected  # rejections strictly before each row, over the whole log
    starts = np.flatnonzero(np.diff(g, prepend=g[0] - 1) != 0)
    at_start = before[starts]  # rejections before each proposal's first row
    return before - at_start[np.searchsorted(starts, np.arange(len(g)), side="right") - 1] == 0


def holdout_mask(g: np.ndarray, fraction: float) -> np.ndarray:
    """[N] bool: rows of the last ``fraction`` of proposals (at least one held out when 0 < fraction)."""
    num = int(g.max()) + 1 if len(g) else 0
    if fraction <= 0 or num < 2:
        return np.zeros(len(g), dtype=bool)
    first_held = min(num - 1, max(1, math.floor(num * (1.0 - fraction))))
    return g >= first_held


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))) if len(y) else float("nan")


def classify(p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Log-loss, accuracy at 0.5 and the accuracy of always predicting the majority label."""
    if not len(y):
        return {"rows": 0}
    rate = float(np.mean(y))
    return {"rows": int(len(y)), "log_loss": round(log_loss(p, y), 4),
            "accuracy": round(float(np.mean((p >= 0.5) == (y == 1))), 4),
            "base_rate": round(rate, 4), "majority_accuracy": round(max(rate, 1 - rate), 4)}


def simulate(probs: np.ndarray, y: np.ndarray, g: np.ndarray, threshold: float) -> dict[str, float]:
    """Mean verified / accepted drafted tokens per proposal, untrimmed vs trimmed at ``threshold``.

    ``probs``: [N] the head's per-token probabilities; proposals are the runs of equal ``g``.
    """
    cond = conditional_mask(y, g)
    _, g_idx = np.unique(g, return_inverse=True)
    num = int(g_idx.max()) + 1 if len(g_idx) else 0
    if num == 0:
        return {"proposals": 0}
    log_p = np.log(np.clip(probs, 1e-300, 1.0))
    cum = np.cumsum(log_p)
    starts = np.flatnonzero(np.diff(g_idx, prepend=-1) != 0)
    cum_in = cum - (cum[starts] - log_p[starts])[g_idx]  # per-proposal cumulative log-probability
    keep = cum_in >= math.log(threshold) if threshold > 0 else np.ones(len(g_idx), dtype=bool)
    length = np.bincount(g_idx, minlength=num).astype(np.float64)
    run = np.bincount(g_idx, weights=(cond & (y == 1)).astype(np.float64), minlength=num)
    kept = np.bincount(g_idx, weights=keep.astype(np.float64), minlength=num)
    out = {"proposals": num, "threshold": threshold,
           "verified_untrimmed": round(float(length.mean()), 3), "accepted_untrimmed": round(float(run.mean()), 3),
           "verified_trimmed": round(float(kept.mean()), 3),
           "accepted_trimmed": round(float(np.minimum(kept, run).mean()), 3)}
    for k in FIXED_KS:
        out[f"fixed{k}"] = [round(float(np.minimum(length, k).mean()), 3),
                            round(float(np.minimum(run, k).mean()), 3)]
    return out


def train(x: np.ndarray, y: np.ndarray, g: np.ndarray, threshold: float, l2: float,
          holdout: float) -> tuple[Any, dict[str, Any]]:
    """Fit on the training proposals; return (head, summary) with metrics and simulations on both splits."""
    from shared.spec.confidence import ConfidenceHead

    cond, held = conditional_mask(y, g), holdout_mask(g, holdout)
    fit_rows = cond & ~held
    if not fit_rows.any():
        raise ValueError("no training rows (empty log, or everything held out)")
    head = ConfidenceHead.fit(x[fit_rows], y[fit_rows], l2=l2, threshold=threshold)
    probs = head.accept_probs(x)
    summary: dict[str, Any] = {"rows": int(len(y)), "proposals": int(len(np.unique(g))), "l2": l2,
                               "threshold": threshold, "held_out_fraction": holdout,
                               "train": classify(probs[fit_rows], y[fit_rows]),
                               "held_out": classify(probs[cond & held], y[cond & held])}
    for name, rows in (("sim_train", ~held), ("sim_held_out", held)):
        if rows.any():
            summary[name] = simulate(probs[rows], y[rows], g[rows], threshold)
    if held.any():
        summary["sweep_held_out"] = {
            str(t): [(s := simulate(probs[held], y[held], g[held], t))["verified_trimmed"], s["accepted_trimmed"]]
            for t in SWEEP}
    head.training.update(summary)
    return head, summary


def format_summary(s: dict[str, Any]) -> list[str]:
    """Human-readable lines for a ``train`` summary."""
    lines = [f"{s['rows']} rows in {s['proposals']} proposals; head fitted on {s['train']['rows']} rows "
             f"(tokens up to and including each proposal's first rejection), l2={s['l2']}"]
    for name in ("train", "held_out"):
        c = s[name]
        if c.get("rows"):
            lines.append(f"{name:>9}: log-loss {c['log_loss']:.4f}  accuracy {c['accuracy']:.4f}  "
                         f"(majority {c['majority_accuracy']:.4f}, acceptance rate {c['base_rate']:.4f})")
    for name in ("sim_train", "sim_held_out"):
        m = s.get(name)
        if m:
            lines.append(f"{name:>12}: per proposal verified {m['verified_untrimmed']:.2f} -> "
                         f"{m['verified_trimmed']:.2f}, accepted {m['accepted_untrimmed']:.2f} -> "
                         f"{m['accepted_trimmed']:.2f} "
                         f"(threshold {m['threshold']}; {m['proposals']} proposals)")
            lines.append(" " * 14 + "fixed k (verified, accepted): "
                         + "  ".join(f"k={k} {m[f'fixed{k}'][0]:.2f},{m[f'fixed{k}'][1]:.2f}" for k in FIXED_KS))
    if s.get("sweep_held_out"):
        lines.append("held-out threshold sweep (verified, accepted): "
                     + "  ".join(f"{t}: {v:.2f},{a:.2f}" for t, (v, a) in s["sweep_held_out"].items()))
    return lines


def run(args: argparse.Namespace, emit: Callable[..., None]) -> int:
    """Run the subcommand; all terminal output goes through ``emit`` (print-like; the CLI passes print)."""
    from shared.spec.acceptance_log import read_log_groups

    if not 0 <= args.holdout < 1 or args.l2 < 0 or not 0 <= args.threshold <= 1:
        emit("deepinfer spec train-head: need 0 <= holdout < 1, l2 >= 0, 0 <= threshold <= 1", file=sys.stderr)
        return 2
    try:
        x, y, g = read_log_groups(args.log, args.drafter)
    except OSError as err:
        emit(f"deepinfer spec train-head: cannot read log: {err}", file=sys.stderr)
        return 2
    try:
        head, summary = train(x, y, g, args.threshold, args.l2, args.holdout)
    except ValueError as err:
        emit(f"deepinfer spec train-head: {err}", file=sys.stderr)
        return 2
    summary["log"], summary["drafter"] = str(args.log), args.drafter
    head.training.update(log=Path(args.log).name, drafter=args.drafter)
    try:
        head.save(args.out)
    except OSError as err:
        emit(f"deepinfer spec train-head: cannot write head: {err}", file=sys.stderr)
        return 2
    emit(json.dumps(summary, sort_keys=True))
    if not args.json:
        for line in format_summary(summary):
            emit(line)
        emit(f"wrote {args.out}")
    return 0
