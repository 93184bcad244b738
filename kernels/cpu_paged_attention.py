"""Paged-attention decode (and the KV store and layer ops beside it: kernels/layer_ops.py) for the CPU as a small
C++ extension (compiled once with the machine's g++).

Why: the torch reference gathers every sequence's blocks padded to the longest context, then runs a
masked SDPA; on a 2-core CPU that copy dominates a decode step. This kernel reads K/V in place through the
block table, one (sequence, kv-head) task per thread, and touches only the tokens each query can see.

Same signature and semantics as ``paged_decode_attention_reference`` (kernels/paged_attention.py).
If the extension cannot be built (no compiler), ``load()`` returns ``None`` and callers use the reference.

It is compiled with ``-march=native``, so a build runs only on CPUs with the instruction sets of the one that
built it: the module's name (``module_name()``) carries ``host_isa_key()``, and a CPU with other instruction
sets (an image built on an AVX-512 host, run on an AVX2 one) builds and loads its own copy.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# One extension, four sources: decode attention + KV store, the layer ops (kernels/layer_ops.py dispatches to them),
# prefill attention (kernels/prefill_attention.py; uses the first two's exp and rounding) and greedy sampling's
# argmax (kernels/sampling_ops.py).
_SOURCE = "\n".join((Path(__file__).parent / name).read_text()
                    for name in ("cpu_attention.cpp", "cpu_layer_ops.cpp", "cpu_prefill_attention.cpp",
                                 "cpu_sampling_ops.cpp"))
_FUNCTIONS = ["paged_decode", "store_kv", "paged_prefill_", "paged_prefix_attention", "rms_norm", "add_rms_norm_",
              "silu_mul", "rope_", "argmax_rows"]

# Reassociation (vectorised sums) but exact expf and IEEE infinities: -ffast-math's approximate vector exp bought
# nothing measurable over this on the engine benchmark; without -fassociative-math decode runs ~15% slower
# (all 64 bench sequences then equal HF's; with it one fp32 near-tie, top-2 margin 3e-5, flips).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
           "-fopenmp"]
# A digest of what shapes the binary on every CPU; module_name() adds the CPU's instruction sets.
_BUILD_DIGEST = hashlib.sha256("\0".join([_SOURCE, *_CFLAGS, torch.__version__]).encode()).hexdigest()[:12]
# /proc/cpuinfo fields listing a core's instruction-set extensions: x86; arm64 and s390; riscv.
_ISA_FIELDS = ("flags", "features", "isa")

_module = None
_tried = False


def isa_key(cpuinfo: str, machine: str) -> str:
    """12 hex digits naming the instruction sets that ``cpuinfo`` (``/proc/cpuinfo``'s text) lists for
    ``machine`` (``platform.machine()``): a digest of every core's ``flags`` / ``Features`` / ``isa`` line.

    Same flags give the same key, in any order and for any number of cores; one flag more or less gives
    another key. Every flag counts, not only the ones ``-march=native`` acts on: a needless rebuild costs a
    minute, loading a build for another CPU an illegal instruction. Without such a line the key is
    ``machine``'s alone.
    """
    lines = set()
    for line in cpuinfo.splitlines():
        field, sep, value = line.partition(":")
        if sep and field.strip().lower() in _ISA_FIELDS:
            lines.add(" ".join(sorted(set(value.split()))))
    return hashlib.sha256("\n".join([machine, *sorted(lines)]).encode()).hexdigest()[:12]


@functools.cache
def host_isa_key() -> str:
    """``isa_key`` of this machine: ``/proc/cpuinfo`` on Linux; elsewhere (no such file) the architecture and
    ``platform.processor()``, which tell fewer CPUs apart."""
    try:
        return isa_key(Path("/proc/cpuinfo").read_text(errors="replace"), platform.machine())
    except OSError:  # not Linux
        return isa_key("", f"{platform.machine()} {platform.processor()}")


def module_name() -> str:
    """The extension's module (and ``.so``) name: source, flags and torch digest, then this CPU's ISA key."""
    return f"deepinfer_cpu_attention_{_BUILD_DIGEST}_{host_isa_key()}"


def build_dir() -> Path:
    root = Path(os.environ.get("DEEPINFER_KERNEL_CACHE", Path.home() / ".cache" / "deepinfer" / "kernels"))
    path = root / f"torch{torch.__version__.replace('+', '_')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _import_built(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """Load the extension, compiling it first if this machine has no build yet (~1 min, done by ``make``).

    A built module is imported directly, never through ``load_inline``: that takes a lock file which a
    process killed mid-load leaves behind, and every later load would wait on it forever.
    Returns ``None`` (callers use the torch reference) when it cannot be built.
    """
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("DEEPINFER_DISABLE_CPP_KERNELS") == "1":
        return None
    name = module_name()
    built = build_dir() / f"{name}.so"
    try:
        if built.exists():
            _module = _import_built(built)
        else:
            from torch.utils.cpp_extension import load_inline

            logger.info("building the CPU attention extension %s for this CPU (~1 min)", name)
            _module = load_inline(name=name, cpp_sources=[_SOURCE], functions=_FUNCTIONS,
                                  extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                                  build_directory=str(build_dir()), verbose=False)
    except Exception as err:  # no compiler / headers: fall back to the torch reference
        logger.warning("CPU attention extension unavailable (%s); using the torch reference", err)
        _module = None
    return _module


_NONE = torch.empty(0)


def paged_decode_attention_cpu(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None,
                               starts=None, prefix_out=None, prefix_lse=None):
    """``query: [B, H, D]`` → ``[B, H, D]``; see kernels/paged_attention.py for the contract.

    With ``starts`` ([B] int32), row ``b`` attends only positions ``[starts[b], context_len)`` and merges that
    with ``prefix_out`` ([B, H, D]) and ``prefix_lse`` ([B, H]), its attention over the positions before
    (see kernels/cascade_attention.py); rows with ``starts[b] == 0`` attend their whole context as usual."""
    if starts is None:
        starts = prefix_out = prefix_lse = _NONE
    return load().paged_decode(query, k_cache, v_cache, block_tables, context_lens, float(scale),
                               int(sliding_window or 0), starts, prefix_out, prefix_lse)


if __name__ == "__main__":  # `python -m kernels.cpu_paged_attention`: build ahead of time (make venv)
    logging.basicConfig(level=logging.INFO)
    logger.info("CPU attention extension: %s", "ready" if load() is not None else "unavailable")
