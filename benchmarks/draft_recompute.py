"""What the draft model's kept state saves: rebuild after a hand-off, and the per-step draft cost.

Draft: ``self:<N>`` of the installed SmolLM2-135M (fp32, CPU), ``k`` drafted tokens per step. Two tables:

- hand-off (no state on this worker), a ``--context``-token sequence: tokens run through the draft and ms for
  the first proposal when the state is rebuilt from the anchored window (``window`` to ``window + stride - 1``
  tokens) vs from the whole context (a drafter whose window covers it all);
- per step, decode-like steps from that context for 1 and ``--batch`` sequences (each step accepts a seeded
  random number of the drafted tokens, then one target token): tokens fed and ms per step when every step
  rebuilds the last ``window`` tokens (the drafter before kept state; ``--rebuild-steps``, its cost is flat),
  with kept state and ``stride 1`` (exactly the rebuild's proposals: past the window the anchor hops, so it
  still rebuilds every step), and with kept state and the default ``stride`` over ``--steps`` steps, enough for
  each sequence to cross an anchor hop (sequences start at different phases), so hops are in the mean.
  The runs take turns step by step, so a busy machine slows them alike. Ratios are against the per-step rebuild.
Only counts are exact; ms move with the machine's load (the last ``k - 1`` single-token draft forwards, bound by
reading the weights, are the floor of a kept-state step).

    python -m benchmarks.draft_recompute [--draft self:15] [--context 2560] [--window 128] [--steps 32]
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from dataclasses import dataclass

import torch

from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from shared.spec.draft_model import DraftModelDrafter, load_drafter
from shared.spec.types import DraftInput

ACCEPTED = (0, 1, 2, 2, 3, 5)  # drafted tokens accepted per step, drawn at random (seeded)


def timed(drafter: DraftModelDrafter, seqs: list[DraftInput], k: int) -> tuple[list[list[int]], float, int]:
    """``(proposals' tokens, ms, sequence tokens fed to the draft)`` of one ``propose`` call."""
    fed = drafter.stats()["fed_tokens"]
    t0 = time.perf_counter()
    tokens = [p.tokens for p in drafter.propose(seqs, k)]
    return tokens, (time.perf_counter() - t0) * 1e3, drafter.stats()["fed_tokens"] - fed


def handoff(drafters: list[DraftModelDrafter], seq: list[int], k: int, reps: int = 3) -> list[tuple[int, float]]:
    """Per drafter: tokens fed and best ms of the first proposal for a sequence it holds no state for (the
    drafters take turns, so a busy machine slows them alike)."""
    best = [(0, float("inf"))] * len(drafters)
    for rep in range(reps):
        for i, drafter in enumerate(drafters):
            drafter.release([f"h{rep - 1}"])
            _, ms, fed = timed(drafter, [DraftInput(f"h{rep}", seq)], k)
            best[i] = (fed, min(best[i][1], ms))
    return best


@dataclass
class Run:
    """One drafter stepping its own copy of the sequences. ``rebuild``: forget every state before each step."""
    drafter: DraftModelDrafter
    rebuild: bool
    num_steps: int
    seqs: list[list[int]]
    rng: random.Random
    fed: float = 0.0
    ms: float = 0.0


def steps(runs: list[Run], k: int) -> None:
    """Step the runs in turn (a busy machine slows them alike); the first step, which builds the states, is
    untimed. Each step accepts a seeded random prefix of the drafted tokens, then one token of the target's."""
    for step in range(max(r.num_steps for r in runs) + 1):
        for r in (r for r in runs if step <= r.num_steps):
            ids = [f"s{i}" for i in range(len(r.seqs))]
            if r.rebuild:
                r.drafter.release(ids)
            drafted, ms, fed = timed(r.drafter, [DraftInput(i, s) for i, s in zip(ids, r.seqs)], k)
            if step:
                r.fed, r.ms = r.fed + fed / r.num_steps, r.ms + ms / r.num_steps
            for s, d in zip(r.seqs, drafted):  # a rejection after the accepted prefix: the target's own token
                accepted = r.rng.choice(ACCEPTED)
                s += d[:accepted] + [(d[accepted] + 1) % 1000 if accepted < len(d) else 7]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="self:15", help="self:<layers of SmolLM2-135M>")
    ap.add_argument("--context", type=int, default=2560)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="steps with kept state (cover anchor hops)")
    ap.add_argument("--rebuild-steps", type=int, default=8, help="steps that rebuild (their cost is flat)")
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config, weights, _ = load_model_files(None)
    target = LlamaModel(config, weights, torch.float32, torch.device("cpu"))
    make = lambda **kw: load_drafter(args.draft, target, window=kw.pop("window", args.window), **kw)  # noqa: E731
    rng = random.Random(0)  # sequences at different phases of the anchor's hops
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.context + 16 * i)] for i in range(args.batch)]
    windowed, full = make(), make(window=args.context)
    for drafter in (windowed, full):
        timed(drafter, [DraftInput("warm", prompts[0][:64])], args.k)  # kernels loaded, allocator warm
    print(f"draft {args.draft} of {config.model_id} ({windowed.model.config.num_layers} layers, fp32, CPU, "
          f"{torch.get_num_threads()} threads); k={args.k}, window {args.window}, stride {windowed.stride}")
    (w_fed, w_ms), (f_fed, f_ms) = handoff([windowed, full], prompts[0], args.k)
    print(f"\nhand-off: first proposal with no state, context {args.context:,} tokens (best of 3)")
    print(f"  {'rebuild from':<34}{'tokens':>8}{'ms':>10}")
    print(f"  {'the anchored window':<34}{w_fed:>8}{w_ms:>10.1f}")
    print(f"  {'the whole context':<34}{f_fed:>8}{f_ms:>10.1f}")
    print(f"  {'ratio (whole / window)':<34}{f_fed / w_fed:>7.1f}x{f_ms / w_ms:>9.1f}x")
    print(f"\nper step from {args.context:,}+ tokens: mean over {args.rebuild_steps} steps (rebuild every step) or "
          f"{args.steps} (kept state); accepted {ACCEPTED} at random")
    print(f"  {'seqs':<6}{'drafter':<30}{'fed/step':>9}{'ms/step':>10}{'fed ratio':>11}{'ms ratio':>10}")
    for batch in sorted({1, args.batch}):
        rows = [("rebuild window every step", make(stride=1), True, args.rebuild_steps)]
        if batch == 1:  # exactly the rebuild's proposals; past the window the anchor hops every step
            rows.append(("kept state, stride 1", make(stride=1), False, args.rebuild_steps))
        rows.append((f"kept state, stride {windowed.stride}", make(), False, args.steps))
        runs = [Run(d, rebuild, n, [list(p) for p in prompts[:batch]], random.Random(batch))
                for _, d, rebuild, n in rows]
        steps(runs, args.k)
        base = runs[0]
        for (label, *_), r in zip(rows, runs):
            print(f"  {batch:<6}{label:<30}{r.fed:>9.1f}{r.ms:>10.1f}{base.fed / r.fed:>10.1f}x"
                  f"{base.ms / r.ms:>9.1f}x")


if __name__ == "__main__":
    main()
