"""Hardware profiles for the cluster simulator: step-time models, KV footprint, transfer bandwidth, price.

A profile turns token counts into seconds. ``cost_model(block_size)`` gives the ``CostModel`` the placement
policies see, so the simulator and the router's policies reason with the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from services.router.policy.types import CostModel


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    prefill_a: float  # prefill of T tokens: a*T^2 + b*T + c seconds
    prefill_b: float
    prefill_c: float
    decode_base_s: float  # one decode step of the whole batch: base + per_seq*batch + per_kv_token*kv_tokens
    decode_per_seq_s: float
    decode_per_kv_token_s: float
    kv_bytes_per_token: int
    transfer_gbps: float  # GB/s of a KV hand-off between two workers
    chunk_tokens: int = 8192  # token budget of one step (the engine's max_num_batched_tokens)
    max_num_seqs: int = 256  # running requests per worker (the engine's max_num_seqs)
    # A prefill chunk of c tokens after ctx tokens already in the KV costs a*c^2 + ctx_a*c*ctx + b*c (plus the
    # per-step c). None: 2a, a causal kernel that skips the masked half (the unchunked prompt's cost, as flash
    # attention on GPU); a, an explicit-mask SDPA that computes the whole c x (ctx+c) rectangle
    prefill_ctx_a: float | None = None
    gpus_per_worker: int = 1
    price_per_gpu_hour: float = 0.0  # informational (cost of the hardware)
    note: str = ""
    # GB/s of pulling a block from the cache tier's DRAM / SSD to a worker (required, keyword-only)
    tier_dram_gbps: float = field(kw_only=True)
    tier_ssd_gbps: float = field(kw_only=True)

    def __post_init__(self) -> None:
        for name in ("transfer_gbps", "tier_dram_gbps", "tier_ssd_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0, got {getattr(self, name)!r}")

    def prefill_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def chunk_s(self, ctx: int, c: int) -> float:
        """Prefill of ``c`` prompt tokens after ``ctx`` tokens already in the KV, without the per-step cost."""
        ctx_a = 2 * self.prefill_a if self.prefill_ctx_a is None else self.prefill_ctx_a
        return self.prefill_a * c * c + ctx_a * c * ctx + self.prefill_b * c

    def decode_step_s(self, batch_size: int, kv_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch_size + self.decode_per_kv_token_s * kv_tokens

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def block_transfer_s(self, block_size: int) -> float:
        """Seconds to hand one block from worker to worker."""
        return self.block_bytes(block_size) / (self.transfer_gbps * 1e9)

    def tier_block_s(self, tier: str, block_size: int) -> float:
        """Seconds to pull one block from the cache tier's ``"dram"`` or ``"ssd"`` to a worker."""
        gbps = {"dram": self.tier_dram_gbps, "ssd": self.tier_ssd_gbps}[tier]
        return self.block_bytes(block_size) / (gbps * 1e9)

    def cost_model(self, block_size: int, typical_batch: int = 16, typical_kv_tokens: int = 16 * 16384) -> CostModel:
        return CostModel(prefill_a=self.prefill_a, prefill_b=self.prefill_b, prefill_c=self.prefill_c,
                         block_transfer_s=self.block_transfer_s(block_size),
                         decode_step_s=self.decode_step_s(typical_batch, typical_kv_tokens),
                         block_bytes=self.block_bytes(block_size))


def fit_nonnegative(columns: Sequence[np.ndarray], seconds: np.ndarray) -> list[float]:
    """Coefficients >= 0 of ``sum(coef[i] * columns[i])`` minimising the squared *relative* error against
    ``seconds``: step times span two orders of magnitude, and a 10% miss on a 0.1 s step matters as much as one
    on a 7 s step. Exact: every subset of the columns is solved and the best non-negative one kept."""
    s = np.asarray(seconds, dtype=np.float64)
    if len(s) < len(columns):
        raise ValueError(f"need at least {len(columns)} samples, got {len(s)}")
    if np.any(s <= 0):
        raise ValueError("step times must be positive")
    cols = [np.asarray(c, dtype=np.float64) / s for c in columns]  # rows scaled by 1/s: relative residuals
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 1 << len(cols)):
        idx = [i for i in range(len(cols)) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(np.stack([cols[i] for i in idx], axis=1), np.ones_like(s), rcond=None)
        if np.any(coef < 0):
            continue
        full = [0.0] * len(cols)
        for i, v in zip(idx, coef):
            full[i] = float(v)
        err = float(np.sum((sum(f * c for f, c in zip(full, cols)) - 1.0) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    return best[1] if best is not None else [0.0] * len(cols)


def calibrate(samples: Iterable[tuple[int, float]]) -> tuple[float, float, float]:
    """(a, b, c) of prefill seconds = a*T^2 + b*T + c from (tokens, seconds) samples (``fit_nonnegative``)."""
    pts = [(float(t), float(s)) for t, s in samples]
    if len(pts) < 3:
        raise ValueError("calibrate needs at least 3 (tokens, seconds) samples")
    t = np.array([p[0] for p in pts])
    a, b, c = fit_nonnegative([t * t, t, np.ones_like(t)], np.array([p[1] for p in pts]))
    return a, b, c


def calibrate_chunks(samples: Iterable[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """(a, ctx_a, b, c) of one prefill step of ``n`` tokens after ``ctx`` cached ones,
    seconds = a*n^2 + ctx_a*n*ctx + b*n + c, from (ctx, n, seconds) samples (ctx 0: a fresh prompt)."""
    pts = np.array([(float(x), float(n), float(s)) for x, n, s in samples]).reshape(-1, 3)
    x, n = pts[:, 0], pts[:, 1]
    a, ctx_a, b, c = fit_nonnegative([n * n, n * x, n, np.ones_like(n)], pts[:, 2])
    return a, ctx_a, b, c


def calibrate_decode(samples: Iterable[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(base, per_seq, per_kv_token) of decode seconds = base + per_seq*B + per_kv*K from (B, K, seconds)."""
    pts = np.array([(float(b), float(k), float(s)) for b, k, s in samples]).reshape(-1, 3)
    base, per_seq, per_kv = fit_nonnegative([np.ones(len(pts)), pts[:, 0], pts[:, 1]], pts[:, 2])
    return base, per_seq, per_kv


# --- smollm2-cpu -------------------------------------------------------------------------------------
# Measured 2026-12-02 on this project's 2-core AVX2 machine with `python -m benchmarks.calibrate_profile
# --threads 1 --reps 3` (SmolLM2-135M-Instruct fp32, one torch thread: what `deepinfer up` gives each worker;
# samples in benchmarks/data/smollm2_cpu_calibration.json): fresh prefills T=16..1024 took 0.12..6.15 s, chunks
# after 512..3072 cached tokens 0.59..17.4 s, decode steps (B=1..32, K=67..8305) 0.053..0.188 s. Relative
# least-squares fit: every sample within 15%. The CPU engine's chunk attention is an explicit-mask SDPA over
# the whole context, so the context term is fitted (ctx_a ~ 0.8a), not the 2a of a causal kernel.
SMOLLM2_CPU_PREFILL = (3.51e-6, 2.08e-3, 0.0913)  # a, b, c
SMOLLM2_CPU_PREFILL_CTX_A = 2.89e-6
SMOLLM2_CPU_DECODE = (0.0488, 0.00383, 8.76e-6)  # base s, per sequence s, per KV token s
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32: 2 * 30 * 3 * 64 * 4 bytes per token.
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4

# Cache tier on the same host. DRAM: a pull is a copy out of the tier process's shared memory, like the shm
# hand-off: 3.4 GB/s (../shared/PEERS.md: shm 2.7-4.7, NIXL 3.5-4.9 between two processes; a one-process
# numpy memcpy of 256 MiB measured 12.9 GB/s median here on 2026-12-03 is the ceiling). SSD: O_DIRECT
# sequential 8 MiB reads of a 1 GiB file on this machine's disk measured 1.75-2.1 GB/s (2026-12-03); the copy
# to the worker overlaps the next read, so the disk bounds it: 1.8.
SMOLLM2_CPU = Profile(
    "smollm2-cpu", *SMOLLM2_CPU_PREFILL, *SMOLLM2_CPU_DECODE,
    kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN, transfer_gbps=3.4,  # shared-memory / NIXL loopback (PEERS.md)
    tier_dram_gbps=3.4, tier_ssd_gbps=1.8,
    chunk_tokens=1024, max_num_seqs=64, prefill_ctx_a=SMOLLM2_CPU_PREFILL_CTX_A, gpus_per_worker=1,
    price_per_gpu_hour=0.0,
    note="measured: SmolLM2-135M fp32, one thread per worker on a 2-core CPU")


# --- llama70b-h200 -----------------------------------------------------------------------------------
# Roofline for a 70B dense model (80 layers, hidden 8192, GQA 8 KV heads x head_dim 128, bf16).
# Assumption: one worker = 8 H200 (TP8). One H200 cannot hold 140 GB of weights plus any KV cache, so TP8 is
# the smallest sane worker; it leaves ~8*141-140 ~ 990 GB for KV (~5,900 blocks of 512 tokens per worker).
_L, _H, _KVH, _HD, _PARAMS, _TP = 80, 8192, 8, 128, 70e9, 8
_FLOPS = _TP * 989e12 * 0.5  # bf16 dense at ~50% MFU for prefill
_HBM = _TP * 4.8e12 * 0.8  # HBM bandwidth at ~80% achieved
LLAMA70B_KV_BYTES_PER_TOKEN = 2 * _L * _KVH * _HD * 2  # 327,680
LLAMA70B_H200 = Profile(
    "llama70b-h200",
    prefill_a=2 * _L * _H / _FLOPS,  # causal attention: ~2*L*d*T^2 FLOPs
    prefill_b=2 * _PARAMS / _FLOPS,  # 2 FLOPs per parameter per token
    prefill_c=0.005,  # launch / scheduling / all-reduce latency per prefill
    decode_base_s=2 * _PARAMS / _HBM + 0.003,  # read all weights once per step + ~3 ms TP all-reduce/launch
    decode_per_seq_s=2 * _PARAMS / (_TP * 989e12 * 0.25),  # matmul FLOPs per sequence at lower MFU
    decode_per_kv_token_s=LLAMA70B_KV_BYTES_PER_TOKEN / _HBM,  # read each cached token's K and V
    kv_bytes_per_token=LLAMA70B_KV_BYTES_PER_TOKEN, transfer_gbps=50.0,  # worker-to-worker interconnect
    # Cache tier: separate storage nodes reached over one 400 Gb/s-class NIC per worker (ConnectX-7 / RDMA:
    # 50 GB/s line rate, ~80% achieved = 40 GB/s from DRAM). SSD: two PCIe 4.0 NVMe drives striped per
    # storage node serving a pull, ~7 GB/s sequential read each at ~85% for 168 MB blocks = 12 GB/s (the NIC is
    # not the bottleneck there).
    tier_dram_gbps=40.0, tier_ssd_gbps=12.0,
    chunk_tokens=8192, gpus_per_worker=_TP, price_per_gpu_hour=3.0,
    note="roofline: Llama-70B-class bf16, TP8 on H200 per worker")

PROFILES: dict[str, Profile] = {p.name: p for p in (SMOLLM2_CPU, LLAMA70B_H200)}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}")
    return PROFILES[name]
