"""The confidence head, honestly evaluated: fitted on one side of a prompt split, measured on both sides.

SmolLM2-135M fp32 (or ``--target``: e.g. Qwen2.5-Coder 1.5B with its 0.5B as the drafter), greedy, CPU. Steps:
1. the prompt pool (``spec_acceptance_data.prompt_pool``: every ``engine_prompts.json`` prompt and code-edit
   task) splits into ``train`` / ``test`` by a stable hash of each prompt's near-duplicate group (``split_of``);
2. the target's greedy output for every prompt (``--new-tokens`` + k, EOS honoured; cached in ``--work``);
3. per drafter, one acceptance log per side (``spec_acceptance_data.log_acceptance``);
4. a head is fitted on the train log alone (``fit_head``);
5. offline, on each side's log: log-loss / accuracy and the simulated verified and accepted drafted tokens per
   proposal (head vs untrimmed k=5 vs k=3, ``train_head.simulate``);
6. online, the engine decodes ``--speed-prompts`` prompts of each side plain, with fixed k=5, fixed k=3 and the
   head (one engine, prefix caching off, the four runs of a prompt back to back so load noise hits all alike):
   verified drafted tokens per verification, acceptance, tokens per target forward, speed-up over plain.
   Speed-ups are ratios of process CPU time (one torch thread by default: on a shared 2-core host, wall time
   swings several-fold with other load and two threads spin at barriers; one thread's CPU time does not).

The simulated figures draft at every output position, so stretches the drafter copies well weigh more than in
a real run (where one proposal covers such a stretch): they overstate acceptance. The engine figures do not.

Invariants:
- ``fit_head`` opens only the train log, which holds only proposals drafted on train prompts: nothing of the
  test side (its prompts, outputs or labels) reaches the head (``tests/unit/test_spec_head_split.py``).
- Every speculative output is checked against plain greedy decoding; the table counts the identical ones.

    python -m benchmarks.spec_head_eval [--drafters prompt_lookup,self:26] [--new-tokens 128] [--speed-prompts 6]
                                        [--ship]   # --ship: the shipped prompt-lookup head is this run's
    python -m benchmarks.spec_head_eval --target ~/.cache/deepinfer/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --drafters ~/.cache/deepinfer/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --new-tokens 32 \
        --model-stride 4 --speed-prompts 3 --speed-tokens 32 --work /tmp/spec_head_qwen
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.spec_acceptance_data import SPLIT_SALT, log_acceptance, prompt_pool, split_of
from shared.spec import train_head
from shared.spec.acceptance_log import AcceptanceLog, read_log_groups
from shared.spec.confidence import DEFAULT_THRESHOLD, HEADS_DIR, ConfidenceHead

log = logging.getLogger("bench.spec_head_eval")
SIDES = ("train", "test")
CONFIGS = ("fixed k=5", "fixed k=3", "head")

Item = tuple[str, list[int]]  # (prompt name, token ids)


def split_items(tokenizer, salt: str = SPLIT_SALT) -> dict[str, list[Item]]:
    """The pool's prompts by side, each in pool order (see ``spec_acceptance_data.split_of``)."""
    sides: dict[str, list[Item]] = {side: [] for side in SIDES}
    for name, key, ids in prompt_pool(tokenizer):
        sides[split_of(key, salt)].append((name, ids))
    return sides


def log_path(work: Path, drafter: str, side: str) -> Path:
    return work / f"{Path(drafter).name.replace(':', '')}.{side}.jsonl"   # a drafter path: its file name


def write_side_log(drafter, items: list[Item], outputs: dict[str, list[int]], eos: set[int], path: Path,
                   new_tokens: int, k: int, stride: int) -> dict[str, int]:
    """Log ``drafter``'s proposals on ``items`` (one side) into ``path`` (overwritten); returns the counts."""
    totals: dict[str, int] = {}
    with AcceptanceLog(path, max_records=10_000_000, append=False) as alog:
        for name, ids in items:
            out = outputs[name]
            counts = log_acceptance(drafter, ids, out, new_tokens, k, bool(out) and out[-1] in eos, alog, stride)
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
    return totals


def fit_head(train_log: Path, drafter: str, threshold: float = DEFAULT_THRESHOLD,
             l2: float = 1.0) -> ConfidenceHead:
    """A head fitted on every proposal of ``train_log`` (the only file read; no hold-out within it)."""
    x, y, g = read_log_groups(train_log, drafter)
    head, _ = train_head.train(x, y, g, threshold, l2, holdout=0.0)
    head.training.update(log=train_log.name, drafter=drafter)
    return head


def offline_eval(head: ConfidenceHead, path: Path, drafter: str) -> dict[str, Any]:
    """Classification on the rows verification conditions on, and the simulated proposals, of one side's log."""
    x, y, g = read_log_groups(path, drafter)
    if not len(y):
        return {"proposals": 0}
    probs = head.accept_probs(x)
    cond = train_head.conditional_mask(y, g)
    return {**train_head.classify(probs[cond], y[cond]), **train_head.simulate(probs, y, g, head.threshold)}


def target_outputs(engine, items: list[Item], max_tokens: int, cache: Path) -> dict[str, list[int]]:
    """Greedy output per prompt name, one prompt at a time (reused from ``cache`` when it holds the same key)."""
    from shared.sampling import SamplingParams

    key = {"max_tokens": max_tokens, "prompts": {name: ids for name, ids in items}}
    if cache.is_file() and (saved := json.loads(cache.read_text())).get("key") == key:
        return saved["outputs"]
    params, t0 = SamplingParams(max_tokens=max_tokens, temperature=0.0), time.perf_counter()
    outputs = {name: engine.generate([ids], params)[0] for name, ids in items}
    log.info("target outputs for %d prompts in %.0f s", len(items), time.perf_counter() - t0)
    cache.write_text(json.dumps({"key": key, "outputs": outputs}))
    return outputs


def online_eval(engine, drafter, head: ConfidenceHead, items: list[Item], new_tokens: int) -> dict[str, Any]:
    """Plain vs fixed k=5 / k=3 / head on ``items`` (single stream); per config: stats, speed-up, identical."""
    from shared.sampling import SamplingParams
    from shared.engine.speculator import SpecConfig, Speculator

    specs = {"fixed k=5": Speculator(drafter, SpecConfig(k=5)), "fixed k=3": Speculator(drafter, SpecConfig(k=3)),
             "head": Speculator(drafter, SpecConfig(k=5), head)}
    cpu = dict.fromkeys(("plain", *specs), 0.0)
    wall = dict.fromkeys(("plain", *specs), 0.0)
    steps = dict.fromkeys(("plain", *specs), 0)
    same = dict.fromkeys(specs, 0)
    tokens = 0
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    for _, ids in items:
        ref: list[int] = []
        for name in ("plain", *specs):
            engine.set_speculator(specs.get(name))
            out: list[int] = []
            engine.add_request(ids, params)
            c0, t0 = time.process_time(), time.perf_counter()
            while engine.has_unfinished():
                steps[name] += 1
                for o in engine.step():
                    out.extend(o.new_token_ids)
            cpu[name] += time.process_time() - c0
            wall[name] += time.perf_counter() - t0
            if name == "plain":
                ref, tokens = out, tokens + len(out)
            else:
                same[name] += out == ref
    engine.set_speculator(None)
    result: dict[str, Any] = {"prompts": len(items), "tokens": tokens, "plain_tok_s": tokens / cpu["plain"]}
    for name, spec in specs.items():
        st = spec.stats()
        result[name] = {"verified_per_step": st["verified_per_proposal"], "acceptance": st["acceptance_rate"],
                        "tokens_per_forward": tokens / steps[name], "speedup": cpu["plain"] / cpu[name],
                        "speedup_wall": wall["plain"] / wall[name], "identical": same[name],
                        "tok_s": tokens / cpu[name]}
    return result


def evenly(items: list[Item], count: int) -> list[Item]:
    if count >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / max(1, count - 1))] for i in range(count)]


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def format_table(report: dict[str, Any]) -> list[str]:
    """One table: per drafter and config, offline (simulated on every logged proposal) and online figures for
    the train (in-sample) and test (out-of-sample) sides, then head / fixed k=5 ratios."""
    head_cols = "sim ver  sim acc | ver/step  accept  tok/fwd  speed-up  same"
    lines = [f"{'':14} {'':10} | {'train (in-sample)':^62} | {'test (out-of-sample)':^62}",
             f"{'drafter':14} {'config':10} | {head_cols:62} | {head_cols:62}"]
    for drafter, r in report["drafters"].items():
        rows: dict[str, list[str]] = {c: [] for c in (*CONFIGS, "head/k=5")}
        for side in SIDES:
            sim, on = r["offline"][side], r["online"][side]
            simulated = {"fixed k=5": (sim["verified_untrimmed"], sim["accepted_untrimmed"]),
                         "fixed k=3": tuple(sim["fixed3"]), "head": (sim["verified_trimmed"], sim["accepted_trimmed"])}
            for c in CONFIGS:
                o = on[c]
                rows[c].append(f"{simulated[c][0]:7.2f}  {simulated[c][1]:7.2f} | {o['verified_per_step']:8.2f}  "
                               f"{o['acceptance']:6.2f}  {o['tokens_per_forward']:7.2f}  {o['speedup']:7.2f}x  "
                               f"{o['identical']:2d}/{on['prompts']:<2d}")
            h, f = on["head"], on["fixed k=5"]
            ratio = [_div(simulated["head"][0], simulated["fixed k=5"][0]),
                     _div(simulated["head"][1], simulated["fixed k=5"][1]),
                     _div(h["verified_per_step"], f["verified_per_step"]), _div(h["acceptance"], f["acceptance"]),
                     _div(h["tokens_per_forward"], f["tokens_per_forward"]), _div(h["speedup"], f["speedup"])]
            rows["head/k=5"].append(f"{ratio[0]:6.2f}x  {ratio[1]:6.2f}x | {ratio[2]:7.2f}x  {ratio[3]:5.2f}x  "
                                    f"{ratio[4]:6.2f}x  {ratio[5]:7.2f}x      ")
        for i, (c, cells) in enumerate(rows.items()):
            lines.append(f"{Path(drafter).name if i == 0 else '':14} {c:10} | {cells[0]:62} | {cells[1]:62}")
    lines.append("sim ver/acc: verified / accepted drafted tokens per proposal, simulated on every logged proposal;")
    lines.append("ver/step, accept, tok/fwd (tokens per target forward), speed-up (plain CPU time / this config's), "
                 "same (outputs identical to plain): engine runs")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", default="prompt_lookup,self:26", help="comma list: prompt_lookup, self:<N>, a path")
    ap.add_argument("--target", default=None, help="target model path (default: SmolLM2-135M); e.g. the Qwen2.5-Coder "
                    "1.5B GGUF of benchmarks/qwen_pair.py with its 0.5B as the drafter path")
    ap.add_argument("--work", default="/tmp/spec_head_eval", help="folder for outputs cache and acceptance logs")
    ap.add_argument("--new-tokens", type=int, default=128, help="output positions drafted at per prompt (logs)")
    ap.add_argument("--stride", type=int, default=1, help="draft at every N-th position (prompt lookup)")
    ap.add_argument("--model-stride", type=int, default=8, help="draft at every N-th position (model drafters)")
    ap.add_argument("--speed-prompts", type=int, default=6, help="prompts per side decoded by the engine")
    ap.add_argument("--speed-tokens", type=int, default=64, help="new tokens per engine run")
    ap.add_argument("--window", type=int, default=128, help="model drafters' sliding window")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    ap.add_argument("--l2", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (see the module doc)")
    ap.add_argument("--ship", action="store_true", help="write the prompt-lookup head (fitted on train) to "
                    f"{HEADS_DIR / 'prompt_lookup.json'}")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("shared").setLevel(logging.WARNING)
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.spec.factory import make_drafter

    k, work = 5, Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine.from_path(args.target, EngineConfig(dtype="float32", device="cpu", num_threads=args.threads,
                                                           enable_prefix_caching=False))
    sides = split_items(engine.tokenizer)
    log.info("split %s: train %d prompts, test %d prompts", SPLIT_SALT, len(sides["train"]), len(sides["test"]))
    outputs = target_outputs(engine, sides["train"] + sides["test"], args.new_tokens + k, work / "outputs.json")
    eos = set(engine.eos_token_ids)
    report: dict[str, Any] = {"split": {s: [n for n, _ in sides[s]] for s in SIDES}, "drafters": {}}
    for spec in [d.strip() for d in args.drafters.split(",") if d.strip()]:
        drafter = make_drafter(spec, engine.model, window=args.window)
        stride = args.stride if spec == "prompt_lookup" else args.model_stride
        paths = {side: log_path(work, spec, side) for side in SIDES}
        for side in SIDES:
            t0 = time.perf_counter()
            counts = write_side_log(drafter, sides[side], outputs, eos, paths[side], args.new_tokens, k, stride)
            log.info("%s %s log: %s (%.0f s)", spec, side, counts, time.perf_counter() - t0)
        head = fit_head(paths["train"], drafter.name, args.threshold, args.l2)
        r = report["drafters"][spec] = {"offline": {s: offline_eval(head, paths[s], drafter.name) for s in SIDES},
                                        "online": {}}
        for side in SIDES:
            t0 = time.perf_counter()
            r["online"][side] = online_eval(engine, drafter, head, evenly(sides[side], args.speed_prompts),
                                            args.speed_tokens)
            log.info("%s %s online (%.0f s): %s", spec, side, time.perf_counter() - t0, r["online"][side])
        if args.ship and spec == "prompt_lookup":
            head.training.update(split_salt=SPLIT_SALT, split_side="train", prompts=report["split"]["train"],
                                 test_side={key: r["offline"]["test"].get(key) for key in
                                            ("rows", "log_loss", "accuracy", "base_rate", "verified_untrimmed",
                                             "verified_trimmed", "accepted_untrimmed", "accepted_trimmed")})
            head.save(HEADS_DIR / "prompt_lookup.json")
            log.info("shipped %s", HEADS_DIR / "prompt_lookup.json")
    for line in format_table(report):
        print(line)
    print(json.dumps(_rounded(report["drafters"])))


def _rounded(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {key: _rounded(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rounded(value) for value in obj]
    return round(float(obj), 4) if isinstance(obj, (float, np.floating)) else obj


if __name__ == "__main__":
    main()
