"""Architecture description of a LLaMA-family decoder (Llama, Mistral, Qwen2/3, Gemma 3), independent of the file
format it came from.

Invariants (checked in ``__post_init__``):
- ``num_heads * head_dim`` is the attention width; ``num_heads % num_kv_heads == 0`` (grouped-query attention).
- ``layer_sliding_windows`` has one entry per layer; ``None`` means full attention for that layer.
- ``rope_scaling`` is ``None`` or a dict with ``rope_type`` in {"linear", "llama3", "dynamic", "yarn"}; it applies
  to every layer, except the sliding-window layers when ``rope_local_theta`` is set (those use plain RoPE).
- The Gemma knobs (``hidden_act``, ``embed_scale``, ``query_pre_attn_scalar``, ``rope_local_theta``,
  ``sandwich_norms``, ``norm_weight_offset``) default to LLaMA behaviour, so a LLaMA config never sets them.
  Checkpoint norm weights keep Hugging Face's convention: the effective scale is ``norm_weight_offset + weight``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    layer_sliding_windows: tuple[int | None, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    model_id: str = "unknown"
    hidden_act: str = "silu"  # MLP gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size)), in the run dtype
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers (None: rope_theta everywhere)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual add (Gemma 2/3)
    norm_weight_offset: float = 0.0  # every RMSNorm scales by offset + weight (Gemma: 1.0)

    def __post_init__(self) -> None:
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError("layer_sliding_windows must have one entry per layer")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(HIDDEN_ACTS)})")
        for name in ("embed_scale", "query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config field {name} must be positive or None, got {value}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("linear", "llama3", "dynamic", "yarn", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")

    @property
    def attention_scale(self) -> float:
        """Softmax scale of q·k: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
