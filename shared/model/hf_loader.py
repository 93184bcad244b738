"""Load a Hugging Face model folder (``config.json`` + ``*.safetensors``) into a ``ModelConfig`` and float32 tensors.

Invariants of ``load_hf_folder``'s result (the same contract as ``gguf_loader.load_gguf``):
- every tensor is a contiguous ``torch.float32`` CPU tensor under its HF name, values as stored (Gemma 3 norm
  weights stay zero-centred: the model scales by ``1 + w``);
- ``gemma3_text`` configs get their Gemma knobs, per-layer windows and both RoPE bases (shared/model/gemma3.py);
- a DeepSeek checkpoint's MTP layers are read when all their tensors are there (``config.nextn_layers`` as the
  config says), else left out with ``nextn_layers == 0``: they serve ``--drafter mtp`` only;
- ``lm_head.weight`` is absent exactly when ``config.tie_word_embeddings`` is true;
- a sharded checkpoint (``model.safetensors.index.json``) is read from every shard listed in the index;
- failures are ``DeepinferError``: ``MODEL_NOT_FOUND`` (no folder / no config.json), ``MODEL_CORRUPT``
  (bad JSON, unsupported ``model_type``, unreadable or missing tensors).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from shared.errors import DeepinferError, ErrorCode
from shared.model import deepseek, deepseek_v4, gemma3
from shared.model.config import ModelConfig

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", *deepseek.HF_MODEL_TYPES,
                         *deepseek_v4.HF_MODEL_TYPES)
Progress = Callable[[int, int], None]


def _corrupt(path: Path, problem: str) -> DeepinferError:
    return DeepinferError(ErrorCode.MODEL_CORRUPT, f"{path}: {problem}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _corrupt(path, f"unreadable JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise _corrupt(path, "expected a JSON object")
    return value


def read_hf_config(folder: str | Path) -> ModelConfig:
    """``ModelConfig`` from ``folder/config.json`` (+ ``generation_config.json``'s EOS list, if present)."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"{folder} has no config.json (not a Hugging Face model folder)")
    raw = _read_json(path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _corrupt(path, f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type == "gemma3_text":  # transformers omits fields left at Gemma3TextConfig's defaults
        raw = {**gemma3.HF_DEFAULTS, **raw}
    if model_type in deepseek_v4.HF_MODEL_TYPES:  # V4's only FFN width is its experts'
        raw = {"intermediate_size": raw.get("moe_intermediate_size"), **raw}
    try:
        hidden, heads, layers = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
        rope_params = raw.get("rope_parameters") or {}
        eos: list[int] = []
        generation = folder / "generation_config.json"
        for source in (raw, _read_json(generation) if generation.is_file() else {}):
            value = source.get("eos_token_id")
            for token in (value if isinstance(value, list) else [] if value is None else [value]):
                if int(token) not in eos:
                    eos.append(int(token))
        extra = gemma3.hf_knobs(raw) if model_type == "gemma3_text" else \
            deepseek.hf_knobs(raw) if model_type in deepseek.HF_MODEL_TYPES else \
            deepseek_v4.hf_knobs(raw) if model_type in deepseek_v4.HF_MODEL_TYPES else {}
        return ModelConfig(**{**dict(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers, num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope_params),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            layer_sliding_windows=_sliding_windows(raw, model_type, layers),
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            eos_token_ids=tuple(eos), architecture=model_type,
            model_id=str(raw.get("_name_or_path") or folder.name),
        ), **extra})
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(path, f"invalid or incomplete config ({type(exc).__name__}: {exc})") from exc


def _rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """HF ``rope_scaling`` (or v5 ``rope_parameters``) normalised to carry ``rope_type``; ``None`` for plain RoPE."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = out.pop("type", None)
    out["rope_type"] = out.get("rope_type", kind)
    if out["rope_type"] in (None, "default"):
        return None
    return out


def _sliding_windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer window following transformers: Mistral windows every layer; Qwen2/3 only when
    ``use_sliding_window`` and then layers ``>= max_window_layers`` (or those ``layer_types`` marks sliding)."""
    window = raw.get("sliding_window")
    if model_type == "mistral":
        return (int(window) if window else None,) * layers
    if model_type in ("qwen2", "qwen3"):
        window = window if raw.get("use_sliding_window", False) else None
        types = raw.get("layer_types") or [
            "sliding_attention" if window is not None and i >= int(raw.get("max_window_layers", layers))
            else "full_attention" for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        return tuple(int(window) if window and t == "sliding_attention" else None for t in types)
    return (None,) * layers


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every tensor name the model needs, in HF convention."""
    if config.mla is not None:
        return list(deepseek.hf_weight_shapes(config))
    if config.v4 is not None:
        return list(deepseek_v4.hf_weight_shapes(config))
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  *(p + f"self_attn.{x}_proj.weight" for x in "qkvo"),
                  *(p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if config.architecture == "qwen3":
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.architecture == "gemma3_text":
            names += [p + name for name in gemma3.HF_EXTRA_LAYER_TENSORS]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def load_hf_folder(path: str | Path, *, progress: Progress | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read ``config.json`` and all safetensors shards of a HF LLaMA/Mistral/Qwen2/Qwen3 folder."""
    started = time.perf_counter()
    folder = Path(path)
    if not folder.is_dir():
        raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"model folder {folder} does not exist")
    config = read_hf_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _corrupt(index, "has no weight_map")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise _corrupt(folder, "no *.safetensors weights found")
    optional = deepseek.mtp_weight_shapes(config) if config.mla is not None else {}  # MTP layers: for drafting
    wanted = set(expected_weight_names(config)) | set(optional)
    weights: dict[str, torch.Tensor] = {}
    for done, shard in enumerate(shards, start=1):
        shard_path = folder / shard
        if not shard_path.is_file():
            raise _corrupt(shard_path, "shard listed in model.safetensors.index.json is missing")
        try:
            loaded = load_file(str(shard_path), device="cpu")
        except Exception as exc:  # safetensors raises SafetensorError / OSError / ValueError
            raise _corrupt(shard_path, f"unreadable safetensors file ({exc})") from exc
        for name, tensor in loaded.items():
            if name in wanted:
                weights[name] = tensor.to(torch.float32).contiguous()
            elif not name.endswith(("rotary_emb.inv_freq", *deepseek.MTP_SHARED_COPIES)):
                log.warning("%s: ignoring unexpected tensor %s", shard_path, name)
        if progress is not None:
            progress(done, len(shards))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing = [n for n in expected_weight_names(config) if n not in weights]
    if missing:
        raise _corrupt(folder, f"missing tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    absent = [n for n in optional if n not in weights]
    if absent:   # a checkpoint without (all of) its MTP layers still serves; only ``--drafter mtp`` needs them
        if len(absent) < len(optional):
            log.warning("%s: MTP layers incomplete (no %s); not loaded", folder, absent[0])
        for name in optional:
            weights.pop(name, None)
        config = dataclasses.replace(config, nextn_layers=0)
    shapes = {**deepseek.hf_weight_shapes(config), **optional} if config.mla is not None else \
        deepseek_v4.hf_weight_shapes(config) if config.v4 is not None else None
    for name, tensor in weights.items():
        _check_shape(folder, config, name, tensor, shapes)
    log.info("loaded %s (%s, %d tensors) in %.1fs", folder, config.architecture, len(weights),
             time.perf_counter() - started)
    return config, weights


def _check_shape(folder: Path, c: ModelConfig, name: str, tensor: torch.Tensor,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    if shapes is not None:   # an architecture that lists its own (DeepSeek V3)
        expected = shapes[name]
        if tuple(tensor.shape) != expected:
            raise _corrupt(folder, f"tensor {name} has shape {tuple(tensor.shape)}, expected {expected}")
        return
    leaf = name.split(".")[-2]  # "q_proj" in "model.layers.0.self_attn.q_proj.weight"
    expected = {"embed_tokens": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size),
                "q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
                "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
                "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
                "down_proj": (c.hidden_size, c.intermediate_size), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
                }.get(leaf, (c.hidden_size,))  # the rest are RMSNorm weights
    if name.endswith(".bias"):
        expected = expected[:1]
    if tuple(tensor.shape) != expected:
        raise _corrupt(folder, f"tensor {name} has shape {tuple(tensor.shape)}, expected {expected}")
