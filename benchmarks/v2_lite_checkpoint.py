"""A random DeepSeek-V2-Lite-shaped checkpoint (HF folder) for throughput and KV-size figures, and those figures.

No trained V3-family checkpoint small enough for a CPU ships in a package, so this writes one with V2-Lite's
real config (``deepseek_v2``: hidden 2048, 16 heads, MLA with kv_lora_rank 512 + RoPE 64, no query bottleneck,
64 routed experts of 1408 + 2 shared, 6 per token, first layer dense, vocabulary 102,400, YaRN factor 40) and
``--layers`` decoder layers (27 in V2-Lite; fewer keep a CPU run short: the per-layer figures do not change),
random weights (std 0.02, norms 1) in bf16 safetensors, one shard per layer, plus the tests' byte-level tokenizer
padded to the vocabulary. ``deepinfer up --model DIR`` serves it like any DeepSeek folder (its text is noise).

Then, unless ``--no-serve``: the engine over it (CPU, ``--dtype``), printing KV bytes per token (the pool's
latent rows) beside what expanded per-head K/V would take, prefill tok/s of one ``--prompt``-token prompt, and
decode tok/s of 1 and ``--batch`` concurrent greedy streams.

    python benchmarks/v2_lite_checkpoint.py --out /tmp/v2lite --layers 2     # ~2.5 GB on disk, ~2 min
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.model.deepseek import hf_weight_shapes
from shared.model.hf_loader import read_hf_config

logger = logging.getLogger("v2_lite_checkpoint")

V2_LITE = {  # DeepSeek-V2-Lite's config.json, as released (the fields deepinfer reads)
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_checkpoint(out: Path, layers: int, seed: int = 0) -> Path:
    """Config, bf16 random shards (one per layer; embedding and head in their own) and tokenizer under ``out``."""
    from safetensors.torch import save_file

    from tests.model_factory import tiny_hf_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**V2_LITE, "num_hidden_layers": layers}, indent=2))
    shapes = hf_weight_shapes(read_hf_config(out))
    gen = torch.Generator().manual_seed(seed)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        key = name.split(".")[2] if name.startswith("model.layers.") else "globals"
        groups.setdefault(key, []).append(name)
    weight_map = {}
    for key, names in groups.items():
        shard = f"model-{key}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
            tensors[name] = t.to(torch.bfloat16)
            weight_map[name] = shard
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        logger.info("wrote %s (%d tensors)", shard, len(tensors))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tiny_hf_tokenizer(V2_LITE["vocab_size"]).save(str(out / "tokenizer.json"))
    return out


def measure(folder: Path, dtype: str, prompt_len: int, batch: int, tokens: int) -> None:
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling import SamplingParams

    eng = LLMEngine.from_path(str(folder), EngineConfig(dtype=dtype, block_size=16, kv_cache_bytes=1 << 30,
                                                        max_num_batched_tokens=max(prompt_len, 512)))
    c = eng.model.config
    pool = eng.kv_pools()[0]
    latent = pool["block_bytes"] / eng.config.block_size
    expanded = c.num_layers * c.num_heads * (c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim + c.mla.v_head_dim) \
        * eng.model.embed.element_size()
    logger.info("KV per token (%d layers, %s): latent %.0f B vs expanded K/V %.0f B (%.1fx); pool %d blocks",
                c.num_layers, dtype, latent, expanded, expanded / latent, pool["blocks"])
    vocab = c.vocab_size
    prompt = [(7919 * i) % (vocab - 10) + 5 for i in range(prompt_len)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    eng.generate([prompt[:32]], one)   # warm-up
    t0 = time.perf_counter()
    eng.generate([prompt], one)
    logger.info("prefill %d tokens: %.2f s (%.0f tok/s)", prompt_len, time.perf_counter() - t0,
                prompt_len / (time.perf_counter() - t0))
    for n in (1, batch):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[t + i for t in prompt[:64]] for i in range(n)]
        t0 = time.perf_counter()
        eng.generate(prompts, params)
        logger.info("decode, %d stream(s) x %d tokens (64-token prompts): %.1f tok/s", n, tokens,
                    n * tokens / (time.perf_counter() - t0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (V2-Lite has 27)")
    parser.add_argument("--no-serve", action="store_true", help="only write the checkpoint")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    if not (args.out / "config.json").is_file():
        write_checkpoint(args.out, args.layers)
    if not args.no_serve:
        measure(args.out, args.dtype, args.prompt, args.batch, args.tokens)


if __name__ == "__main__":
    main()
