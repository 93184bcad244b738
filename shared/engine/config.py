"""Engine configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DEFAULT_KV_CACHE_MB = 1024  # the KV pool of an engine, and of every worker and CLI flag that sizes one


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``num_kv_blocks`` fixes the KV pool size; when ``None`` it is derived from ``kv_cache_bytes``.
    ``max_model_len`` ``None`` means the model's context length. ``num_threads`` ``None`` means the
    number of CPUs this process may run on (never more: oversubscription is ~10x slower).

    ``swa_kv``: a model with sliding-window layers keeps their KV in a second pool holding only what the window
    can see (``shared/engine/hybrid_kv.py``); a model without windows is unaffected. Pool sizes: with
    ``num_kv_blocks`` the full pool has that many blocks and the window pool ``num_window_kv_blocks`` (default:
    as many); otherwise ``kv_cache_bytes`` is split by ``hybrid_kv.pool_sizes`` for sequences of
    ``swa_kv_context`` tokens (default ``min(max_model_len, hybrid_kv.SWA_KV_CONTEXT)``: 4,096).

    ``rope_scaling``: an HF ``rope_scaling`` dict that replaces the loaded model's, extending its context
    (``shared/model/config.with_rope_scaling``: YaRN ``factor`` 4 on a 32K model serves 128K)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_MB << 20
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 128
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available else cpu
    num_threads: int | None = None
    decode_graphs: str = "auto"  # auto: CUDA graphs on CUDA, none on CPU; off; eager (padded path, no capture)
    decode_graph_max_batch: int = 64  # largest decode batch replayed from a graph (larger ones run eagerly)
    swa_kv: bool = True
    num_window_kv_blocks: int | None = None
    swa_kv_context: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority (shared/engine/scheduler.py)
    rope_scaling: dict | None = None  # replaces the model's (shared/model/config.with_rope_scaling): YaRN etc.

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if (self.num_window_kv_blocks is not None and self.num_window_kv_blocks <= 0) or \
                (self.swa_kv_context is not None and self.swa_kv_context <= 0):
            raise ValueError("num_window_kv_blocks and swa_kv_context must be positive")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.decode_graphs not in ("auto", "off", "eager"):
            raise ValueError(f"decode_graphs must be auto, off or eager, got {self.decode_graphs!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.decode_graph_max_batch <= 0:
            raise ValueError("decode_graph_max_batch must be positive")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolve_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
