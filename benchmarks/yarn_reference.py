"""A context extension checked against transformers: the same GGUF, the same ``rope_scaling``, both engines.

Loads a model (default the Qwen2.5-Coder-0.5B GGUF that ``benchmarks/qwen_pair.py fetch`` joins) into deepinfer's
engine with ``--rope-scaling`` (default YaRN x4 over 32,768, as Qwen2.5's model card documents for 128K) and into
transformers from the same file with that ``rope_scaling`` in its config, feeds both one prompt of ``--tokens``
tokens (the benchmark prompts, cycled) in float32, and prints the largest logit difference over the prompt's
positions and whether the greedy continuation (``--new-tokens``, by re-feeding the prompt each step in
transformers) is the same. transformers' attention is quadratic in memory here, so this runs at lengths a CPU host
holds (a few thousand tokens); the served path at 77K is ``benchmarks/long_context.py --rope-scaling``.

    python -m benchmarks.yarn_reference [--model PATH] [--tokens 4096] [--new-tokens 16]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from benchmarks.long_context import cycled_prompt
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.tiny_model import all_logits

DEFAULT_MODEL = "~/.cache/deepinfer/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
log = logging.getLogger("bench.yarn_reference")


def transformers_model(path: Path, scaling: dict):
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.rope_scaling = dict(scaling)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                             dtype=torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rope-scaling", default=json.dumps(YARN), metavar="JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    path, scaling = Path(args.model).expanduser(), json.loads(args.rope_scaling)
    prompt = cycled_prompt(args.tokens, 0)
    engine = LLMEngine.from_path(path, EngineConfig(dtype="float32", rope_scaling=scaling,
                                                    max_num_batched_tokens=1024))
    t0 = time.perf_counter()
    ours = all_logits(engine.model, prompt)  # [tokens, V], one forward without the cache
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    ours_tokens = engine.generate([prompt], greedy)[0]
    log.info("deepinfer: %.1f s", time.perf_counter() - t0)
    t0 = time.perf_counter()
    hf = transformers_model(path, scaling)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        theirs = hf(ids).logits[0]
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, do_sample=False)
    hf_tokens = gen[0, len(prompt):].tolist()
    log.info("transformers: %.1f s", time.perf_counter() - t0)
    diff = (ours - theirs).abs().max().item()
    agree = sum(a == b for a, b in zip(ours.argmax(-1).tolist(), theirs.argmax(-1).tolist()))
    print(f"{path.name}, rope_scaling {scaling}, {args.tokens} prompt tokens, float32: max |logit difference| "
          f"{diff:.2e} over every position (logits up to {theirs.abs().max().item():.1f}); next-token argmax equal at "
          f"{agree}/{len(prompt)} positions; greedy {args.new_tokens} tokens "
          f"{'identical' if ours_tokens == hf_tokens else 'DIFFERENT'}")
    print(json.dumps({"tokens": args.tokens, "max_logit_diff": diff, "argmax_agree": agree,
                      "greedy_identical": ours_tokens == hf_tokens, "ours": ours_tokens, "transformers": hf_tokens}))


if __name__ == "__main__":
    main()
