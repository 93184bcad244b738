"""Tiny random LLaMA-family models built in memory for exactness tests (no files, no download)."""
from __future__ import annotations

import torch

from shared.model import kv_cache
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.model.config import ModelConfig
from shared.model.llama import LlamaModel


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=10000.0,
                eos_token_ids=(), model_id="tiny-random")
    base.update(overrides)
    return ModelConfig(**base)


def random_weights(config: ModelConfig, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """HF-named random weights; std 0.5/sqrt(fan_in) keeps logits well spread so argmax is stable."""
    g = torch.Generator().manual_seed(seed)

    def mat(out_dim: int, in_dim: int) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=g, dtype=dtype) * (1.0 / in_dim ** 0.5)

    c = config
    w = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g, dtype=dtype),
         "model.norm.weight": 1 + 0.1 * torch.randn(c.hidden_size, generator=g, dtype=dtype)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(c.q_size, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = mat(c.kv_size, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = mat(c.kv_size, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(c.hidden_size, c.q_size)
        if c.attention_bias:
            for n, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                w[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(size, generator=g, dtype=dtype)
        w[p + "mlp.gate_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(c.hidden_size, c.intermediate_size)
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(c.hidden_size, generator=g, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(c.hidden_size, generator=g, dtype=dtype)
    return w


def tiny_model(seed: int = 0, dtype=torch.float64, **overrides) -> LlamaModel:
    config = tiny_config(**overrides)
    return LlamaModel(config, random_weights(config, seed, dtype), dtype, torch.device("cpu"))


def all_logits(model: LlamaModel, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits ``[T, V]`` at every position of ``ids``, computed through the paged path in one chunk."""
    c, n = model.config, len(ids)
    num_blocks = -(-n // block_size)
    kv = kv_cache.allocate(num_blocks, c, block_size, model.dtype, model.device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32),
                             prefills=[PrefillChunk(0, n, n, torch.arange(num_blocks))], block_size=block_size)
    return model.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.arange(n))
