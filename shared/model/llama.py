"""LLaMA-family decoder (Llama 1-3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

RMSNorm → GQA attention with RoPE (fused QKV projection, optional Q/K/V bias, optional per-layer sliding
window) → residual → RMSNorm → SwiGLU MLP (fused gate/up) → residual; final RMSNorm; LM head (tied or not)
evaluated only at the positions the caller asks for (``logits_indices``), never on every prompt token.

Weights arrive in HF naming (see shared/model/gguf_loader.py and hf_loader.py) and are fused at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.layer_ops import add_rms_norm_, rms_norm, rope_, silu_mul
from shared.model.attention import AttentionMetadata, attend
from shared.model.kv_cache import layer_kv
from shared.errors import DeepinferError, ErrorCode
from shared.model.config import ModelConfig
from shared.model.fingerprint import weights_digest
from shared.model.linear import linear, prepare_weight
from shared.model.rope import build_rope_cache


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * ffn, hidden]
    down: torch.Tensor  # [hidden, ffn]
    sliding_window: int | None
    q_norm: torch.Tensor | None = None  # [D] per-head RMSNorm before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None


class LlamaModel:
    """Inference-only decoder. Not an nn.Module: it owns plain tensors and never tracks gradients."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.weights_digest = weights_digest(weights)  # content of the tensors as given (shared/model/fingerprint.py)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"checkpoint lacks tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = prepare_weight(self.embed if config.tie_word_embeddings else take("lm_head.weight"))
        self.final_norm = take("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=prepare_weight(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])),
                qkv_bias=bias,
                o_proj=prepare_weight(take(a + "o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=prepare_weight(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=prepare_weight(take(p + "mlp.down_proj.weight")),
                sliding_window=config.layer_sliding_windows[i],
                q_norm=take(a + "q_norm.weight") if a + "q_norm.weight" in weights else None,
                k_norm=take(a + "k_norm.weight") if a + "k_norm.weight" in weights else None,
            ))
        self.cos, self.sin = build_rope_cache(config, dtype, device)  # [P, D] each
        self.scale = config.head_dim ** -0.5

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T] int64 each
        meta: AttentionMetadata, kv_cache: torch.Tensor,  # [num_blocks, L, 2, kvh, block_size, D]
        logits_indices: torch.Tensor,  # [S] int64: rows of the batch whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, V]
        c = self.config
        h = F.embedding(input_ids, self.embed)  # [T, hidden]: the residual stream, updated in place
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        delta = None  # [T, hidden]: the previous layer's MLP output, not yet added to h
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps) if delta is None else \
                add_rms_norm_(h, delta, layer.input_norm, c.rms_norm_eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)  # [T, q + 2kv]
            if layer.q_norm is None:  # q and k sit side by side: rotate both heads' sets in one pass, in place
                qk = rope_(qkv[:, :c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim),
                           cos, sin)  # [T, H + kvh, D]
                q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]  # [T, H, D], [T, kvh, D]
            else:
                q, k = qkv[:, :c.q_size], qkv[:, c.q_size:c.q_size + c.kv_size]
                q = rms_norm(q.view(-1, c.num_heads, c.head_dim), layer.q_norm, c.rms_norm_eps)
                k = rms_norm(k.view(-1, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_norm_eps)
                q, k = rope_(q, cos, sin), rope_(k, cos, sin)  # [T, H, D], [T, kvh, D]
            v = qkv[:, c.q_size + c.kv_size:].view(-1, c.num_kv_heads, c.head_dim)
            o = attend(q, k, v, *layer_kv(kv_cache, i), meta, self.scale, layer.sliding_window)
            x = add_rms_norm_(h, linear(o.flatten(1), layer.o_proj), layer.post_norm, c.rms_norm_eps)
            delta = linear(silu_mul(linear(x, layer.gate_up)), layer.down)  # [T, hidden]
        h = h[logits_indices] + delta[logits_indices]  # the last residual add, only where logits are wanted
        h = rms_norm(h, self.final_norm, c.rms_norm_eps)  # [S, hidden]
        return linear(h, self.lm_head)  # [S, V]
