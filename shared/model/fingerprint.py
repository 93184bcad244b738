"""A model build's fingerprint: a digest of everything that determines the KV a worker computes for given tokens.

``model_fingerprint(model, tokenizer, block_size)`` is 32 lowercase hex characters (blake2b-128) over:

- the weights' content: every checkpoint tensor as loaded (name, dtype, shape and the crc32 of *all* its
  bytes, ``weights_digest``, computed by ``LlamaModel`` from the tensors it was given; a DeepSeek model leaves
  its MTP layers' tensors out);
- the architecture: every ``ModelConfig`` field except ``model_id`` and ``nextn_layers`` (layers, heads, KV
  heads, head dim, RoPE, norms, sliding windows, vocabulary, and Gemma's knobs: activation, embedding scale,
  attention scalar, local RoPE base, sandwich norms, norm offset), so the same weights under another name share
  one fingerprint (and a DeepSeek checkpoint with its MTP layers the fingerprint of the one without); fields added
  after v1 (``_LATER_FIELDS``) are left out while at their default, so builds that never set them keep the
  fingerprint they had; an MLA model's config (its latent KV layout) differs from every GQA one, so engines of
  the two layouts never take each other's KV;
- the run dtype (float32 and bfloat16 runs of one checkpoint compute different KV);
- the KV layout: ``shared/model/kv_cache.py``'s block layout version and the engine's ``block_size``;
- the tokenizer (its full ``tokenizer.json`` form, BOS/EOS ids and chat template), or "none".

It replaces the model's name in block hashes (``shared/kv/block_hash.py``), travels in hand-offs, tier puts and
gets and heartbeats, and is what the router groups workers by.

Cost (measured on the default SmolLM2-135M, 538 MB of float32 weights, a shared 2-core CPU): 0.13-0.18 s for
the crc32s and 0.02-0.03 s for the tokenizer, beside 2-3 s of loading (``benchmarks/block_identity_cost.py``);
it grows with the checkpoint at ~3-4 GB/s. crc32 reads every byte where blake2b over the same bytes takes ~5x
longer (0.67 s); it detects every change confined to a 32-bit burst of a tensor, and misses a random change of
a tensor with probability 2^-32. The fingerprint guards against operator error (another build or fine-tune
under one name, a tier directory kept across a swap), not against someone crafting weights: whoever controls a
worker's weights controls its output anyway.

Invariants: a pure function of the covered items (no Python ``hash``, no addresses, no device: the same build
has the same fingerprint in every process and on every machine); any change of a covered item changes it (up to
the crc32 bound above for tensor contents).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a checksum is taken: messages validate fingerprints without it
    import torch

    from shared.model.llama import LlamaModel

FINGERPRINT_HEX = 32
KV_LAYOUT = "kv-block-v1:[num_layers,2,kv_heads,block_size,head_dim]"  # shared/model/kv_cache.py
_VERSION = b"deepinfer-model-fingerprint-v1"
_LATER_FIELDS = {"hidden_act": "silu", "embed_scale": None, "query_pre_attn_scalar": None, "rope_local_theta": None,
                 "sandwich_norms": False, "norm_weight_offset": 0.0, "mla": None,
                 "moe": None, "v4": None}  # ModelConfig fields added after v1 + defaults
_NOT_KV_FIELDS = ("model_id", "nextn_layers")  # a name, and MTP drafter layers (which never touch the model's KV)
_CHUNK_BYTES = 64 << 20  # crc32 is fed in chunks, so a GPU tensor is copied to the host piece by piece


def tensor_checksum(tensor: torch.Tensor) -> int:
    """crc32 of all of ``tensor``'s bytes (C order; any device)."""
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    crc = 0
    for start in range(0, raw.numel(), _CHUNK_BYTES):
        crc = zlib.crc32(raw[start:start + _CHUNK_BYTES].cpu().numpy(), crc)
    return crc


def weights_digest(weights: Mapping[str, torch.Tensor]) -> bytes:
    """blake2b-256 over every tensor's name, dtype, shape and content checksum, in name order."""
    h = hashlib.blake2b(_VERSION, digest_size=32)
    for name in sorted(weights):
        t = weights[name]
        meta = f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}".encode()
        h.update(struct.pack("<I", len(meta)) + meta + struct.pack("<I", tensor_checksum(t)))
    return h.digest()


def tokenizer_digest(tokenizer: Any) -> bytes:
    """blake2b-256 of a ``shared.model.tokenizer.Tokenizer`` (None: a fixed value)."""
    if tokenizer is None:
        return hashlib.blake2b(b"no-tokenizer", digest_size=32).digest()
    facts = json.dumps({"bos": tokenizer.bos_token_id, "eos": list(tokenizer.eos_token_ids),
                        "chat_template": tokenizer.chat_template}, sort_keys=True)
    h = hashlib.blake2b(facts.encode(), digest_size=32)
    h.update(tokenizer.backend.to_str().encode())
    return h.digest()


def config_digest(config: Any) -> bytes:
    """blake2b-256 of a ``ModelConfig``'s fields except ``_NOT_KV_FIELDS`` (and later fields still at their
    default)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _NOT_KV_FIELDS}
    fields = {k: v for k, v in fields.items() if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]}
    return hashlib.blake2b(json.dumps(fields, sort_keys=True, default=_jsonable).encode(), digest_size=32).digest()


def _jsonable(value: Any) -> Any:
    """JSON form of a config field json cannot write: a nested dataclass (MLA, MoE) as its dict, else a list."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else list(value)


def model_fingerprint(model: LlamaModel, tokenizer: Any, block_size: int) -> str:
    """The fingerprint of ``model`` (its ``weights_digest``, config, dtype) served with ``tokenizer`` in
    blocks of ``block_size`` tokens (see the module docstring)."""
    h = hashlib.blake2b(_VERSION, digest_size=FINGERPRINT_HEX // 2)
    for part in (model.weights_digest, config_digest(model.config), tokenizer_digest(tokenizer),
                 f"{str(model.dtype).removeprefix('torch.')}|{KV_LAYOUT}|{block_size}".encode()):
        h.update(struct.pack("<I", len(part)) + part)
    return h.hexdigest()


def is_fingerprint(value: object) -> bool:
    """Whether ``value`` is a well-formed fingerprint (32 lowercase hex characters)."""
    return (isinstance(value, str) and len(value) == FINGERPRINT_HEX
            and all(c in "0123456789abcdef" for c in value))
