"""Where an engine run's wall time goes: linear layers (LM head apart), attention (decode rows through the paged
kernel, prefill chunks, KV writes), the rest of
the forward pass (embedding, norms, RoPE, activations), sampling, scheduling, batch preparation, and what is
left: Python work in the engine loop (outputs, detokenization, stop rules, block bookkeeping).

Timing wraps the functions the engine calls (perf_counter around each call; CPU ops are synchronous), so the
categories add up to the measured wall time, and nothing in the engine changes. Used by
``python -m benchmarks.engine_throughput --breakdown``.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import shared.engine.model_runner as runner_mod
import shared.model.attention as attention_mod
import shared.model.llama as llama_mod

CATEGORIES = ("linear", "lm_head", "decode_attention", "prefill_attention", "kv_write", "forward_other", "sample",
              "schedule", "prepare", "engine_python")


class Breakdown:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return wrapper

    def report(self, wall: float) -> dict[str, float]:
        """Exclusive seconds per category (nested ones subtracted from their parents)."""
        s = self.seconds
        linear = s["linear"] - s["lm_head"]
        prefill_attention = s["attention"] - s["kv_write"] - s["decode_attention"]
        forward_other = s["forward"] - s["linear"] - s["attention"]
        inner = s["forward"] + s["sample"] + s["schedule"] + s["prepare"]
        return {"linear": linear, "lm_head": s["lm_head"], "decode_attention": s["decode_attention"],
                "prefill_attention": prefill_attention, "kv_write": s["kv_write"],
                "forward_other": forward_other, "sample": s["sample"], "schedule": s["schedule"],
                "prepare": s["prepare"], "engine_python": wall - inner}


@contextlib.contextmanager
def instrument(engine):
    """Wrap the engine's hot functions for the duration of the block; yields the ``Breakdown``."""
    b = Breakdown()
    model, runner, scheduler = engine.model, engine.runner, engine.scheduler
    lm_head = model.lm_head
    plain_linear = llama_mod.linear

    def linear(x, w, bias=None):
        if w is lm_head:
            return b.timed("lm_head", plain_linear)(x, w, bias)
        return plain_linear(x, w, bias)

    patches = [(llama_mod, "linear", b.timed("linear", linear)),
               (llama_mod, "attend", b.timed("attention", llama_mod.attend)),
               (attention_mod, "store_kv", b.timed("kv_write", attention_mod.store_kv)),
               (attention_mod, "paged_decode_attention", b.timed("decode_attention",
                                                                 attention_mod.paged_decode_attention)),
               (attention_mod, "cascade_decode_attention", b.timed("decode_attention",
                                                                   attention_mod.cascade_decode_attention)),
               (runner_mod, "sample", b.timed("sample", runner_mod.sample)),
               (model, "forward", b.timed("forward", model.forward)),
               (runner, "_prepare", b.timed("prepare", runner._prepare)),
               (scheduler, "schedule", b.timed("schedule", scheduler.schedule))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield b
    finally:
        for obj, name, fn in saved:
            if isinstance(obj, type(llama_mod)):
                setattr(obj, name, fn)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)  # instance attribute shadowing the bound method: drop it


def format_report(parts: dict[str, float], wall: float) -> str:
    lines = [f"{'category':<14} {'seconds':>8} {'share':>6}"]
    for name in CATEGORIES:
        lines.append(f"{name:<14} {parts[name]:8.2f} {parts[name] / wall:6.1%}")
    lines.append(f"{'wall':<14} {wall:8.2f}")
    return "\n".join(lines)
