"""Tiny random Gemma 3 checkpoints for tests: no download, fixed seeds, a GGUF (llama.cpp's layout, SentencePiece
vocabulary) and an HF folder (``config.json`` + safetensors) from the same weights.

Invariants:
- ``gemma_weights(config, seed)`` is a pure function of its arguments, HF-named and HF-valued (norm weights
  zero-centred: the model scales by ``1 + w``); every value is a bfloat16 number, so ``1 + w`` is exact in float32
  and a GGUF that stores ``1 + w`` (as llama.cpp does) loads back to exactly ``w``;
- the tiny vocabulary is laid out like Gemma's: control tokens, user-defined ones (newline runs, space runs
  stored with real spaces, an HTML tag), the 256 byte pieces, merged pieces in score order, then single
  characters; ``add_space_prefix`` is false and ``add_bos_token`` true, as in Gemma's files.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from shared.model import gemma3
from shared.model.config import ModelConfig
from shared.model.hf_loader import expected_weight_names
from shared.model.tokenizer_spm import sentencepiece_bpe
from tests.model_factory import gguf_decoder_writer

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "\n\n", "\n\n\n", "  ", "   ", "\t", "<b>"]
MERGED = ["▁t", "he", "▁the", "in", "▁a", "er", "on", "▁s", "re", "at", "▁w", "or", "is", "en", "▁h", "ll", "▁c",
          "es", "an", "▁is", "ing", "▁o", "▁f", "▁wor", "ld", "▁world", "▁he", "llo", "▁hello", "日本"]
CHARS = ["▁", "e", "t", "h", "a", "o", "n", "i", "s", "r", "l", "d", "w", "c", "f", "g", "é", "日", "本", "."]
BOS_ID, EOS_ID, EOT_ID = 2, 1, 6


def tiny_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, llama.cpp token types)`` in id order."""
    tokens = CONTROL + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)] + MERGED + CHARS
    types = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * (len(MERGED) + len(CHARS))
    scores = [-1000.0] * (len(CONTROL) + len(USER_DEFINED)) + [0.0] * 256 + \
        [-float(i) for i in range(len(MERGED) + len(CHARS))]
    return tokens, scores, types


VOCAB = len(tiny_spm_vocab()[0])


def gemma_config(*, num_layers: int = 7, hidden: int = 64, heads: int = 2, kv_heads: int = 1, head_dim: int = 256,
                 ffn: int = 128, window: int | None = 8, rope_theta: float = 1_000_000.0,
                 local_theta: float = 10_000.0, query_pre_attn_scalar: float | None = None,
                 rope_scaling: dict[str, Any] | None = None, max_position_embeddings: int = 512) -> ModelConfig:
    """The ``ModelConfig`` the loaders must produce for a tiny Gemma 3 written with the same arguments."""
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_layers=num_layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        layer_sliding_windows=gemma3.layer_windows(window, num_layers), bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID, EOT_ID), architecture="gemma3", model_id="tiny-gemma3",
        query_pre_attn_scalar=float(query_pre_attn_scalar or head_dim), rope_local_theta=local_theta,
        **gemma3.common_knobs(hidden))


def gemma_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic weights in ``dtype`` (values are bfloat16 numbers); norms ~ 0.3 N(0, 1), matrices ~ N(0, 1/in)."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    shapes = {"q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
              "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
              "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size), "embed_tokens": (c.vocab_size, c.hidden_size),
              "q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    out = {}
    for name in expected_weight_names(dataclasses.replace(config, architecture="gemma3_text")):  # hf_loader's names
        shape = shapes.get(name.split(".")[-2], (c.hidden_size,))
        if len(shape) == 1:  # RMSNorm weights, zero-centred
            value = 0.3 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":  # scaled up by sqrt(hidden) in the model
            value = torch.randn(shape, generator=gen) / c.hidden_size ** 0.5
        else:
            value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        out[name] = value.to(torch.bfloat16).to(dtype)
    return out


def write_gemma_gguf(path: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor], *,
                     window: int | None = 8, pattern: int | list[bool] | None = None,
                     extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """An F32 ``gemma3`` GGUF as llama.cpp writes one: norms stored as ``1 + w``, SentencePiece tokenizer,
    no chat template; ``pattern`` writes ``attention.sliding_window_pattern``; ``extra(writer)`` adds metadata."""
    writer = gguf_decoder_writer(path, "gemma3", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if window:
        writer.add_sliding_window(window)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    tokens, scores, types = tiny_spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if extra is not None:
        extra(writer)
    names = {v: k for k, v in gemma3.GGUF_LAYER_NAMES.items()} | {
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight"}
    for name, tensor in weights.items():
        array = tensor.to(torch.float32).numpy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp's converter stores 1 + w
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, leaf = name.split(".", 3)[2:]
            gguf_name = f"blk.{layer}.{names[leaf]}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_gemma_hf_folder(directory: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor], *,
                          rope_layout: str = "v4") -> Path:
    """``config.json`` (``gemma3_text``; RoPE as transformers 4.x keys or 5.x ``rope_parameters``), safetensors,
    and ``tokenizer.json`` + ``tokenizer_config.json`` of the tiny vocabulary."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    windows = config.layer_sliding_windows
    raw: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": True,
        "query_pre_attn_scalar": int(config.query_pre_attn_scalar), "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": next((w for w in windows if w), None),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windows],
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "pad_token_id": 0,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "torch_dtype": "float32"}
    if rope_layout == "v4":
        raw.update(rope_theta=config.rope_theta, rope_local_base_freq=config.rope_local_theta,
                   rope_scaling=config.rope_scaling)
    else:
        full = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
        raw["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta}}
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    tokens, scores, types = tiny_spm_vocab()
    sentencepiece_bpe(tokens, scores, types, unk_token="<unk>").save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "chat_template": gemma3.CHAT_TEMPLATE, "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return directory


def write_service_gguf(directory: str | Path, seed: int = 11) -> Path:
    """The tiny Gemma 3 the service tests serve: 7 layers, window 8 on five of every six, 4 query / 2 KV heads of
    16 dims, as ``directory/tiny-gemma3.gguf``."""
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, window=8, num_layers=7)
    return write_gemma_gguf(Path(directory) / "tiny-gemma3.gguf", config, gemma_weights(config, seed=seed), window=8)
