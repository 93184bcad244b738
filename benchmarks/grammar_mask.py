"""Grammar engines side by side on one schema set and SmolLM2's 49,152-token vocabulary: grammar compile time and
the per-token cost of computing the next-token mask while a valid instance is fed token by token.

llguidance is deepinfer's engine (``shared/structured.py``); xgrammar and outlines-core are measured when they
are installed (``pip install xgrammar==0.2.9 outlines-core==0.2.14``; not in the lock), else reported missing.
One thread, the bench alone on the machine; a mask is "computed" when it sits in a buffer the sampler could use.

    python -m benchmarks.grammar_mask
"""
from __future__ import annotations

import json
import logging
import statistics
import time

import numpy as np

from services.router.tokenize import load_tokenizer

logger = logging.getLogger("grammar_mask")

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search", "send_email"]},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                                       "days": {"type": "integer"}},
                      "required": ["city", "unit", "days"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 3}}),
    "items": ({"type": "object", "properties": {"values": {"type": "array", "items": {"type": "number"}},
                                                "labels": {"type": "array", "items": {"type": "string"}}},
               "required": ["values", "labels"], "additionalProperties": False},
              {"values": [1.5, 2, 3.25, 40, 5], "labels": ["alpha", "beta", "gamma"]}),
    "nested": ({"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": {"type": "string"}, "roles": {"type": "array", "items": {
            "enum": ["admin", "dev", "ops"]}}}, "required": ["id", "email", "roles"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
        {"user": {"id": 7, "email": "a@b.io", "roles": ["dev", "ops"]}, "active": True}),
}


def llguidance_runner(tok):
    import llguidance
    from shared import structured
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids))

    def run(schema, ids):
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, structured.grammar_of({"type": "json_schema", "schema": schema}),
                                       log_level=0)
        compile_s = time.perf_counter() - t0
        times = []
        for t in ids:
            t0 = time.perf_counter()
            np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            times.append(time.perf_counter() - t0)
            assert matcher.consume_token(t), matcher.get_error()
        return compile_s, times
    return run


def xgrammar_runner(tok):
    import transformers
    import xgrammar as xgr
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def run(schema, ids):
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                  separators=(",", ":")))
        compile_s = time.perf_counter() - t0
        times = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(t)
        return compile_s, times
    return run


def outlines_runner(tok):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    eos = tok.eos_token_ids[0]
    pieces: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i in tok.eos_token_ids:
            continue
        pieces.setdefault(tok.decode([i], skip_special_tokens=False).encode(), []).append(i)
    vocab = Vocabulary(eos, {k: v for k, v in pieces.items() if k})

    def run(schema, ids):
        t0 = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), vocab))
        compile_s = time.perf_counter() - t0
        mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            times.append(time.perf_counter() - t0)
            guide.advance(t)
        return compile_s, times
    return run


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    torch.set_num_threads(1)
    tok = load_tokenizer(None)
    instances = {name: tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False)
                 for name, (_, value) in SCHEMAS.items()}
    results: dict[str, tuple[float, float, float] | str] = {}
    for engine, make in (("llguidance", llguidance_runner), ("xgrammar", xgrammar_runner),
                         ("outlines-core", outlines_runner)):
        try:
            t0 = time.perf_counter()
            run = make(tok)
            setup_s = time.perf_counter() - t0
        except ImportError as err:
            results[engine] = f"not installed ({err.name})"
            continue
        compiles, per_token = [], []
        for name, (schema, _) in SCHEMAS.items():
            try:
                compile_s, times = run(schema, instances[name])
            except Exception as err:   # noqa: BLE001 - an engine that cannot run a schema is reported, not fatal
                logger.info("%s failed on %s: %r", engine, name, err)
                continue
            compiles.append(compile_s)
            per_token += times
        results[engine] = (setup_s, statistics.median(compiles) * 1e3, statistics.median(per_token) * 1e6,
                           float(np.percentile(per_token, 99)) * 1e6)
    base = results.get("llguidance")
    logger.info("grammar engines, SmolLM2 vocabulary (49,152 tokens), %d schemas, %d masks each, 1 thread",
                len(SCHEMAS), sum(len(v) for v in instances.values()))
    logger.info("%-14s %12s %16s %16s %14s %10s", "engine", "vocab setup", "compile (median)", "mask p50",
                "mask p99", "p50 ratio")
    for engine, r in results.items():
        if isinstance(r, str):
            logger.info("%-14s %s", engine, r)
            continue
        ratio = r[2] / base[2] if isinstance(base, tuple) else float("nan")
        logger.info("%-14s %10.2f s %13.2f ms %13.1f µs %11.1f µs %9.2fx", engine, r[0], r[1], r[2], r[3], ratio)


if __name__ == "__main__":
    main()
