"""DeepSeek V3 decoder (``deepseek_v3``: DeepSeek-V3 / R1 / V3.1 and models of the same architecture; and
``deepseek_v2``: V2 / V2-Lite, the same layers with softmax routing, ``MixtureOfExperts.scoring``) over a
paged latent KV cache: multi-head latent attention (``shared/model/mla_attention.py``) and DeepSeekMoE layers
after ``first_k_dense_replace`` dense ones (``shared/model/moe.py``).

Per layer: RMSNorm → MLA (queries through the ``q_lora_rank`` bottleneck and its norm, or one projection; the
latent ``c = norm(kv_a(x)[:r])`` and the shared RoPE key ``k_pe = rope(kv_a(x)[r:])`` cached; absorbed attention;
``W_UV``; ``o_proj``) → residual → RMSNorm → dense gated MLP or MoE → residual; final RMSNorm; LM head at the rows
asked for. The softmax scale is ``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when
the RoPE is YaRN-scaled (transformers' ``yarn_apply_mscale``); RoPE covers ``qk_rope_head_dim`` dims only.

Weights arrive in HF naming (``hf_loader``; per-expert ``mlp.experts.<e>.{gate,up,down}_proj``). Invariant: the
checkpoint's interleaved RoPE dims (``rope_interleave``, V3's default) are de-interleaved at load by permuting
the rows of ``q_b_proj`` (``q_proj``) and ``kv_a_proj_with_mqa`` that produce them, so the NeoX rotation
(``kernels.layer_ops.rope_``) computes exactly transformers' ``apply_rotary_pos_emb_interleave``. The model has
the interface ``LlamaModel`` offers the engine (``config``, ``dtype``, ``device``, ``embed``, ``weights_digest``,
``forward``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.layer_ops import add_rms_norm_, rms_norm, rope_
from shared.errors import DeepinferError, ErrorCode
from shared.model.attention import AttentionMetadata
from shared.model.config import LatentAttention, MixtureOfExperts, ModelConfig
from shared.model.fingerprint import weights_digest
from shared.model.kv_cache import layer_view
from shared.model.linear import linear, prepare_weight
from shared.model.mla_attention import attend_latent
from shared.model.moe import MoE, MoEWeights, gated_mlp
from shared.model.rope import build_rope_cache, yarn_mscale

HF_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


@dataclass(slots=True)
class MLALayer:
    input_norm: torch.Tensor  # [hidden]
    q_a: torch.Tensor | None  # [q_lora_rank, hidden] (None: no query bottleneck)
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor  # [H * (nope + rope), q_lora_rank or hidden]; RoPE rows de-interleaved
    kv_a: torch.Tensor  # [r + rope, hidden]; RoPE rows de-interleaved
    kv_a_norm: torch.Tensor  # [r]
    w_uk: torch.Tensor  # [H, nope, r]
    w_uv: torch.Tensor  # [H, v, r]
    o_proj: torch.Tensor  # [hidden, H * v]
    post_norm: torch.Tensor  # [hidden]
    mlp: MoE | tuple[torch.Tensor, torch.Tensor]  # MoE, or a dense (gate_up, down)


def deinterleave(rows: int) -> torch.Tensor:
    """Index putting interleaved pairs ``(x0, x1), (x2, x3), ...`` into halves ``(x0, x2, ...), (x1, x3, ...)``."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


def _layer_shapes(config: ModelConfig, p: str, moe_layer: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of one decoder layer under prefix ``p`` (``model.layers.<i>.``), with their shapes."""
    mla, moe, d, heads = config.mla, config.moe, config.hidden_size, config.num_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a = p + "self_attn."
    shapes = {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
              a + "kv_a_proj_with_mqa.weight": (mla.latent_dim, d), a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
              a + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
              a + "o_proj.weight": (d, heads * mla.v_head_dim)}
    if mla.q_lora_rank:
        shapes.update({a + "q_a_proj.weight": (mla.q_lora_rank, d), a + "q_a_layernorm.weight":
                       (mla.q_lora_rank,), a + "q_b_proj.weight": (heads * qk, mla.q_lora_rank)})
    else:
        shapes[a + "q_proj.weight"] = (heads * qk, d)
    if moe_layer:
        e, f, fs = moe.n_routed_experts, moe.moe_intermediate_size, moe.moe_intermediate_size * moe.n_shared_experts
        shapes[p + "mlp.gate.weight"] = (e, d)
        if moe.scoring == "sigmoid":
            shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
        shapes.update({p + f"mlp.shared_experts.{x}_proj.weight": (fs, d) for x in ("gate", "up")})
        shapes[p + "mlp.shared_experts.down_proj.weight"] = (d, fs)
        for k in range(e):
            shapes.update({p + f"mlp.experts.{k}.{x}_proj.weight": (f, d) for x in ("gate", "up")})
            shapes[p + f"mlp.experts.{k}.down_proj.weight"] = (d, f)
    else:
        shapes.update({p + f"mlp.{x}_proj.weight": (config.intermediate_size, d) for x in ("gate", "up")})
        shapes[p + "mlp.down_proj.weight"] = (d, config.intermediate_size)
    return shapes


def is_moe_layer(config: ModelConfig, index: int) -> bool:
    """Whether decoder layer ``index`` (MTP layers count on after the decoder's) is a DeepSeekMoE layer."""
    return config.moe is not None and index >= config.moe.first_k_dense_replace


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``deepseek_v3`` checkpoint must have, HF-named, with its shape (MTP layers:
    ``mtp_weight_shapes``)."""
    d = config.hidden_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        shapes.update(_layer_shapes(config, f"model.layers.{i}.", is_moe_layer(config, i)))
    return shapes


MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # an MTP layer's copies of the model's own


def mtp_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of the ``nextn_layers`` MTP modules (layers ``num_layers ..``), HF-named, with their shapes:
    ``enorm`` / ``hnorm`` (the token embedding's and the previous hidden state's norms), ``eh_proj`` (their
    concatenation to the hidden width), ``shared_head.norm``, and a decoder layer. Their ``embed_tokens`` and
    ``shared_head.head`` copies are not read: an MTP module shares the model's embedding and output head."""
    d = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_layers, config.num_layers + config.nextn_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "enorm.weight": (d,), p + "hnorm.weight": (d,), p + "eh_proj.weight": (d, 2 * d),
                       p + "shared_head.norm.weight": (d,)})
        shapes.update(_layer_shapes(config, p, is_moe_layer(config, i)))
    return shapes


def hf_knobs(raw: dict) -> dict:
    """``ModelConfig`` fields of a ``deepseek_v3`` ``config.json`` beyond the common ones."""
    heads = int(raw["num_attention_heads"])
    q_lora = raw.get("q_lora_rank")
    mla = LatentAttention(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(raw["kv_lora_rank"]),
                          qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                          v_head_dim=int(raw["v_head_dim"]), rope_interleave=bool(raw.get("rope_interleave", True)))
    moe = None
    v2 = raw.get("model_type") == "deepseek_v2"
    if raw.get("n_routed_experts"):
        moe = MixtureOfExperts(
            n_routed_experts=int(raw["n_routed_experts"]), n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0), n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=False if v2 else bool(raw.get("norm_topk_prob", True)),   # V2 never renormalises
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring="softmax" if v2 else "sigmoid",
            topk_method=str(raw.get("topk_method") or "greedy") if v2 else "noaux_tc")
    return {"mla": mla, "moe": moe, "num_kv_heads": heads, "head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            "nextn_layers": int(raw.get("num_nextn_predict_layers") or 0)}


class DeepseekV3Model:
    """Inference-only DeepSeek V3 decoder (see the module docstring). Not an nn.Module.

    ``weights`` may hold the checkpoint's MTP layers (``mtp_weight_shapes``): they are kept as given in
    ``nextn_weights`` for a drafter (``shared/model/mtp.py``), left out of ``weights_digest``, and never run here.
    ``lm_head``: an already prepared output head to share (an MTP module's is the model's), else the checkpoint's.
    ``keep_hidden``: when set, every ``forward`` leaves its last hidden states (the residual stream after the last
    layer, before the final norm, every row) in ``last_hidden: [T, hidden]`` (what an MTP drafter reads)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, lm_head: torch.Tensor | None = None) -> None:
        if config.mla is None:
            raise DeepinferError(ErrorCode.MODEL_CORRUPT, "a DeepSeek V3 config needs its MLA dimensions")
        self.config, self.dtype, self.device = config, dtype, device
        nextn = set(mtp_weight_shapes(config))
        self.nextn_weights = {name: t for name, t in weights.items() if name in nextn}
        self.weights_digest = weights_digest({n: t for n, t in weights.items() if n not in nextn})
        self.keep_hidden, self.last_hidden = False, None

        def take(name: str, wide: bool = False) -> torch.Tensor:
            if name not in weights:
                raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"checkpoint lacks tensor {name!r}")
            return weights[name].to(device=device, dtype=torch.float32 if wide else dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = lm_head if lm_head is not None else \
            prepare_weight(self.embed if config.tie_word_embeddings else take("lm_head.weight"))
        self.final_norm = take("model.norm.weight")
        self.layers = [self._build_layer(take, f"model.layers.{i}.", is_moe_layer(config, i))
                       for i in range(config.num_layers)]
        mla = config.mla
        self.cos, self.sin = build_rope_cache(config, dtype, device, dim=mla.qk_rope_head_dim)  # [P, rope] each
        self.scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2

    def _build_layer(self, take, p: str, moe_layer: bool) -> MLALayer:
        """The decoder layer stored under prefix ``p`` (``model.layers.<i>.``); ``take(name, wide)`` reads a tensor."""
        config, mla, moe = self.config, self.config.mla, self.config.moe
        heads, nope, rope_dim, rank = config.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        q_rows = torch.arange(heads * (nope + rope_dim)).view(heads, nope + rope_dim)
        kv_rows = torch.arange(rank + rope_dim)
        if mla.rope_interleave:  # de-interleave the rows that produce RoPE dims (module docstring)
            q_rows = torch.cat([q_rows[:, :nope], q_rows[:, nope:][:, deinterleave(rope_dim)]], dim=1)
            kv_rows = torch.cat([kv_rows[:rank], rank + deinterleave(rope_dim)])
        q_rows = q_rows.flatten()
        a = p + "self_attn."
        kv_b = take(a + "kv_b_proj.weight").view(heads, nope + mla.v_head_dim, rank)
        if moe_layer:
            experts = [f"{p}mlp.experts.{e}." for e in range(moe.n_routed_experts)]
            shared = p + "mlp.shared_experts."
            mlp = MoE(MoEWeights(
                gate=take(p + "mlp.gate.weight", wide=True),
                bias=take(p + "mlp.gate.e_score_correction_bias", wide=True) if moe.scoring == "sigmoid"
                else torch.zeros(moe.n_routed_experts, device=self.device),
                gate_up=torch.stack([torch.cat([take(e + "gate_proj.weight"), take(e + "up_proj.weight")])
                                     for e in experts]),
                down=torch.stack([take(e + "down_proj.weight") for e in experts]),
                shared_gate_up=prepare_weight(torch.cat([take(shared + "gate_proj.weight"),
                                                         take(shared + "up_proj.weight")])),
                shared_down=prepare_weight(take(shared + "down_proj.weight"))), moe)
        else:
            mlp = (prepare_weight(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                   prepare_weight(take(p + "mlp.down_proj.weight")))
        lora = bool(mla.q_lora_rank)
        return MLALayer(
            input_norm=take(p + "input_layernorm.weight"),
            q_a=prepare_weight(take(a + "q_a_proj.weight")) if lora else None,
            q_a_norm=take(a + "q_a_layernorm.weight") if lora else None,
            q_b=prepare_weight(take(a + ("q_b_proj.weight" if lora else "q_proj.weight"))[q_rows].contiguous()),
            kv_a=prepare_weight(take(a + "kv_a_proj_with_mqa.weight")[kv_rows].contiguous()),
            kv_a_norm=take(a + "kv_a_layernorm.weight"),
            w_uk=kv_b[:, :nope].contiguous(), w_uv=kv_b[:, nope:].contiguous(),
            o_proj=prepare_weight(take(a + "o_proj.weight")),
            post_norm=take(p + "post_attention_layernorm.weight"), mlp=mlp)

    def expert_counts(self) -> list[list[int]]:
        """Tokens each routed expert received in the last forward, per MoE layer (the EPLB signal)."""
        return [layer.mlp.expert_counts.tolist() for layer in self.layers if isinstance(layer.mlp, MoE)]

    def expert_load(self) -> dict[int, list[int]]:
        """Layer index -> tokens each of its routed experts received since load (``/metrics``)."""
        return {i: layer.mlp.expert_tokens.tolist() for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, MoE)}

    def _attention(self, x: torch.Tensor, layer: MLALayer, cos: torch.Tensor, sin: torch.Tensor, kv_cache,
                   meta, index: int) -> torch.Tensor:
        """``x: [T, hidden]`` (normed) → the attention output ``[T, hidden]`` (stores the batch's latents)."""
        c, mla, eps = self.config, self.config.mla, self.config.rms_norm_eps
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        q_in = x if layer.q_a is None else rms_norm(linear(x, layer.q_a), layer.q_a_norm, eps)
        q = linear(q_in, layer.q_b).view(-1, c.num_heads, nope + mla.qk_rope_head_dim)  # [T, H, nope + rope]
        kv = linear(x, layer.kv_a)  # [T, r + rope]
        latent = torch.empty_like(kv)  # [T, latent_dim]: [norm(c), rope(k_pe)]
        latent[:, :rank] = rms_norm(kv[:, :rank].contiguous(), layer.kv_a_norm, eps)
        latent[:, rank:] = rope_(kv[:, None, rank:].contiguous(), cos, sin)[:, 0]
        q_abs = torch.empty(q.shape[0], c.num_heads, mla.latent_dim, dtype=q.dtype, device=q.device)
        q_abs[..., :rank] = torch.einsum("thn,hnr->thr", q[..., :nope], layer.w_uk)
        q_abs[..., rank:] = rope_(q[..., nope:].contiguous(), cos, sin)
        k_cache, v_cache, layer_meta = layer_view(kv_cache, meta, index)
        o_lat = attend_latent(q_abs, latent, k_cache, v_cache, layer_meta, rank, self.scale)  # [T, H, r]
        o = torch.einsum("thr,hvr->thv", o_lat, layer.w_uv)  # [T, H, v]
        return linear(o.flatten(1), layer.o_proj)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T] int64 each
        meta: AttentionMetadata, kv_cache: torch.Tensor,  # [num_blocks, L, 2, 1, block_size, latent_dim / 2]
        logits_indices: torch.Tensor,  # [S] int64
        embeds: torch.Tensor | None = None,  # [T, hidden]: the first layer's input instead of the tokens' (MTP)
    ) -> torch.Tensor:  # [S, V]
        eps = self.config.rms_norm_eps
        h = F.embedding(input_ids, self.embed) if embeds is None else embeds  # [T, hidden]: the residual stream
        cos, sin = self.cos[positions], self.sin[positions]  # [T, rope] each
        delta = None
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps) if delta is None else add_rms_norm_(h, delta, layer.input_norm, eps)
            x = add_rms_norm_(h, self._attention(x, layer, cos, sin, kv_cache, meta, i), layer.post_norm, eps)
            delta = layer.mlp(x) if isinstance(layer.mlp, MoE) else gated_mlp(x, *layer.mlp)
        if self.keep_hidden:
            self.last_hidden = h + delta  # [T, hidden]
            h = self.last_hidden[logits_indices]
        else:
            h = h[logits_indices] + delta[logits_indices]
        return linear(rms_norm(h, self.final_norm, eps), self.lm_head)  # [S, V]
