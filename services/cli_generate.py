"""``deepinfer generate`` / ``deepinfer demo``: run the in-process engine and stream text to the terminal."""
from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def load_engine(args: argparse.Namespace) -> LLMEngine:
    bar = tqdm(total=0, desc="loading model", unit="tensor", file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        config = EngineConfig(dtype=args.dtype, device=args.device, num_threads=args.threads)
        return LLMEngine.from_path(args.model, config, progress=progress)
    finally:
        bar.close()


def stream(engine: LLMEngine, prompt: str, chat: bool, params: SamplingParams) -> None:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    request_id = engine.add_request(tok.encode(text), params)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                elapsed = time.perf_counter() - t0
                print(f"\n[{out.num_output_tokens} tokens, finish={out.finish_reason}, "
                      f"ttft={out.ttft * 1000:.0f} ms, {out.num_output_tokens / elapsed:.1f} tok/s]",
                      file=sys.stderr)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    engine = load_engine(args)
    stream(engine, args.prompt, args.chat, params)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    print(f"user> {DEMO_PROMPT}\nassistant> ", end="", flush=True)
    stream(engine, DEMO_PROMPT, True, SamplingParams(max_tokens=64, temperature=0.0))
    return 0
