"""DeepSeek V2 / V3 GGUF files (llama.cpp's ``deepseek2`` architecture) → the ``ModelConfig`` and HF-named
float32 tensors ``DeepseekV3Model`` loads (the contract of ``gguf_loader.load_gguf``).

What llama.cpp's converter does to a DeepSeek checkpoint, undone here:
- names: ``blk.<i>.attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b`` (or ``attn_q`` without a query bottleneck),
  ``attn_kv_a_mqa``, ``attn_kv_a_norm``, ``attn_output``, ``attn_norm``, ``ffn_norm``, ``ffn_gate_inp`` (router),
  ``exp_probs_b.bias`` (V3's correction bias), ``ffn_{gate,up,down}_shexp`` (shared experts), ``ffn_{gate,up,
  down}`` (dense layers);
- routed experts stacked: ``ffn_{gate,up,down}_exps`` hold ``[E, out, in]``; split back into ``experts.<e>``;
- ``kv_b_proj`` split (newer files) into ``attn_k_b: [H, kv_lora_rank, nope]`` (transposed) and ``attn_v_b:
  [H, v, kv_lora_rank]``; joined back to ``[H * (nope + v), kv_lora_rank]``; older files carry ``attn_kv_b`` as is;
- RoPE dims stay interleaved (llama.cpp rotates adjacent pairs for this architecture, as the checkpoint does):
  ``rope_interleave`` is set and ``DeepseekV3Model`` de-interleaves at load like any HF V3 folder;
- routing from metadata: ``expert_gating_func`` 2 (sigmoid) is V3's (``noaux_tc`` within ``expert_group_count`` /
  ``expert_group_used_count`` groups, ``expert_weights_norm``), 1 (softmax) is V2's (``greedy``, or
  ``group_limited_greedy`` with groups); ``expert_weights_scale`` is ``routed_scaling_factor``;
- YaRN: ``rope.scaling.yarn_log_multiplier`` is 0.1 x ``mscale_all_dim`` (llama.cpp assumes ``mscale`` equal).
The files hold no MTP layers (the converter drops them). Checked against transformers on a tiny checkpoint
converted by these rules (``tests/model/test_deepseek_gguf.py``); no llama.cpp-made file can be fetched here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from shared.model.config import LatentAttention, MixtureOfExperts, ModelConfig
from shared.model.deepseek import hf_weight_shapes, is_moe_layer
from shared.model.gguf_loader import corrupt, f32_metadata, metadata, read_tensor, rope_scaling_metadata

ARCH = "deepseek2"
_SIGMOID = 2

# GGUF suffix (after "blk.<i>.") -> HF suffix (after "model.layers.<i>.")
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
          "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
          "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
          "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
          "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}


def read_config(path: str | Path, reader: GGUFReader, tensors: dict[str, Any]) -> ModelConfig:
    """The ``deepseek_v3`` / ``deepseek_v2``-equivalent config of a ``deepseek2`` GGUF."""
    def need(key: str) -> Any:
        value = metadata(reader, f"{ARCH}.{key}")
        if value is None:
            raise corrupt(path, f"missing metadata key {ARCH}.{key}")
        return value

    def opt(key: str, default: Any = None) -> Any:
        return metadata(reader, f"{ARCH}.{key}", default)

    if "token_embd.weight" not in tensors:
        raise corrupt(path, "missing tensor token_embd.weight")
    heads, rank, rope = int(need("attention.head_count")), int(need("attention.kv_lora_rank")), \
        int(need("rope.dimension_count"))
    if opt("attention.key_length_mla") is not None:   # newer files: key/value lengths of the latent form
        qk, v = int(need("attention.key_length_mla")), int(need("attention.value_length_mla"))
    else:
        qk, v = int(need("attention.key_length")), int(need("attention.value_length"))
    q_lora = opt("attention.q_lora_rank")
    mla = LatentAttention(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=rank, qk_nope_head_dim=qk - rope,
                          qk_rope_head_dim=rope, v_head_dim=v, rope_interleave=True)
    moe = None
    if opt("expert_count"):
        sigmoid = int(opt("expert_gating_func", 1)) == _SIGMOID
        groups = int(opt("expert_group_count") or 1)
        moe = MixtureOfExperts(
            n_routed_experts=int(need("expert_count")), n_shared_experts=int(opt("expert_shared_count") or 0),
            num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=int(need("expert_feed_forward_length")),
            first_k_dense_replace=int(opt("leading_dense_block_count") or 0), n_group=groups,
            topk_group=int(opt("expert_group_used_count") or 1), norm_topk_prob=bool(opt("expert_weights_norm", False)),
            routed_scaling_factor=f32_metadata(opt("expert_weights_scale", 1.0)),
            scoring="sigmoid" if sigmoid else "softmax",
            topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy")
    scaling = rope_scaling_metadata(reader, ARCH, tensors)
    log_mul = opt("rope.scaling.yarn_log_multiplier")
    if scaling is not None and scaling.get("rope_type") == "yarn" and log_mul:
        scaling["mscale"] = scaling["mscale_all_dim"] = f32_metadata(float(log_mul) / 0.1)
    eos = [int(x) for x in (metadata(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id"))
           if x is not None]
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    num_layers = int(need("block_count"))
    try:
        return ModelConfig(
            vocab_size=int(tensors["token_embd.weight"].shape[-1]), hidden_size=int(need("embedding_length")),
            intermediate_size=int(need("feed_forward_length")), num_layers=num_layers, num_heads=heads,
            num_kv_heads=heads, head_dim=qk, rms_norm_eps=f32_metadata(opt("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=f32_metadata(opt("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_position_embeddings=int(opt("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors, layer_sliding_windows=(None,) * num_layers,
            bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(dict.fromkeys(eos)),
            architecture="deepseek_v3" if moe is None or moe.scoring == "sigmoid" else "deepseek_v2",
            model_id=str(metadata(reader, "general.name") or Path(path).stem), mla=mla, moe=moe)
    except (ValueError, TypeError) as exc:
        raise corrupt(path, f"inconsistent model metadata: {exc}") from exc


def load(path: str | Path, reader: GGUFReader, progress=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named float32 weights of a ``deepseek2`` GGUF (module docstring)."""
    tensors = {t.name: t for t in reader.tensors}
    config = read_config(path, reader, tensors)
    shapes = hf_weight_shapes(config)
    mla, moe, heads = config.mla, config.moe, config.num_heads
    weights: dict[str, torch.Tensor] = {}

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise corrupt(path, f"missing tensor {name} for architecture {ARCH!r}")
        return read_tensor(path, tensors[name], shape)

    def put(hf_name: str, array: np.ndarray) -> None:
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(array))

    put("model.embed_tokens.weight", take("token_embd.weight", shapes["model.embed_tokens.weight"]))
    put("model.norm.weight", take("output_norm.weight", shapes["model.norm.weight"]))
    if not config.tie_word_embeddings:
        put("lm_head.weight", take("output.weight", shapes["lm_head.weight"]))
    for i in range(config.num_layers):
        g, p = f"blk.{i}.", f"model.layers.{i}."
        for gguf_suffix, hf_suffix in _LAYER.items():
            if p + hf_suffix in shapes:
                put(p + hf_suffix, take(g + gguf_suffix, shapes[p + hf_suffix]))
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        if g + "attn_kv_b.weight" in tensors:
            kv_b = take(g + "attn_kv_b.weight", shapes[p + "self_attn.kv_b_proj.weight"])
        else:
            k_b = take(g + "attn_k_b.weight", (heads, rank, nope)).transpose(0, 2, 1)  # [H, nope, r]
            v_b = take(g + "attn_v_b.weight", (heads, mla.v_head_dim, rank))  # [H, v, r]
            kv_b = np.concatenate([k_b, v_b], axis=1).reshape(-1, rank)
        put(p + "self_attn.kv_b_proj.weight", kv_b)
        if is_moe_layer(config, i):
            e, f, d = moe.n_routed_experts, moe.moe_intermediate_size, config.hidden_size
            for gguf_suffix, proj in _EXPERTS.items():
                stacked = take(g + gguf_suffix, (e, d, f) if proj == "down_proj" else (e, f, d))
                for k in range(e):
                    put(f"{p}mlp.experts.{k}.{proj}.weight", stacked[k])
        if progress is not None:
            progress(i + 1, config.num_layers)
    return config, weights
