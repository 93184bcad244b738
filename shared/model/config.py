"""Architecture description of a LLaMA-family decoder (Llama, Mistral, Qwen2/3, Gemma 3), independent of the file
format it came from.

Invariants (checked in ``__post_init__``):
- ``num_heads * head_dim`` is the attention width; ``num_heads % num_kv_heads == 0`` (grouped-query attention).
- ``layer_sliding_windows`` has one entry per layer; ``None`` means full attention for that layer.
- ``rope_scaling`` is ``None`` or a dict with ``rope_type`` in {"linear", "llama3", "dynamic", "yarn"}; it applies
  to every layer, except the sliding-window layers when ``rope_local_theta`` is set (those use plain RoPE).
  ``max_position_embeddings`` is at least the context a scaling naming its original length extends to
  (``scaled_context``).
- The Gemma knobs (``hidden_act``, ``embed_scale``, ``query_pre_attn_scalar``, ``rope_local_theta``,
  ``sandwich_norms``, ``norm_weight_offset``) default to LLaMA behaviour, so a LLaMA config never sets them.
  Checkpoint norm weights keep Hugging Face's convention: the effective scale is ``norm_weight_offset + weight``.
- ``mla`` (DeepSeek V3's multi-head latent attention) and ``moe`` (DeepSeekMoE) are ``None`` for every other
  family. With ``mla`` the KV cache holds one latent row per token and layer (``kv_lora_rank + qk_rope_head_dim``
  numbers) instead of per-head K and V: ``kv_cache_heads`` / ``kv_cache_dim`` say what one K (and one V) slot of
  the paged layout holds, and a latent row fills the K slot with its first half and the V slot with its second
  (``shared/model/mla_attention.py``), so every block mover carries it unchanged.
- ``nextn_layers`` (``num_nextn_predict_layers``) counts DeepSeek's multi-token-prediction modules stored after the
  decoder's layers; they feed a drafter (``shared/model/mtp.py``) and never the model's own forward or KV.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """MLA (DeepSeek V2/V3): queries through ``q_lora_rank`` (None: one projection), keys and values through a
    ``kv_lora_rank`` latent shared by all heads plus a ``qk_rope_head_dim`` RoPE key shared by all heads."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's RoPE dims are interleaved pairs (V3); loaded de-interleaved

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MixtureOfExperts:
    """DeepSeekMoE: layers ``>= first_k_dense_replace`` route each token to ``num_experts_per_tok`` of
    ``n_routed_experts`` experts and always through ``n_shared_experts`` shared ones. ``scoring`` ``sigmoid``
    (V3: the choice ranks scores plus ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group``
    groups; weights renormalised when ``norm_topk_prob``) or ``softmax`` (V2: ``topk_method`` ``greedy``, or
    ``group_limited_greedy`` within the best groups by their top score; weights not renormalised); weights times
    ``routed_scaling_factor`` (``shared/model/moe.py``)."""
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring: str = "sigmoid"  # sigmoid (V3) | softmax (V2)
    topk_method: str = "noaux_tc"  # V3's; V2: greedy | group_limited_greedy


V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")


@dataclass(frozen=True, slots=True)
class CompressedAttention:
    """DeepSeek V4: every layer attends to a ``sliding_window`` of shared-KV MQA rows (one ``head_dim`` row per
    token, used as key and value) plus, by ``layer_types``, compressed entries: one per ``csa_ratio`` tokens picked
    per query by a lightning indexer's top ``index_topk`` (CSA), or one per ``hca_ratio`` tokens, all (HCA).
    Queries through ``q_lora_rank``; RoPE on the trailing ``rope_dim`` dims of each head (interleaved pairs), base
    ``rope_theta`` on sliding layers and ``compress_rope_theta`` (+ ``compress_rope_scaling``) on compressed ones;
    per-head attention sinks; grouped output projection (``o_groups`` x ``o_lora_rank``); ``hc_mult`` residual
    streams mixed by manifold-constrained hyper-connections; MoE in every layer (``mlp_layer_types``: ``hash_moe``
    routes by a frozen token→experts table, ``moe`` by top-k of ``scoring_func`` scores plus a bias), experts'
    SwiGLU inputs clipped at ``swiglu_limit`` (``shared/model/deepseek_v4.py``)."""
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    q_lora_rank: int
    rope_dim: int
    sliding_window: int
    csa_ratio: int
    hca_ratio: int
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any] | None
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float


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
    mla: LatentAttention | None = None  # DeepSeek V3 latent attention (then num_kv_heads == num_heads, unused)
    moe: MixtureOfExperts | None = None  # DeepSeekMoE layers
    nextn_layers: int = 0  # DeepSeek's next-n (MTP) prediction layers after the decoder's: drafters, not the model
    v4: CompressedAttention | None = None  # DeepSeek V4's hybrid sliding-window + compressed attention

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
        if self.mla is not None and self.mla.latent_dim % 2:
            raise ValueError(f"MLA latent rows must have an even width, got {self.mla.latent_dim}")
        if self.moe is not None and (self.moe.n_routed_experts % self.moe.n_group
                                     or not 0 < self.moe.num_experts_per_tok <= self.moe.n_routed_experts
                                     or not 0 < self.moe.topk_group <= self.moe.n_group):
            raise ValueError(f"inconsistent MoE config {self.moe}")
        if self.moe is not None and (self.moe.scoring, self.moe.topk_method) not in (
                ("sigmoid", "noaux_tc"), ("softmax", "greedy"), ("softmax", "group_limited_greedy")):
            raise ValueError(f"unsupported MoE routing {self.moe.scoring} / {self.moe.topk_method}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("linear", "llama3", "dynamic", "yarn", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
            object.__setattr__(self, "max_position_embeddings", max(self.max_position_embeddings,
                                                                    scaled_context(self.rope_scaling)))

    @property
    def attention_scale(self) -> float:
        """Softmax scale of q·k: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_cache_heads(self) -> int:
        """KV heads one block slot holds: ``num_kv_heads``, or 1 latent row with ``mla``."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        """Numbers per head in one K (or V) slot: ``head_dim``, or half a latent row with ``mla``."""
        return self.mla.latent_dim // 2 if self.mla is not None else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def scaled_context(scaling: dict[str, Any]) -> int:
    """The context a ``rope_scaling`` that names its ``original_max_position_embeddings`` extends to: original x
    factor for ``yarn`` / ``linear`` / ``dynamic`` (Qwen2.5's config.json keeps 32,768 beside YaRN x4 over 32,768:
    131,072 tokens, as vLLM derives); 0 when it names none (the config's own length stands)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    original = scaling.get("original_max_position_embeddings")
    if kind not in ("yarn", "linear", "dynamic") or not original:
        return 0
    return int(original * float(scaling.get("factor", 1.0)))


def with_rope_scaling(config: ModelConfig, scaling: dict[str, Any]) -> ModelConfig:
    """``config`` with its RoPE scaling replaced by ``scaling`` (an HF ``rope_scaling`` dict, as Qwen2.5 documents
    for YaRN: ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}``): an extension
    of the context the model was trained for, not a model of its own.

    ``original_max_position_embeddings`` defaults to the model's context and is written into the result (the RoPE
    tables and the fingerprint depend on it); the context becomes ``original * factor`` for ``yarn``, ``linear``
    and ``dynamic`` (``scaled_context``), and stays ``original`` for ``llama3`` (its factor rescales frequencies
    within it). Refused: a
    DeepSeek V3/V4 model (its YaRN belongs to its latent layout), an unknown type, a factor below 1."""
    if config.mla is not None or config.v4 is not None:
        raise ValueError("rope scaling cannot be overridden on a DeepSeek V3/V4 model (its own YaRN is part of its "
                         "attention layout)")
    if not isinstance(scaling, dict):
        raise ValueError("rope scaling must be a JSON object, e.g. {\"rope_type\": \"yarn\", \"factor\": 4}")
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor", 1.0)
    if kind not in ("linear", "llama3", "dynamic", "yarn") or not isinstance(factor, (int, float)) or factor < 1:
        raise ValueError(f"rope scaling needs rope_type linear, llama3, dynamic or yarn and a factor >= 1, got "
                         f"{scaling}")
    original = int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    merged = {**scaling, "rope_type": kind, "factor": float(factor), "original_max_position_embeddings": original}
    merged.pop("type", None)
    return dataclasses.replace(config, rope_scaling=merged, max_position_embeddings=original)  # then scaled_context
