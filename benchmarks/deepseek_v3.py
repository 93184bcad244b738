"""DeepSeek V3 layout figures (issue 31), random weights at real shapes, CPU, float32 unless said.

Part 1, KV bytes per token (no weights): MLA's latent row (what ``shared/model/deepseek.py`` caches) vs the same
model's expanded per-head K/V (what an engine without MLA-native KV would cache) vs a GQA model with 8 KV heads of
128 dims, per layer and for the whole model, bf16; and tier tokens per GiB.

Part 2, decode attention at V2-Lite's MLA shapes (16 heads, nope 128, rope 64, v 128, kv_lora_rank 512): one
layer's attention for ``--batch`` decoding sequences of ``--context`` tokens from the same latent cache, absorbed
(``shared/model/mla_attention.py``: queries times W_UK, attention over 576-wide latent rows, W_UV after) vs
expanded (K = W_UK c and V = W_UV c rebuilt per head for the whole context each step, then attention: what
transformers does over its latent cache). Same outputs (checked), time per step and the ratio.

Part 3, one MoE layer at V2-Lite's expert shapes (hidden 2048, 64 routed experts of 1408, 6 per token, 2 shared):
``shared/model/moe.py`` (tokens grouped by expert) vs a per-token loop vs transformers' ``DeepseekV3MoE`` with the
same weights, for ``--tokens`` tokens (decode batch and prefill chunk sizes). Same outputs (checked).

    python benchmarks/deepseek_v3.py                       # about 2 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.model.config import MixtureOfExperts
from shared.model.moe import MoE, MoEWeights, gated_mlp

logger = logging.getLogger("deepseek_v3")
SHAPES = {  # name: (layers, heads, nope, rope, v, kv_lora_rank)
    "DeepSeek-V3": (61, 128, 128, 64, 128, 512),
    "DeepSeek-V2-Lite": (27, 16, 128, 64, 128, 512),
}


def timed(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def kv_bytes_table() -> None:
    logger.info("KV bytes per token, bf16:")
    for name, (layers, heads, nope, rope, v, rank) in SHAPES.items():
        latent = (rank + rope) * 2
        expanded = heads * (nope + rope + v) * 2
        gqa = 2 * 8 * 128 * 2
        logger.info("  %-17s per layer: latent %6d B, expanded K/V %7d B (%.1fx), GQA 8x128 %5d B (%.1fx); "
                    "whole model: latent %.1f KiB/token, tier tokens per GiB %.0f (expanded: %.0f)",
                    name, latent, expanded, expanded / latent, gqa, gqa / latent, layers * latent / 1024,
                    2 ** 30 / (layers * latent), 2 ** 30 / (layers * expanded))


def attention_bench(batch: int, context: int, repeat: int) -> None:
    _, heads, nope, rope, v, rank = SHAPES["DeepSeek-V2-Lite"]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(batch, context, rank + rope, generator=g)       # the latent cache of each sequence
    q_nope = torch.randn(batch, heads, nope, generator=g)
    q_pe = torch.randn(batch, heads, rope, generator=g)
    w_uk = torch.randn(heads, nope, rank, generator=g) * rank ** -0.5
    w_uv = torch.randn(heads, v, rank, generator=g) * rank ** -0.5
    scale = (nope + rope) ** -0.5

    def absorbed() -> torch.Tensor:
        q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe], dim=-1)   # [B, H, 576]
        probs = torch.softmax(torch.matmul(q, rows.transpose(1, 2)) * scale, dim=-1)  # [B, H, n]
        return torch.einsum("bhr,hvr->bhv", torch.matmul(probs, rows[..., :rank]), w_uv)  # [B, H, v]

    w_uk_rows, w_uv_rows = w_uk.reshape(heads * nope, rank), w_uv.reshape(heads * v, rank)  # one GEMM each

    def expanded() -> torch.Tensor:
        c, k_pe = rows[..., :rank], rows[..., rank:]
        k_nope = (c @ w_uk_rows.T).view(batch, context, heads, nope).transpose(1, 2)  # [B, H, n, nope]
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1, -1)], dim=-1)    # [B, H, n, 192]
        val = (c @ w_uv_rows.T).view(batch, context, heads, v).transpose(1, 2)      # [B, H, n, v]
        q = torch.cat([q_nope, q_pe], dim=-1)[:, :, None]                            # [B, H, 1, 192]
        return torch.nn.functional.scaled_dot_product_attention(q, k, val, scale=scale)[:, :, 0]

    diff = (absorbed() - expanded()).abs().max().item()
    ta, te = timed(absorbed, repeat), timed(expanded, repeat)
    logger.info("decode attention, one layer, %d sequences x %d tokens (V2-Lite MLA shapes): absorbed %.2f ms, "
                "expanded %.2f ms per step: absorbed %.1fx faster (max |diff| %.1e)", batch, context, ta * 1e3,
                te * 1e3, te / ta, diff)


def moe_bench(token_counts: list[int], repeat: int) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hidden, experts, inter, k, shared = 2048, 64, 1408, 6, 2
    cfg = MixtureOfExperts(n_routed_experts=experts, n_shared_experts=shared, num_experts_per_tok=k,
                           moe_intermediate_size=inter, first_k_dense_replace=0, n_group=1, topk_group=1,
                           norm_topk_prob=False, routed_scaling_factor=1.0)
    g = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=g) * 0.02   # noqa: E731
    w = MoEWeights(gate=rand(experts, hidden) * 50, bias=torch.zeros(experts), gate_up=rand(experts, 2 * inter, hidden),
                   down=rand(experts, hidden, inter), shared_gate_up=rand(2 * inter * shared, hidden),
                   shared_down=rand(hidden, inter * shared))
    ours = MoE(w, cfg)
    hf = DeepseekV3MoE(DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                                        num_experts_per_tok=k, n_shared_experts=shared, n_group=1, topk_group=1,
                                        norm_topk_prob=False, routed_scaling_factor=1.0)).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(w.gate)
        hf.experts.gate_up_proj.copy_(w.gate_up)
        hf.experts.down_proj.copy_(w.down)
        hf.shared_experts.gate_proj.weight.copy_(w.shared_gate_up[:inter * shared])
        hf.shared_experts.up_proj.weight.copy_(w.shared_gate_up[inter * shared:])
        hf.shared_experts.down_proj.weight.copy_(w.shared_down)

    def loop(x: torch.Tensor) -> torch.Tensor:   # one token at a time, one expert at a time
        from shared.model.moe import route
        weights, chosen = route(x, w, cfg)
        out = torch.empty_like(x)
        for t in range(x.shape[0]):
            acc = gated_mlp(x[t:t + 1], w.shared_gate_up, w.shared_down)
            for j in range(k):
                e = int(chosen[t, j])
                acc = acc + weights[t, j] * gated_mlp(x[t:t + 1], w.gate_up[e], w.down[e])
            out[t] = acc[0]
        return out

    for n in token_counts:
        x = torch.randn(n, hidden, generator=g)
        with torch.inference_mode():
            a, b, c = ours(x), loop(x), hf(x[None])[0]
            diff = max((a - b).abs().max().item(), (a - c).abs().max().item())
            t_ours = timed(lambda: ours(x), repeat)
            t_loop = timed(lambda: loop(x), max(1, repeat // 4))
            t_hf = timed(lambda: hf(x[None]), repeat)
        logger.info("MoE layer, %4d tokens: grouped %.1f ms (%.0f tok/s), per-token loop %.1f ms (%.2fx of grouped), "
                    "transformers %.1f ms (%.2fx); max |diff| %.1e", n, t_ours * 1e3, n / t_ours, t_loop * 1e3,
                    t_loop / t_ours, t_hf * 1e3, t_hf / t_ours, diff)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("torch %s, %d threads", torch.__version__, torch.get_num_threads())
    kv_bytes_table()
    attention_bench(args.batch, args.context, args.repeat)
    moe_bench([int(t) for t in args.tokens.split(",")], args.repeat)


if __name__ == "__main__":
    main()
