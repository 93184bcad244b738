"""LLaMA-family decoder (Llama 1-3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3) over a paged KV cache.

RMSNorm → GQA attention with RoPE (fused QKV projection, optional Q/K/V bias, optional per-head Q/K RMSNorm,
optional per-layer sliding window) → residual → RMSNorm → gated MLP (fused gate/up; SiLU or tanh-GELU) →
residual; final RMSNorm; LM head (tied or not) evaluated only at the positions the caller asks for
(``logits_indices``), never on every prompt token.

Gemma 3 adds, all driven by ``ModelConfig`` knobs: embeddings scaled by sqrt(hidden) in the run dtype, an RMSNorm
on the attention output and on the MLP output before each residual add (``sandwich_norms``), norms that scale by
``1 + weight`` (``norm_weight_offset``), the attention scale ``query_pre_attn_scalar ** -0.5``, and a second RoPE
table (``rope_local_theta``, unscaled) for the sliding-window layers.

Weights arrive in HF naming and HF conventions (see shared/model/gguf_loader.py and hf_loader.py) and are fused
at load. Invariant: in float32/float64 every norm computes ``x * rsqrt(mean(x²) + eps) * (offset + w)`` with
``offset + w`` formed in float32 first, as transformers does; in half precision a Gemma norm runs in float32
and casts once at the end (transformers' Gemma3RMSNorm), a LLaMA norm scales in the run dtype (LlamaRMSNorm).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.layer_ops import add_rms_norm_, rms_norm, rope_, silu_mul
from shared.model.attention import AttentionMetadata, attend
from shared.model.kv_cache import KVGroups, layer_view
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
    post_norm: torch.Tensor  # [hidden]: the norm in front of the MLP
    gate_up: torch.Tensor  # [2 * ffn, hidden]
    down: torch.Tensor  # [hidden, ffn]
    sliding_window: int | None
    q_norm: torch.Tensor | None = None  # [D] per-head RMSNorm before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden] on the attention output before the residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP output before the residual add (Gemma)
    rope: int = 0  # index into LlamaModel.rope_tables


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x: [..., N]``; a float32 ``w`` on half-precision ``x`` means Gemma's all-float32 norm."""
    if w.dtype == x.dtype:
        return rms_norm(x, w, eps)
    return F.rms_norm(x.float(), w.shape, w, eps).to(x.dtype)


def _add_norm_(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place, then ``_norm(h)``."""
    if w.dtype == h.dtype:
        return add_rms_norm_(h, delta, w, eps)
    h += delta
    return _norm(h, w, eps)


class LlamaModel:
    """Inference-only decoder. Not an nn.Module: it owns plain tensors and never tracks gradients."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.weights_digest = weights_digest(weights)  # content of the tensors as given (shared/model/fingerprint.py)
        # Gemma in half precision keeps its norm scales in float32 (see _norm); otherwise the run dtype
        norm_dtype = dtype if config.norm_weight_offset == 0 or dtype in (torch.float32, torch.float64) \
            else torch.float32

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"checkpoint lacks tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:  # the effective scale offset + w, formed in float32 like HF
            if not config.norm_weight_offset:
                return take(name)
            if name not in weights:
                raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"checkpoint lacks tensor {name!r}")
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            w = config.norm_weight_offset + weights[name].to(device=device, dtype=wide)
            return w.to(norm_dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = prepare_weight(self.embed if config.tie_word_embeddings else take("lm_head.weight"))
        self.final_norm = norm("model.norm.weight")
        self.embed_scale = None if config.embed_scale is None else \
            torch.tensor(config.embed_scale, dtype=torch.float32).to(device=device, dtype=dtype)  # HF's rounding
        local_rope = config.rope_local_theta is not None
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
            window = config.layer_sliding_windows[i]
            sandwich = config.sandwich_norms  # Gemma: post_attention_layernorm is on the attention output
            self.layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=prepare_weight(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])),
                qkv_bias=bias,
                o_proj=prepare_weight(take(a + "o_proj.weight")),
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich
                                    else "post_attention_layernorm.weight")),
                gate_up=prepare_weight(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=prepare_weight(take(p + "mlp.down_proj.weight")),
                sliding_window=window,
                q_norm=norm(a + "q_norm.weight") if a + "q_norm.weight" in weights else None,
                k_norm=norm(a + "k_norm.weight") if a + "k_norm.weight" in weights else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
                rope=1 if local_rope and window is not None else 0,
            ))
        self.cos, self.sin = build_rope_cache(config, dtype, device)  # [P, D] each: the global (full) layers' table
        self.rope_tables = [(self.cos, self.sin)]
        if local_rope and any(layer.rope for layer in self.layers):  # sliding layers: own base, never scaled
            local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            self.rope_tables.append(build_rope_cache(local, dtype, device))
        self.scale = config.attention_scale

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """``x: [T, hidden]`` → ``[T, hidden]``: down(act(gate(x)) * up(x))."""
        gate_up = linear(x, layer.gate_up)  # [T, 2 * ffn]
        if self.config.hidden_act == "silu":
            return linear(silu_mul(gate_up), layer.down)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, ffn] each
        return linear(F.gelu(gate, approximate="tanh") * up, layer.down)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T] int64 each
        meta: AttentionMetadata | list[AttentionMetadata],  # one per KV group with KVGroups
        kv_cache: torch.Tensor | KVGroups,  # [num_blocks, L, 2, kvh, block_size, D], or one pool per group
        logits_indices: torch.Tensor,  # [S] int64: rows of the batch whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, V]
        c = self.config
        eps = c.rms_norm_eps
        h = F.embedding(input_ids, self.embed)  # [T, hidden]: the residual stream, updated in place
        if self.embed_scale is not None:
            h = h * self.embed_scale
        rotations = [(cos[positions], sin[positions]) for cos, sin in self.rope_tables]  # [T, D] each
        delta = None  # [T, hidden]: the previous layer's MLP output, not yet added to h
        for i, layer in enumerate(self.layers):
            x = _norm(h, layer.input_norm, eps) if delta is None else _add_norm_(h, delta, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)  # [T, q + 2kv]
            cos, sin = rotations[layer.rope]
            if layer.q_norm is None:  # q and k sit side by side: rotate both heads' sets in one pass, in place
                qk = rope_(qkv[:, :c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim),
                           cos, sin)  # [T, H + kvh, D]
                q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]  # [T, H, D], [T, kvh, D]
            else:
                q, k = qkv[:, :c.q_size], qkv[:, c.q_size:c.q_size + c.kv_size]
                q = _norm(q.view(-1, c.num_heads, c.head_dim), layer.q_norm, eps)
                k = _norm(k.view(-1, c.num_kv_heads, c.head_dim), layer.k_norm, eps)
                q, k = rope_(q, cos, sin), rope_(k, cos, sin)  # [T, H, D], [T, kvh, D]
            v = qkv[:, c.q_size + c.kv_size:].view(-1, c.num_kv_heads, c.head_dim)
            k_cache, v_cache, layer_meta = layer_view(kv_cache, meta, i)
            o = attend(q, k, v, k_cache, v_cache, layer_meta, self.scale, layer.sliding_window)
            o = linear(o.flatten(1), layer.o_proj)  # [T, hidden]
            if layer.attn_out_norm is not None:
                o = _norm(o, layer.attn_out_norm, eps)
            x = _add_norm_(h, o, layer.post_norm, eps)
            delta = self._mlp(x, layer)  # [T, hidden]
            if layer.mlp_out_norm is not None:
                delta = _norm(delta, layer.mlp_out_norm, eps)
        h = h[logits_indices] + delta[logits_indices]  # the last residual add, only where logits are wanted
        h = _norm(h, self.final_norm, eps)  # [S, hidden]
        return linear(h, self.lm_head)  # [S, V]
