"""Hardware profiles for the cluster simulator: step-time models, KV footprint, transfer bandwidth, price.

A profile turns token counts into seconds. ``cost_model(block_size)`` gives the ``CostModel`` the placement
policies see, so the simulator and the router's policies reason with the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from shared.sched.types import CostModel


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
    transfer_gbps: float  # GB/s from the cache tier / between workers
    chunk_tokens: int = 8192  # token budget of one step (the engine's max_num_batched_tokens)
    max_num_seqs: int = 256  # running requests per worker (the engine's max_num_seqs)
    gpus_per_worker: int = 1
    price_per_gpu_hour: float = 0.0  # informational (cost of the hardware)
    note: str = ""

    def prefill_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def decode_step_s(self, batch_size: int, kv_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch_size + self.decode_per_kv_token_s * kv_tokens

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def block_transfer_s(self, block_size: int) -> float:
        return self.block_bytes(block_size) / (self.transfer_gbps * 1e9)

    def cost_model(self, block_size: int, typical_batch: int = 16, typical_kv_tokens: int = 16 * 16384) -> CostModel:
        return CostModel(prefill_a=self.prefill_a, prefill_b=self.prefill_b, prefill_c=self.prefill_c,
                         block_transfer_s=self.block_transfer_s(block_size),
                         decode_step_s=self.decode_step_s(typical_batch, typical_kv_tokens))


def calibrate(samples: Iterable[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares fit of prefill seconds = a*T^2 + b*T + c to (tokens, seconds) samples, clamped >= 0.

    With a clamped coefficient the others are refitted without it, so the result stays a least-squares fit.
    """
    pts = [(float(t), float(s)) for t, s in samples]
    if len(pts) < 3:
        raise ValueError("calibrate needs at least 3 (tokens, seconds) samples")
    t = np.array([p[0] for p in pts])
    s = np.array([p[1] for p in pts])
    a, b, c = (float(x) for x in np.polyfit(t, s, 2))
    if min(a, b, c) >= 0:
        return a, b, c
    best = None  # non-negative least squares over the subsets of {T^2, T, 1}: tiny, exact enough
    cols = [t * t, t, np.ones_like(t)]
    for mask in range(1, 8):
        idx = [i for i in range(3) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(np.stack([cols[i] for i in idx], axis=1), s, rcond=None)
        if np.any(coef < 0):
            continue
        full = [0.0, 0.0, 0.0]
        for i, v in zip(idx, coef):
            full[i] = float(v)
        err = float(np.sum((full[0] * t * t + full[1] * t + full[2] - s) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    if best is None:
        return 0.0, 0.0, max(0.0, float(np.mean(s)))
    return best[1][0], best[1][1], best[1][2]


# --- smollm2-cpu -------------------------------------------------------------------------------------
# Measured on this project's 2-core AVX2 machine: SmolLM2-135M-Instruct fp32, 2 threads (engine step timings,
# ~2.2 s per 1000 prompt tokens; ~60 ms per decode step at batch 1). Refit with calibrate() from live
# (tokens, seconds) samples and build a new Profile with dataclasses.replace.
# Measured 2026-12-02 on this 2-core machine, one torch thread per engine (what `deepinfer up` gives each
# worker): prefill T=16..1024 took 0.117..6.6-7.1 s, fitted with calibrate() (within ~10%); decode steps at
# batch 1..16 took 0.059..0.17 s, least-squares fit within ~8%.
SMOLLM2_CPU_PREFILL = (4.7e-6, 1.82e-3, 0.117)  # a, b, c
SMOLLM2_CPU_DECODE = (0.0594, 0.0039, 1.22e-5)  # base s, per sequence s, per KV token s
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32: 2 * 30 * 3 * 64 * 4 bytes per token.
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4

SMOLLM2_CPU = Profile(
    "smollm2-cpu", *SMOLLM2_CPU_PREFILL, *SMOLLM2_CPU_DECODE,
    kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN, transfer_gbps=3.4,  # shared-memory / NIXL loopback (PEERS.md)
    chunk_tokens=1024, max_num_seqs=64, gpus_per_worker=1, price_per_gpu_hour=0.0,
    note="measured: SmolLM2-135M fp32 on 2 CPU cores")


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
    kv_bytes_per_token=LLAMA70B_KV_BYTES_PER_TOKEN, transfer_gbps=50.0,  # cache tier / interconnect
    chunk_tokens=8192, gpus_per_worker=_TP, price_per_gpu_hour=3.0,
    note="roofline: Llama-70B-class bf16, TP8 on H200 per worker")

PROFILES: dict[str, Profile] = {p.name: p for p in (SMOLLM2_CPU, LLAMA70B_H200)}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}")
    return PROFILES[name]
