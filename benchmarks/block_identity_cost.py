"""What model identity and collision-proof block hashes cost: hashing per block, a device prefix-cache lookup,
a router placement including the prompt's hashing, and the model fingerprint at load.

- hash: ``hash_prompt_blocks`` (chained digests + 64-bit keys) of seeded random prompts, block 16:
  microseconds per prompt and per block (what the router does per request, and each engine per new block).
  Every timing is printed as min / median of its repetitions.
- lookup: ``BlockManager.get_computed_blocks`` of a prompt whose blocks are all cached (every hit compares the
  block's key: digest + tokens): microseconds per prompt and per block.
- place: ``services/router/placement.Placer.place`` (hashing, build choice, KV-index overlap, ``ClusterView``,
  the ``predictive`` policy) with 32 prefill + 32 decode workers of one build whose KV index holds the
  prompt's first half on 4 of them: microseconds per decision.
- fingerprint: the default model (SmolLM2-135M, ``shared/model/locate.py``) loaded once; seconds for the
  weights' checksums (``weights_digest``), the tokenizer digest, and the whole ``model_fingerprint``; with
  ``--no-model`` this part is skipped.

    python -m benchmarks.block_identity_cost [--reps 200] [--no-model]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.router.placement import Placer
from services.router.workers import WorkerTable
from shared import protocol
from shared.engine.block_manager import BlockManager
from shared.engine.request import Request
from shared.sampling import SamplingParams
from shared.kv.block_hash import hash_prompt_blocks
from services.router.policy.kv_index import KVIndex
from services.router.policy.types import CostModel

BLOCK, FP, LENGTHS = 16, "0123456789abcdef0123456789abcdef", (1024, 4096, 32768)


def timed_us(fn, reps: int) -> tuple[float, float]:
    """``(min, median)`` microseconds of ``reps`` calls (the min is what a shared, noisy machine can repeat)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return min(times) / 1e3, statistics.median(times) / 1e3


def prompts(rng: random.Random) -> dict[int, list[int]]:
    return {n: [rng.randrange(49152) for _ in range(n)] for n in LENGTHS}


def bench_hash(tokens: dict[int, list[int]], reps: int) -> None:
    for n, toks in tokens.items():
        lo, med = timed_us(lambda: hash_prompt_blocks(toks, BLOCK, FP, "salt"), max(5, reps * 1024 // n))
        print(f"hash    {n:>6} tokens: min {lo:8.1f} / median {med:8.1f} us per prompt, "
              f"{lo / (n // BLOCK):6.3f} / {med / (n // BLOCK):6.3f} us per block")


def bench_lookup(tokens: dict[int, list[int]], reps: int) -> None:
    params = SamplingParams(max_tokens=1)
    for n, toks in tokens.items():
        bm = BlockManager(num_blocks=n // BLOCK + 8, block_size=BLOCK)
        req = Request("warm", toks, params, block_size=BLOCK, model_fingerprint=FP)
        bm.allocate_slots(req, n)
        bm.free("warm")
        probe = Request("probe", toks, params, block_size=BLOCK, model_fingerprint=FP)
        assert bm.get_computed_blocks(probe)[1] == n - BLOCK
        lo, med = timed_us(lambda: bm.get_computed_blocks(probe), max(5, reps * 1024 // n))
        print(f"lookup  {n:>6} tokens: min {lo:8.1f} / median {med:8.1f} us per prompt, "
              f"{lo / (n // BLOCK - 1):6.3f} / {med / (n // BLOCK - 1):6.3f} us per block")


def bench_place(tokens: dict[int, list[int]], reps: int) -> None:
    table, index = WorkerTable(1e9), KVIndex()
    for i in range(64):
        table.update(protocol.LoadReport(
            worker_id=f"w{i}", role="prefill" if i < 32 else "decode", model_id="m", num_running=i % 7,
            num_waiting=i % 3, kv_usage=0.5, num_free_blocks=5000, num_total_blocks=10000, block_size=BLOCK,
            transports=["shm", "stream"], host="h", timestamp=0.0, model_fingerprint=FP))
    placer = Placer("predictive", table, index, CostModel(), 64, None)
    for n, toks in tokens.items():
        half = hash_prompt_blocks(toks[:n // 2], BLOCK, FP)
        for w in ("w1", "w2", "w33", "w34"):
            index.apply(protocol.KVEvent(worker_id=w, seq=(index.last_seq(w) or 0) + 1, kind="stored",
                                         block_hashes=half))
        lo, med = timed_us(lambda: placer.place("r", toks, 256, "", "auto"), max(5, reps * 1024 // n))
        print(f"place   {n:>6} tokens: min {lo:8.1f} / median {med:8.1f} us per decision (hashing included)")


def bench_fingerprint() -> None:
    import torch

    from shared.model.fingerprint import model_fingerprint, tokenizer_digest, weights_digest
    from shared.model.llama import LlamaModel
    from shared.model.loader import load_model_files

    t0 = time.perf_counter()
    config, weights, tokenizer = load_model_files(None)
    load_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    t0 = time.perf_counter()
    weights_digest(weights)
    weights_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer_digest(tokenizer)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = LlamaModel(config, weights, torch.float32, torch.device("cpu"))   # computes weights_digest again
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fp = model_fingerprint(model, tokenizer, BLOCK)
    fp_s = time.perf_counter() - t0
    print(f"fingerprint {config.model_id}: {len(weights)} tensors, {nbytes / 1e6:.0f} MB; load {load_s:.2f} s, "
          f"weights checksums {weights_s:.3f} s, tokenizer {tok_s:.3f} s, model build (incl. checksums) "
          f"{build_s:.2f} s, fingerprint from the built model {fp_s:.3f} s -> {fp}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-model", action="store_true")
    args = ap.parse_args(argv)
    tokens = prompts(random.Random(0))
    bench_hash(tokens, args.reps)
    bench_lookup(tokens, args.reps)
    bench_place(tokens, args.reps)
    if not args.no_model:
        bench_fingerprint()


if __name__ == "__main__":
    main()
