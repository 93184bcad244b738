"""Load a llama.cpp GGUF checkpoint into a ``ModelConfig`` and float32 tensors named like Hugging Face LLaMA.

Invariants of ``load_gguf``'s result:
- every tensor is a contiguous, writable ``torch.float32`` CPU tensor shaped ``(out_features, in_features)``
  (GGUF lists dimensions fastest-first, i.e. reversed with respect to numpy/torch; that is undone here);
- names follow HF's LLaMA convention (``model.layers.{i}.self_attn.q_proj.weight`` ...); ``lm_head.weight``
  is absent exactly when ``config.tie_word_embeddings`` is true (the GGUF has no ``output.weight``);
- for architecture ``llama`` the Q/K rows are in HF order: llama.cpp's converter permutes them for its
  interleaved RoPE and this module applies the inverse. ``qwen2``/``qwen3``/``gemma3`` are stored unpermuted;
- ``gemma3`` norm weights are in HF's convention (scale = 1 + w): llama.cpp stores ``1 + w`` and 1 is subtracted
  here, as transformers' GGUF loader does (shared/model/gemma3.py lists the Gemma facts);
- any failure is a ``DeepinferError``: ``MODEL_NOT_FOUND`` for a missing path, ``MODEL_CORRUPT`` (naming the
  file and the problem) for unreadable, truncated, unsupported or incomplete files.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from shared.errors import DeepinferError, ErrorCode
from shared.model import gemma3
from shared.model.config import ModelConfig

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
Progress = Callable[[int, int], None]

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",  # qwen3
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_REQUIRED_LAYER = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                   "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


class _FastGGUFReader(GGUFReader):
    """``GGUFReader`` over a plain ``ndarray`` view of the file's memory map.

    ``np.memmap`` subclass hooks run on every slice the reader takes (~1M for a 49k-token vocabulary);
    viewing the map as a base ``ndarray`` keeps the mapping alive (via ``.base``) but is ~3x faster to parse.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data" and isinstance(value, np.memmap):
            value = value.view(np.ndarray)
        super().__setattr__(name, value)


def corrupt(path: str | Path, problem: str) -> DeepinferError:
    return DeepinferError(ErrorCode.MODEL_CORRUPT, f"{path}: {problem}")


def open_gguf(path: str | Path) -> GGUFReader:
    """Parse a GGUF file's header (metadata + tensor table) without reading tensor data."""
    path = Path(path)
    if not path.exists():
        raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"model file {path} does not exist")
    if not path.is_file():
        raise corrupt(path, "is not a regular file (expected a .gguf file)")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise corrupt(path, f"cannot be read ({exc})") from exc
    if magic != b"GGUF":
        raise corrupt(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _FastGGUFReader(path)
    except Exception as exc:  # the gguf package raises ValueError/IndexError/struct errors alike
        raise corrupt(path, f"truncated or corrupt GGUF file ({path.stat().st_size} bytes): "
                            f"{type(exc).__name__}: {exc}") from exc


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool or list), or ``default`` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def load_gguf(path: str | Path, *, progress: Progress | None = None,
              reader: GGUFReader | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and dequantized float32 weights from a GGUF file (see module docstring for invariants).

    ``progress(done, total)`` is called after each tensor. ``reader`` may be passed to reuse a header that
    was already parsed with ``open_gguf`` (e.g. for building the tokenizer from the same file).
    """
    started = time.perf_counter()
    reader = reader if reader is not None else open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    config = _read_config(path, reader, tensors)
    expected = _expected_tensors(config, tensors)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise corrupt(path, f"missing tensor(s) {', '.join(missing[:5])}"
                            f"{' ...' if len(missing) > 5 else ''} for architecture {config.architecture!r}")
    ignored = sorted(set(tensors) - set(expected) - {"rope_freqs.weight"})
    if ignored:
        log.warning("%s: ignoring %d unexpected tensor(s): %s", path, len(ignored), ", ".join(ignored[:5]))

    weights: dict[str, torch.Tensor] = {}
    total = len(expected)
    for done, (gguf_name, (hf_name, shape)) in enumerate(expected.items(), start=1):
        array = read_tensor(path, tensors[gguf_name], shape)
        if config.architecture == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            array = unpermute_qk(array, config.num_heads)
        elif config.architecture == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            array = unpermute_qk(array, config.num_kv_heads)
        elif config.architecture == "gemma3" and gguf_name.endswith("norm.weight"):
            array = array - np.float32(1.0)  # llama.cpp stored 1 + w
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
        if progress is not None:
            progress(done, total)
    log.info("loaded %s (%s, %d tensors, %.1fM params) in %.1fs", path, config.architecture, len(weights),
             sum(w.numel() for w in weights.values()) / 1e6, time.perf_counter() - started)
    return config, weights


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (convert_hf_to_gguf.py), which stores each head's rows as
    ``reshape(n_head, 2, half, ...).swapaxes(1, 2)``; its inverse is ``reshape(n_head, half, 2, ...).swapaxes(1, 2)``.
    Works on a 2-D weight or a 1-D bias."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's forward permutation (HF row order -> GGUF row order); the inverse of ``unpermute_qk``."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_tensor(path: str | Path, tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor as float32 in numpy order; checks the stored bytes are all present and the shape is right."""
    numpy_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if numpy_shape != shape:
        raise corrupt(path, f"tensor {tensor.name} has shape {numpy_shape}, expected {shape}")
    if tensor.data.nbytes != tensor.n_bytes:
        raise corrupt(path, f"file is truncated: tensor {tensor.name} has {tensor.data.nbytes} of its "
                            f"{tensor.n_bytes} bytes")
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise corrupt(path, f"tensor {tensor.name} uses unsupported quantization "
                            f"{GGMLQuantizationType(tensor.tensor_type).name}") from exc
    array = array.reshape(shape)
    if array.dtype != np.float32 or not array.flags.writeable:  # F32 tensors are views into the file map
        array = array.astype(np.float32, copy=True)
    return array


def _expected_tensors(config: ModelConfig, present: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, numpy shape) for every tensor the model needs, in file-friendly order."""
    h, q, kv, ffn, hd = (config.hidden_size, config.q_size, config.kv_size, config.intermediate_size,
                         config.head_dim)
    shapes = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h),
              "attn_k.weight": (kv, h), "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
              "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
              "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,), "post_attention_norm.weight": (h,),
              "post_ffw_norm.weight": (h,),
              "ffn_gate.weight": (ffn, h), "ffn_up.weight": (ffn, h), "ffn_down.weight": (h, ffn)}
    per_layer = list(_REQUIRED_LAYER)
    if config.attention_bias:
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if config.architecture == "qwen3":
        per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
    names = _LAYER_NAMES
    if config.architecture == "gemma3":
        per_layer += list(gemma3.GGUF_EXTRA_LAYER_TENSORS)
        names = {**_LAYER_NAMES, **gemma3.GGUF_LAYER_NAMES}
    out = {"token_embd.weight": ("model.embed_tokens.weight", (config.vocab_size, h))}
    for i in range(config.num_layers):
        for suffix in per_layer:
            out[f"blk.{i}.{suffix}"] = (f"model.layers.{i}.{names[suffix]}", shapes[suffix])
    out["output_norm.weight"] = ("model.norm.weight", (h,))
    if not config.tie_word_embeddings:
        out["output.weight"] = ("lm_head.weight", (config.vocab_size, h))
    return out


def _read_config(path: str | Path, reader: GGUFReader, tensors: dict[str, Any]) -> ModelConfig:
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise corrupt(path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if "token_embd.weight" not in tensors:
        raise corrupt(path, "missing tensor token_embd.weight")

    def need(key: str) -> Any:
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise corrupt(path, f"missing metadata key {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = metadata(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts (hybrid models); a uniform list is fine
        if len(set(kv_heads)) != 1:
            raise corrupt(path, f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    num_layers = int(need("block_count"))
    window = metadata(reader, f"{arch}.attention.sliding_window")
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    embd = tensors["token_embd.weight"]
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // heads))
    extra: dict[str, Any] = {}
    try:
        if arch == "gemma3":  # also stop at <end_of_turn>, as llama.cpp does (its EOT token)
            extra = gemma3.gguf_knobs(lambda key: metadata(reader, f"{arch}.{key}"), hidden=hidden, heads=heads,
                                      head_dim=head_dim, num_layers=num_layers)
            eos_ids += [i for i in [token_id(reader, gemma3.END_OF_TURN)] if i is not None and i not in eos_ids]
        return ModelConfig(**{**dict(
            vocab_size=int(embd.shape[-1]), hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
            num_layers=num_layers, num_heads=heads, num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=f32_metadata(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=f32_metadata(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling_metadata(reader, arch, tensors),
            max_position_embeddings=int(metadata(reader, f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            layer_sliding_windows=(int(window) if window else None,) * num_layers,
            bos_token_id=_opt_int(metadata(reader, "tokenizer.ggml.bos_token_id")),
            eos_token_ids=tuple(eos_ids), architecture=arch,
            model_id=str(metadata(reader, "general.name") or Path(path).stem),
        ), **extra})
    except (ValueError, TypeError) as exc:
        raise corrupt(path, f"inconsistent model metadata: {exc}") from exc


def token_id(reader: GGUFReader, text: str) -> int | None:
    """The id of the vocabulary entry spelled ``text`` (first match), without decoding the whole list."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    wanted = text.encode("utf-8")
    for index, part in enumerate(field.data):
        if field.parts[part].tobytes() == wanted:
            return index
    return None


def rope_scaling_metadata(reader: GGUFReader, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` from ``{arch}.rope.scaling.*``; llama3-style scaling is detected from a
    ``rope_freqs.weight`` tensor (llama.cpp stores the per-frequency divisors, not the parameters), whose
    values are returned under ``freq_factors`` (inv_freq[i] / freq_factors[i] is the scaled frequency)."""
    def get(key: str) -> Any:
        return metadata(reader, f"{arch}.rope.scaling.{key}")

    kind = get("type")
    out: dict[str, Any] = {}
    if "rope_freqs.weight" in tensors:
        factors = dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        out = {"rope_type": "llama3", "factor": float(np.max(factors)),
               "freq_factors": [float(x) for x in np.asarray(factors).reshape(-1)]}
    elif kind in ("linear", "yarn"):
        out = {"rope_type": kind}
    else:
        return None
    renames = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
               "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
    for key, hf_key in renames.items():
        value = get(key)
        if value is not None:
            out[hf_key] = int(value) if hf_key == "original_max_position_embeddings" else f32_metadata(value)
    return out


def f32_metadata(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
