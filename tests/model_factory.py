"""Tiny random checkpoints for tests: no download, fixed seeds, both formats from the same weights.

Invariants:
- ``random_weights(config, seed)`` is a pure function of its arguments; every value is exactly representable in
  the requested dtype, so an HF folder saved in that dtype and a GGUF saved in F32 load to identical float32;
- ``write_tiny_hf_folder`` and ``write_tiny_gguf`` called with the same keyword arguments describe the same model
  (same weights, same config, same tokenizer ids); the GGUF stores Q/K rows in llama.cpp's permuted order for
  architecture ``llama``, so a correct loader must undo it;
- the tiny tokenizer is byte-level BPE: ids 0-2 are ``<|endoftext|>``, ``<|im_start|>`` (BOS) and ``<|im_end|>``
  (EOS), then the 256 byte symbols, then one token per merge, then ``<|reserved_N|>`` padding up to ``vocab``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import tokenizers
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from shared.model.chat_template import CHATML_TEMPLATE
from shared.model.config import ModelConfig
from shared.model.gguf_loader import permute_qk
from shared.model.hf_loader import expected_weight_names
from shared.model.tokenizer import bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
          ("r", "e"), ("a", "t"), ("Ġ", "w"), ("o", "r"), ("Ġ", "i"), ("i", "s"), ("e", "n"), ("Ġ", "h"),
          ("l", "l"), ("Ġ", "c"), ("Ġ", "o"), ("e", "s"), ("Ġh", "e"), ("Ġ", "f"), ("a", "n"), ("Ġi", "s"),
          ("in", "g"), ("Ġ", "1"), ("Ċ", "Ċ"), ("Ġ", "Ġ")]
_ARCH_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
NATURAL_VOCAB = len(SPECIALS) + 256 + len(MERGES)


def tiny_vocab(vocab: int | None = None) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """``(tokens in id order, llama.cpp token types, merges)`` of the tiny tokenizer padded to ``vocab``."""
    vocab = NATURAL_VOCAB if vocab is None else vocab
    if vocab < len(SPECIALS) + 256:
        raise ValueError(f"vocab must be >= {len(SPECIALS) + 256} (specials + 256 bytes)")
    merges = MERGES[:vocab - len(SPECIALS) - 256]
    tokens = SPECIALS + [bytes_to_unicode()[b] for b in range(256)] + [a + b for a, b in merges]
    types = [3] * len(SPECIALS) + [1] * (256 + len(merges))
    padding = [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
    return tokens + padding, types + [3] * len(padding), merges


def random_model_config(*, arch: str = "llama", num_layers: int = 2, hidden: int = 64, heads: int = 4,
                        kv_heads: int = 2, ffn: int = 128, vocab: int | None = None, tie: bool = False,
                        rope_scaling: dict[str, Any] | None = None, sliding_window: int | None = None,
                        head_dim: int | None = None, rope_theta: float = 10000.0,
                        max_position_embeddings: int = 512) -> ModelConfig:
    """The ``ModelConfig`` the loaders must produce for a tiny checkpoint written with the same arguments."""
    return ModelConfig(
        vocab_size=NATURAL_VOCAB if vocab is None else vocab, hidden_size=hidden, intermediate_size=ffn,
        num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
        rms_norm_eps=1e-5, rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie,
        attention_bias=arch == "qwen2", layer_sliding_windows=(sliding_window,) * num_layers,
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), architecture=arch, model_id=f"tiny-{arch}")


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights (values rounded through ``dtype``); norms near 1, matrices ~ N(0, 1/in)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    shapes = {"q_proj": (config.q_size, config.hidden_size), "k_proj": (config.kv_size, config.hidden_size),
              "v_proj": (config.kv_size, config.hidden_size), "o_proj": (config.hidden_size, config.q_size),
              "gate_proj": (config.intermediate_size, config.hidden_size),
              "up_proj": (config.intermediate_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.intermediate_size),
              "embed_tokens": (config.vocab_size, config.hidden_size),
              "lm_head": (config.vocab_size, config.hidden_size), "q_norm": (config.head_dim,),
              "k_norm": (config.head_dim,)}
    for name in expected_weight_names(config):
        leaf = name.split(".")[-2]
        shape = shapes.get(leaf, (config.hidden_size,))
        if name.endswith(".bias"):
            value = 0.1 * torch.randn(shape[0], generator=gen)
        elif len(shape) == 1:  # RMSNorm weights
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        out[name] = value.to(dtype).to(torch.float32)
    return out


def tiny_hf_tokenizer(vocab: int | None = None) -> tokenizers.Tokenizer:
    """The tiny tokenizer as a ``tokenizers.Tokenizer`` (what ``tokenizer.json`` holds)."""
    tokens, types, merges = tiny_vocab(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                          fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    return tok


def write_tiny_hf_folder(directory: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                         **kwargs: Any) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

    ``kwargs`` are those of ``random_model_config`` (arch, num_layers, hidden, heads, kv_heads, ffn, vocab, tie,
    rope_scaling, sliding_window, head_dim, rope_theta, max_position_embeddings)."""
    config = random_model_config(**kwargs)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed, dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    window = config.layer_sliding_windows[0]
    raw: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[config.architecture]], "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "hidden_act": "silu", "torch_dtype": str(dtype).removeprefix("torch."),
        "sliding_window": window, "use_sliding_window": window is not None, "max_window_layers": 0,
    }
    if config.architecture == "llama":
        raw.update(attention_bias=False, mlp_bias=False)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    tiny_hf_tokenizer(config.vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[BOS_ID], "eos_token": SPECIALS[EOS_ID], "chat_template": CHATML_TEMPLATE,
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return directory


def gguf_decoder_writer(path, arch: str, config) -> gguf.GGUFWriter:
    """A ``GGUFWriter`` for an F32 decoder with ``config``'s name and shape keys written (layers, context,
    hidden, FFN, query and KV heads); the caller adds the architecture's own keys, tokenizer and tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.model_id)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    return writer


def add_tiny_tokenizer(writer: gguf.GGUFWriter, vocab: int, pre: str = "gpt2") -> None:
    """The tiny tokenizer padded to ``vocab`` as GGUF ``tokenizer.ggml.*`` metadata (BPE, ChatML template)."""
    tokens, types, merges = tiny_vocab(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tiny_gguf(path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, pre: str = "gpt2",
                    gguf_arch: str | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                    **kwargs: Any) -> Path:
    """Write the same model as ``write_tiny_hf_folder(**kwargs)`` as an F32 GGUF with tokenizer metadata.

    ``arch`` may be ``llama`` (Q/K rows permuted like llama.cpp) or ``qwen2`` (no permutation, q/k/v biases).
    ``gguf_arch`` overrides the architecture string written to the file (to build unsupported-arch files);
    ``extra_tensors`` are written as well (e.g. llama.cpp's ``rope_freqs.weight``)."""
    config = random_model_config(**kwargs)
    if config.architecture not in ("llama", "qwen2"):
        raise ValueError("write_tiny_gguf writes llama or qwen2 layouts only")
    arch = gguf_arch or config.architecture
    weights = random_weights(config, seed, dtype)
    writer = gguf_decoder_writer(path, arch, config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim != config.hidden_size // config.num_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    if config.layer_sliding_windows[0] is not None:
        writer.add_sliding_window(config.layer_sliding_windows[0])
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling.get("rope_type", scaling.get("type"))))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    add_tiny_tokenizer(writer, config.vocab_size, pre)
    for name, tensor in _gguf_tensors(config, weights, permute=arch == "llama"):
        writer.add_tensor(name, tensor)
    for name, tensor in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _gguf_tensors(config: ModelConfig, weights: dict[str, torch.Tensor], *, permute: bool):
    """(GGUF name, numpy float32 array in numpy order) for every weight, Q/K permuted like llama.cpp if asked."""
    hf_to_gguf = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q",
                  "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
                  "up_proj": "ffn_up", "down_proj": "ffn_down", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    for name, tensor in weights.items():
        array = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", array
        elif name == "model.norm.weight":
            yield "output_norm.weight", array
        elif name == "lm_head.weight":
            yield "output.weight", array
        else:
            parts = name.split(".")  # model.layers.{i}.{self_attn|mlp|norm}[.{proj}].{weight|bias}
            layer, leaf, kind = parts[2], parts[-2], parts[-1]
            if permute and leaf == "q_proj":
                array = permute_qk(array, config.num_heads)
            elif permute and leaf == "k_proj":
                array = permute_qk(array, config.num_kv_heads)
            yield f"blk.{layer}.{hf_to_gguf[leaf]}.{kind}", np.ascontiguousarray(array)
