"""The engine on a GPU: decode tokens/s at batch 1, 16 and 64, and prefill tokens/s, on the engine prompt set.
Ready for the device tool (one H200); not run in CI. Same engine code as on CPU: on CUDA the KV stores and
paged decode attention run the Triton kernels (``kernels/``), the rest is torch.

    python -m benchmarks.gpu_engine [--model path.gguf|hf-folder] [--dtype bfloat16] [--new-tokens 128]
                                    [--decode-graphs both|auto|off]

Decode: ``batch`` prompts at once, ``--new-tokens`` each, EOS ignored; tokens/s counts output tokens over the
whole run minus its prefill (measured separately: the first step's wall). Prefill: all 64 prompts with one new
token each, prompt tokens/s. Each figure is the best of ``--repeat`` runs after one warm-up run (kernel
compilation and autotuning excluded). Decode runs with CUDA graphs (``auto``, shared/engine/decode_graphs.py)
and without (``off``); ``both`` prints the two side by side with their ratio and whether their greedy outputs
are equal. Prints the device, dtype, and whether greedy outputs of batch 1 equal the first sequence of batch
16 (batch invariance of the greedy path).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"
log = logging.getLogger("bench.gpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s of one batch after its prefill step, and the outputs."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    _sync()
    t_first = None
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        _sync()
        if t_first is None and all(outputs[i] for i in ids):  # every prompt prefilled: decode starts now
            t_first, done_at_first = time.perf_counter(), sum(map(len, outputs.values()))
    wall = time.perf_counter() - (t_first or time.perf_counter())
    decoded = sum(map(len, outputs.values())) - (done_at_first if t_first else 0)
    return decoded / max(wall, 1e-9), [outputs[i] for i in ids]


def prefill_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    _sync()
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--decode-graphs", default="both", choices=["both", "auto", "off"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = [p["token_ids"] for p in json.loads(PROMPTS.read_text())["prompts"]]
    modes = ["auto", "off"] if args.decode_graphs == "both" else [args.decode_graphs]

    def fresh(graphs: str = modes[0]) -> LLMEngine:  # no prefix cache carried between runs
        return LLMEngine.from_path(args.model, EngineConfig(dtype=args.dtype, device=args.device,
                                                            max_num_batched_tokens=args.max_batched_tokens,
                                                            enable_prefix_caching=False, decode_graphs=graphs))
    engine = fresh()
    log.info("device %s, dtype %s, %s", engine.model.device, engine.model.dtype,
             torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
    decode_rate(engine, prompts[:4], 8)  # warm-up: kernel compilation and autotuning
    results = {}
    for batch in (1, 16, 64):
        for mode in modes:
            rates = []
            for _ in range(args.repeat):
                rate, outs = decode_rate(fresh(mode), prompts[:batch], args.new_tokens)
                rates.append(rate)
            results[batch, mode] = (max(rates), outs)
            log.info("decode batch %3d, graphs %-4s: %8.1f out tok/s", batch, mode, max(rates))
        if len(modes) == 2:
            (a, out_a), (b, out_b) = results[batch, "auto"], results[batch, "off"]
            log.info("decode batch %3d: graphs / eager = %.2fx, greedy outputs equal: %s", batch, a / b,
                     out_a == out_b)
    log.info("prefill 64 prompts: %8.1f prompt tok/s",
             max(prefill_rate(fresh(), prompts) for _ in range(args.repeat)))
    same = results[1, modes[0]][1][0] == results[16, modes[0]][1][0]
    log.info("greedy batch-1 output equals batch-16's first sequence: %s", same)


if __name__ == "__main__":
    main()
