"""DeepSeek V4 figures (issue 32), CPU.

Part 1, KV bytes of a context (no weights): a V4-Flash-shaped state (transformers' ``DeepseekV4Config`` defaults:
43 layers, head_dim 512, window 128, CSA groups of 4 with a 128-wide indexer, HCA groups of 128;
``shared/model/v4_state.context_bytes``) vs DeepSeek V3's MLA latents (61 layers x 576) and MLA at V4-Flash's
depth, vs a GQA model of 8 KV heads x 128 at that depth, bf16, at 8K / 77K / 1M tokens; tier tokens per GiB.

Part 2, prefill and decode at a V4-Flash-shaped random checkpoint scaled to fit a CPU (``--hidden``, ``--layers``;
the layer-type pattern, window, ratios, top-k and experts kept), float32: ``shared/model/deepseek_v4.py`` over its
per-sequence state vs transformers' ``DeepseekV4ForCausalLM`` with its cache, the same weights; greedy tokens
compared; a ``--prompt``-token prefill and ``--tokens`` decode steps, one sequence. Then the same request through
``LLMEngine`` (its scheduler, chunked prefill, the per-sequence state manager ``shared/engine/v4_kv.py``): cold,
and again as a prefix hit (the state snapshot before the prompt's last token), and on a fresh engine as a cache-tier
hit: the snapshot written as tier blocks (``KVPort.tier_state_run``) and imported (``import_tier_blocks``), the
import's time counted in the TTFT (no network: the bytes a tier would move are printed).

    python benchmarks/deepseek_v4.py            # about 2 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.model.hf_loader import read_hf_config
from shared.model import v4_tier
from shared.model.v4_state import context_bytes

logger = logging.getLogger("deepseek_v4")
CONTEXTS = (8192, 77_000, 1 << 20)


def flash_config(transformers, **overrides):
    return transformers.DeepseekV4Config(**overrides)


def bytes_table(transformers) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        flash_config(transformers).save_pretrained(tmp)
        config = read_hf_config(tmp)
    layers = config.num_layers
    kinds = {k: config.v4.layer_types.count(k) for k in set(config.v4.layer_types)}
    logger.info("KV bytes per token of context, bf16 (V4-Flash shape: %d layers %s):", layers, kinds)
    for n in CONTEXTS:
        v4 = context_bytes(config, n, 2) / n
        mla_v3, mla_same, gqa = 61 * 576 * 2, layers * 576 * 2, layers * 2 * 8 * 128 * 2
        logger.info("  %7d tokens: V4 %7.0f B | V3 MLA (61 layers) %6d B (%.1fx) | MLA at %d layers %6d B (%.1fx) | "
                    "GQA 8x128 at %d layers %6d B (%.1fx); tier tokens per GiB: V4 %.0f, V3 %.0f",
                    n, v4, mla_v3, mla_v3 / v4, layers, mla_same, mla_same / v4, layers, gqa, gqa / v4,
                    2 ** 30 / v4, 2 ** 30 / mla_v3)
    logger.info("  a 77K-token context hands off %.0f MiB as V4 state vs %.0f MiB of V3 latents",
                context_bytes(config, 77_000, 2) / 2 ** 20, 77_000 * 61 * 576 * 2 / 2 ** 20)
    for bs in (16, 128):   # tier blocks: entry slots per block (HCA's padded below 128), one tail per context
        shape = v4_tier.block_shape(config, bs)
        stored = (-(-77_000 // bs) + shape[0] - 1) * shape[1] * 2
        logger.info("  cache tier, %3d-token blocks: a 77K-token context stores %.0f MiB (%.0f B per token, %.2fx "
                    "its state; %.0f tokens per GiB), of which the tail %.1f MiB", bs, stored / 2 ** 20,
                    stored / 77_000, stored / context_bytes(config, 77_000, 2), 2 ** 30 * 77_000 / stored,
                    (shape[0] - 1) * shape[1] * 2 / 2 ** 20)


def speed(args, transformers) -> None:
    from shared.model.deepseek_v4 import V4Chunk
    from shared.model.loader import build_model, load_model_files
    from tests.deepseek_factory import write_v4_folder

    default = flash_config(transformers)
    pattern = default.layer_types[:args.layers]
    scale = args.hidden / default.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        write_v4_folder(tmp, seed=0, vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, int(default.num_attention_heads * scale)), head_dim=128,
                        q_lora_rank=int(default.q_lora_rank * scale), o_lora_rank=int(default.o_lora_rank * scale),
                        moe_intermediate_size=int(default.moe_intermediate_size * scale), layer_types=list(pattern),
                        mlp_layer_types=list(default.mlp_layer_types[:args.layers]), n_routed_experts=64,
                        num_experts_per_tok=default.num_experts_per_tok, compress_rates=default.compress_rates,
                        sliding_window=default.sliding_window, index_topk=default.index_topk,
                        index_n_heads=16, index_head_dim=64, o_groups=4, hc_mult=default.hc_mult,
                        partial_rotary_factor=0.5, swiglu_limit=default.swiglu_limit)
        config, weights, _ = load_model_files(tmp)
        ours = build_model(config, weights, torch.float32, torch.device("cpu"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = [(7919 * i) % 31990 + 5 for i in range(args.prompt)]
    logger.info("V4-Flash pattern scaled: hidden %d, %d layers %s, head_dim 128, 64 experts (6 per token); "
                "prompt %d tokens, %d decode steps, one sequence, float32", args.hidden, args.layers,
                [t.split("_")[0] for t in pattern], args.prompt, args.tokens)

    def run_ours() -> tuple[list[int], float, float]:
        state = ours.new_state()
        t0 = time.perf_counter()
        logits = ours.forward(torch.tensor(ids), torch.arange(len(ids)), [V4Chunk(state, 0, len(ids))],
                              torch.tensor([len(ids) - 1]))
        prefill = time.perf_counter() - t0
        tokens = [int(logits[0].argmax())]
        t0 = time.perf_counter()
        for _ in range(args.tokens - 1):
            pos = torch.tensor([state.num_tokens])
            logits = ours.forward(torch.tensor(tokens[-1:]), pos, [V4Chunk(state, 0, 1)], torch.tensor([0]))
            tokens.append(int(logits[0].argmax()))
        return tokens, prefill, time.perf_counter() - t0

    def run_hf() -> tuple[list[int], float, float]:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf(torch.tensor([ids]), use_cache=True)
            prefill = time.perf_counter() - t0
            tokens, cache = [int(out.logits[0, -1].argmax())], out.past_key_values
            t0 = time.perf_counter()
            for _ in range(args.tokens - 1):
                out = hf(torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
                cache = out.past_key_values
        return tokens, prefill, time.perf_counter() - t0

    def run_engine(engine) -> tuple[list[int], float, float, int]:
        from shared.sampling import SamplingParams

        rid = engine.add_request(ids, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
        tokens, t0, first, cached = [], time.perf_counter(), None, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    tokens += out.new_token_ids
                    first = first or time.perf_counter()
                    cached = out.num_cached_tokens if out.finished else cached
        return tokens, first - t0, time.perf_counter() - first, cached

    run_ours(), run_hf()   # warm-up
    (ours_tokens, ours_p, ours_d), (hf_tokens, hf_p, hf_d) = run_ours(), run_hf()
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(ours, EngineConfig(block_size=16, max_num_batched_tokens=512))
    cold, hit = run_engine(engine), run_engine(engine)
    from shared.sampling import SamplingParams   # the tier hit: the prompt's snapshot as tier blocks, imported fresh
    held = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    t0 = time.perf_counter()
    count, _, _, run, rows, mask = engine.kv_port.tier_state_run(held)
    split_s = time.perf_counter() - t0
    engine.kv_port.release_held(held)
    from shared.kv import block_pack
    fresh = LLMEngine(ours, EngineConfig(block_size=16, max_num_batched_tokens=512))
    t0 = time.perf_counter()
    imported = fresh.kv_port.import_tier_blocks(ids, "", 0, run[rows], block_pack.decode_mask(mask, count))
    import_s = time.perf_counter() - t0
    tier = run_engine(fresh)
    tier = (tier[0], tier[1] + import_s, tier[2], tier[3])
    logger.info("  prefill: deepinfer %.0f tok/s, transformers %.0f tok/s (%.2fx)", args.prompt / ours_p,
                args.prompt / hf_p, hf_p / ours_p)
    logger.info("  decode:  deepinfer %.1f tok/s, transformers %.1f tok/s (%.2fx); same greedy tokens: %s",
                (args.tokens - 1) / ours_d, (args.tokens - 1) / hf_d, hf_d / ours_d, ours_tokens == hf_tokens)
    for name, (tokens, ttft, decode, cached) in (("cold", cold), ("prefix hit", hit), ("tier hit", tier)):
        logger.info("  engine, %s: TTFT %.3f s (%d cached tokens), decode %.1f tok/s; same greedy tokens: %s", name,
                    ttft, cached, (args.tokens - 1) / decode, tokens == ours_tokens)
    logger.info("  engine prefix hit vs cold TTFT: %.1fx; tier hit vs cold: %.1fx (%d blocks, %.1f MiB of tier "
                "blocks: written in %.1f ms, imported in %.1f ms)", cold[1] / hit[1], cold[1] / tier[1], imported,
                run[rows].numel() * run.element_size() / 2 ** 20, split_s * 1e3, import_s * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    import transformers

    torch.set_num_threads(args.threads)
    bytes_table(transformers)
    speed(args, transformers)


if __name__ == "__main__":
    main()
