"""SWA-aware KV (shared/engine/hybrid_kv.py): what sliding-window layers save, in bytes and in sequences.

Part 1 (no weights loaded): Gemma 3 270M's real config (read from the packaged GGUF when ``gemma3-270m`` resolves,
else built from its published shape), bfloat16 KV, block size 16: KV bytes one sequence of ``--context`` tokens
needs, and how many such sequences a ``--pool-gib`` pool holds, full KV vs SWA-aware (pools split by
``hybrid_kv.pool_sizes`` for that context).

Part 2 (a real engine run, CPU): a tiny random Gemma-3-shaped model (float32, window ``--tiny-window``) serving
``--seqs`` requests of ``--tiny-context`` prompt tokens from one fixed KV budget: output tokens/s (all steps, and
steps with no prefill in them), the largest running batch and preemptions, full KV vs SWA-aware (greedy tokens
must agree). Part 3 (``--real-seqs N``): the same with the real Gemma 3 270M, ``N`` prompts of ``--context``
tokens in ``--real-pool-mib`` of fp32 KV.

    python benchmarks/swa_kv.py
    python benchmarks/swa_kv.py --context 32768 --pool-gib 4 --skip-run
    python benchmarks/swa_kv.py --real-seqs 4 --new-tokens 128     # about 8 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.config import EngineConfig
from shared.engine.hybrid_kv import pool_sizes, window_blocks_per_seq
from shared.engine.hybrid_kv import min_window_blocks
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.model import gemma3
from shared.model.config import ModelConfig
from shared.model.llama import LlamaModel


def gemma3_270m_config() -> tuple[ModelConfig, str]:
    try:
        from gguf import GGUFReader

        from shared.model.gguf_loader import _read_config
        from shared.model.locate import resolve_model
        path = resolve_model("gemma3-270m")
        reader = GGUFReader(path)
        return _read_config(path, reader, {t.name: t for t in reader.tensors}), f"read from {path.name}"
    except Exception as err:  # noqa: BLE001 - the published shape instead
        layers = 18
        return ModelConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=layers, num_heads=4,
                           num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                           max_position_embeddings=32768, tie_word_embeddings=True,
                           layer_sliding_windows=gemma3.layer_windows(512, layers), architecture="gemma3",
                           model_id="gemma3-270m", query_pre_attn_scalar=256.0, rope_local_theta=10000.0,
                           **gemma3.common_knobs(640)), f"published shape ({err!r})"


def capacity_table(mc: ModelConfig, context: int, pool_bytes: int, block_size: int = 16, elem: int = 2) -> None:
    windows = [w for w in mc.layer_sliding_windows if w is not None]
    window, n_win = max(windows), len(windows)
    layer_block = 2 * block_size * mc.num_kv_heads * mc.head_dim * elem
    nf_seq = -(-context // block_size)
    nw_seq = min(nf_seq, window_blocks_per_seq(window, block_size))
    full_seq = nf_seq * mc.num_layers * layer_block
    swa_seq = nf_seq * (mc.num_layers - n_win) * layer_block + nw_seq * n_win * layer_block
    cfg = EngineConfig(block_size=block_size)
    nf, nw = pool_sizes(pool_bytes, (mc.num_layers - n_win) * layer_block, n_win * layer_block, context, window,
                        block_size, min(min_window_blocks(window, cfg.block_size, cfg.max_num_batched_tokens), nf_seq), cfg.max_num_batched_tokens)
    print(f"{'layout':<12}{'KV/seq (MiB)':>14}{'seqs in pool':>14}{'pool blocks (full/window)':>28}")
    full_blocks = pool_bytes // (mc.num_layers * layer_block)
    print(f"{'full KV':<12}{full_seq / 2**20:>14.1f}{full_blocks // nf_seq:>14d}{full_blocks:>20d} / -")
    fit = min(nf // nf_seq, nw // nw_seq)
    print(f"{'SWA-aware':<12}{swa_seq / 2**20:>14.1f}{fit:>14d}{nf:>20d} / {nw}")
    print(f"saving: {full_seq / swa_seq:.2f}x fewer KV bytes per sequence, "
          f"{fit / max(1, full_blocks // nf_seq):.2f}x the sequences")


def tiny_model(args) -> LlamaModel:
    from tests.gemma_factory import gemma_config, gemma_weights

    config = gemma_config(head_dim=64, heads=4, kv_heads=1, window=args.tiny_window, num_layers=6,
                          max_position_embeddings=args.tiny_context + args.new_tokens + 16)
    return LlamaModel(config, gemma_weights(config, seed=1), torch.float32, torch.device("cpu"))


def engine_run(model: LlamaModel, swa: bool, seqs: int, context: int, pool_bytes: int, new_tokens: int,
               chunk: int) -> tuple[list[list[int]], float, float, int, int]:
    """``(tokens, wall s, decode-only s, widest batch, preemptions)`` for ``seqs`` random prompts."""
    eng = LLMEngine(model, EngineConfig(block_size=16, kv_cache_bytes=pool_bytes, swa_kv=swa, dtype="float32",
                                        max_num_batched_tokens=chunk, device="cpu", swa_kv_context=context))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 300, (context,), generator=gen).tolist() for _ in range(seqs)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    got = {i: [] for i in ids}
    widest, decode_s, t0 = 0, 0.0, time.perf_counter()
    while eng.has_unfinished():
        ts = time.perf_counter()
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.waiting) or \
            any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running)
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        decode_s += 0.0 if prefilling else time.perf_counter() - ts
        widest = max(widest, len(eng.scheduler.running))
    return [got[i] for i in ids], time.perf_counter() - t0, decode_s, widest, eng.num_preemptions


def compare(model: LlamaModel, args, seqs: int, context: int, pool_bytes: int) -> None:
    print(f"{'layout':<12}{'out tok/s':>10}{'decode-only tok/s':>19}{'wall s':>8}{'max batch':>11}{'preemptions':>13}")
    results = {}
    for swa in (False, True):
        tokens, wall, decode_s, widest, preempted = engine_run(model, swa, seqs, context, pool_bytes,
                                                               args.new_tokens, args.chunk)
        results[swa] = tokens
        decode_tokens = sum(len(t) for t in tokens) - seqs   # the first token of each comes with its prefill
        print(f"{'SWA-aware' if swa else 'full KV':<12}{seqs * args.new_tokens / wall:>10.2f}"
              f"{decode_tokens / max(decode_s, 1e-9):>19.2f}{wall:>8.1f}{widest:>11d}{preempted:>13d}")
    print(f"greedy tokens identical: {results[True] == results[False]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool-gib", type=float, default=1.0)
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tiny-context", type=int, default=1024)
    ap.add_argument("--tiny-window", type=int, default=64)
    ap.add_argument("--tiny-pool-kib", type=int, default=6144)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--real-seqs", type=int, default=0, help="also serve the real Gemma 3 270M (--context tokens)")
    ap.add_argument("--real-pool-mib", type=int, default=320)
    args = ap.parse_args()
    mc, source = gemma3_270m_config()
    print(f"Gemma 3 270M config ({source}): {mc.num_layers} layers, "
          f"{sum(w is not None for w in mc.layer_sliding_windows)} with window "
          f"{max(w for w in mc.layer_sliding_windows if w)}, kvh {mc.num_kv_heads}, D {mc.head_dim}; bf16 KV, "
          f"block 16, context {args.context}, pool {args.pool_gib} GiB")
    capacity_table(mc, args.context, int(args.pool_gib * 2**30))
    if args.skip_run:
        return
    print(f"\ntiny Gemma-3-shaped engine run: {args.seqs} x {args.tiny_context}-token prompts, "
          f"{args.new_tokens} new tokens, window {args.tiny_window}, KV budget {args.tiny_pool_kib} KiB")
    compare(tiny_model(args), args, args.seqs, args.tiny_context, args.tiny_pool_kib << 10)
    if args.real_seqs:
        from shared.model.locate import resolve_model
        model = LLMEngine.from_path(resolve_model("gemma3-270m"), EngineConfig(
            num_kv_blocks=16, dtype="float32", device="cpu")).model
        print(f"\nGemma 3 270M (fp32, CPU): {args.real_seqs} x {args.context}-token prompts, {args.new_tokens} new "
              f"tokens, chunks of {args.chunk}, KV budget {args.real_pool_mib} MiB")
        compare(model, args, args.real_seqs, args.context, args.real_pool_mib << 20)

if __name__ == "__main__":
    main()
