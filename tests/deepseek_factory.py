"""Tiny random DeepSeek V3 checkpoints for tests: made by transformers' own ``DeepseekV3ForCausalLM`` (random
init, then the router bias and norms perturbed so routing and every norm matter), saved as an HF folder with the
tests' tiny byte-level tokenizer. 2 dense + 2 MoE layers, 8 routed experts in 2 groups, 1 shared expert, MLA with
a query bottleneck, YaRN RoPE (factor 4, mscale 1 / 1) on interleaved RoPE dims: every V3 feature the loader and
model implement."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.model_factory import BOS_ID, EOS_ID, tiny_hf_tokenizer

VOCAB = 300


def v3_config(**overrides: Any) -> dict[str, Any]:
    """The ``DeepseekV3Config`` keyword arguments of the tiny model."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
              qk_nope_head_dim=20, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=2,
              max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "beta_fast": 32, "beta_slow": 1})
    kw.update(overrides)
    return kw


def v2_config(**overrides: Any) -> dict[str, Any]:
    """The ``DeepseekV2Config`` keyword arguments of a tiny V2-Lite-shaped model: no query bottleneck, softmax
    routing limited to the best group (``group_limited_greedy``), no correction bias."""
    kw = v3_config(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    kw.pop("rope_parameters")
    kw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "beta_fast": 32, "beta_slow": 1}
    kw.update(overrides)
    return kw


def write_v3_folder(directory: str | Path, seed: int = 0, version: int = 3, mtp: bool = False,
                    **overrides: Any) -> Path:
    """Write the tiny V3 (``v3_config(**overrides)``; ``version=2``: the tiny V2, ``v2_config``) as
    ``config.json`` + ``model.safetensors`` + tokenizer. ``mtp``: with one random MTP layer (layer 4, MoE) as
    DeepSeek ships it (transformers has no MTP module: its tensors are added to the file, its embedding and
    head copies included, and ``num_nextn_predict_layers`` set)."""
    import transformers

    directory = Path(directory)
    torch.manual_seed(seed)
    if version == 2:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**v2_config(**overrides))).eval()
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**v3_config(**overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif p.dim() == 2:
                p.mul_(6.0)     # init std 0.02 -> 0.12: logits and routing scores that differ visibly
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(directory)
    if mtp:
        add_mtp_layer(directory, seed)
    tiny_hf_tokenizer(VOCAB).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False,
                                                                 "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def add_mtp_layer(directory: Path, seed: int) -> None:
    """Add one random MTP layer (``deepseek.mtp_weight_shapes``) to the folder's checkpoint and config."""
    from safetensors.torch import load_file, save_file

    from shared.model.deepseek import mtp_weight_shapes
    from shared.model.hf_loader import read_hf_config

    raw = json.loads((directory / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    config = read_hf_config(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, shape in mtp_weight_shapes(config).items():
        if len(shape) == 1:   # norms near 1 (perturbed), the router bias small
            base = 0.0 if name.endswith("e_score_correction_bias") else 1.0
            tensors[name] = base + torch.randn(shape, generator=gen) * (0.1 if base == 0 else 0.2)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * 0.12
    p = f"model.layers.{config.num_layers}."
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()   # DeepSeek's copies
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_v3_gguf(folder: Path, path: Path, split_kv_b: bool = True) -> Path:
    """Convert a tiny V3 / V2 HF folder to a ``deepseek2`` F32 GGUF the way llama.cpp's converter does (tensor names
    from the ``gguf`` package's own map; routed experts stacked; ``kv_b_proj`` split into ``attn_k_b``
    (transposed) and ``attn_v_b`` when ``split_kv_b``, else kept as ``attn_kv_b``; MLA key/value lengths; YaRN's
    ``mscale_all_dim`` as ``yarn_log_multiplier`` = 0.1 x it), with the tests' tokenizer."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from shared.model.hf_loader import read_hf_config
    from tests.model_factory import add_tiny_tokenizer, gguf_decoder_writer

    config = read_hf_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    mla, moe = config.mla, config.moe
    tensors = load_file(str(folder / "model.safetensors"))
    writer = gguf_decoder_writer(path, "deepseek2", config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(mla.qk_rope_head_dim)
    writer.add_vocab_size(config.vocab_size)
    if mla.q_lora_rank:
        writer.add_q_lora_rank(mla.q_lora_rank)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    writer.add_key_length(mla.kv_lora_rank + mla.qk_rope_head_dim)
    writer.add_value_length(mla.kv_lora_rank)
    writer.add_key_length_mla(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    writer.add_value_length_mla(mla.v_head_dim)
    writer.add_leading_dense_block_count(moe.first_k_dense_replace)
    writer.add_expert_feed_forward_length(moe.moe_intermediate_size)
    writer.add_expert_count(moe.n_routed_experts)
    writer.add_expert_used_count(moe.num_experts_per_tok)
    writer.add_expert_shared_count(moe.n_shared_experts)
    writer.add_expert_weights_scale(moe.routed_scaling_factor)
    writer.add_expert_weights_norm(moe.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if moe.scoring == "sigmoid"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(moe.n_group)
    writer.add_expert_group_used_count(moe.topk_group)
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_log_mul(0.1 * float(scaling["mscale_all_dim"]))
    add_tiny_tokenizer(writer, config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_layers)
    heads, nope, v, rank = config.num_heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        t = t.float()
        if ".mlp.experts." in name:   # stacked per projection below
            continue
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = t.view(heads, nope + v, rank)
            out[names.get_name(name.replace("kv_b_proj", "k_b_proj"), try_suffixes=(".weight",))] = \
                kv_b[:, :nope].transpose(1, 2).numpy()
            out[names.get_name(name.replace("kv_b_proj", "v_b_proj"), try_suffixes=(".weight",))] = \
                kv_b[:, nope:].numpy()
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")   # as llama.cpp renames it
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t.numpy()
    for i in range(moe.first_k_dense_replace, config.num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = torch.stack([tensors[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"].float()
                                   for e in range(moe.n_routed_experts)])
            out[names.get_name(f"model.layers.{i}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))] = \
                stacked.numpy()
    for name, array in out.items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def v4_config(**overrides: Any) -> dict[str, Any]:
    """The ``DeepseekV4Config`` keyword arguments of a tiny V4: one layer of each attention type and a second CSA
    (window 8, CSA groups of 4 with the indexer keeping 3, HCA groups of 16), one hash-routed MoE layer then
    top-k ones (8 experts, 2 per token), 2 residual streams, grouped output projection in 2 groups."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
              mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
              index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2, partial_rotary_factor=0.25,
              max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_id=EOS_ID, swiglu_limit=3.0)
    kw.update(overrides)
    return kw


def write_v4_folder(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny V4 (``v4_config(**overrides)``) made by transformers' ``DeepseekV4ForCausalLM``, its zero-
    initialised parts (sinks, group position biases, hyper-connection biases, the hash table) made random so every
    one matters, as ``config.json`` + ``model.safetensors`` + tokenizer."""
    import transformers

    directory = Path(directory)
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**v4_config(**overrides))
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith(("base", "hc_base")):
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith(("scale", "hc_scale")):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.mul_(4.0)     # init std 0.02 -> 0.08: scores and routing that differ visibly
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
            elif name.endswith("tid2eid"):   # each token's experts: distinct, random
                buf.copy_(torch.stack([torch.randperm(config.n_routed_experts)[:config.num_experts_per_tok]
                                       for _ in range(buf.shape[0])]))
    model.save_pretrained(directory)
    tiny_hf_tokenizer(VOCAB).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False,
                                                                 "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory
