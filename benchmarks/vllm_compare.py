"""Optional side-by-side with vLLM-CPU on the engine prompt set (vLLM is never a dependency of deepinfer).

Two steps, two interpreters:

    .venv/bin/python -m benchmarks.vllm_compare prepare --out /tmp/vllm-cmp      # HF folder + both prompt sets
    /tmp/vllm-venv/bin/python benchmarks/vllm_compare.py run --out /tmp/vllm-cmp --set distinct   # in vLLM's venv
    .venv/bin/python -m benchmarks.engine_throughput --skip-hf --prompt-set shared-prefix \\
        --expect-ids /tmp/vllm-cmp/vllm-shared-prefix-float32.json                        # ours, with greedy agreement

``prepare`` writes the default model as an HF folder (vLLM cannot read the GGUF), ``distinct.json`` (the 64
prompts' token ids) and ``shared-prefix.json`` (the same prompts behind one ``SYSTEM_TOKENS``-token system
block, ``engine_throughput.shared_prefix_prompts``). ``run`` imports only vLLM: offline ``LLM`` with
``TokensPrompt``, greedy, 64 new tokens, EOS ignored, all prompts at once, start-up excluded; it prints out tok/s
and writes every output's token ids for the agreement check. Settings follow ../shared/PEERS.md
(``VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-<n-1> VLLM_CPU_NUM_OF_RESERVED_CPU=0``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def prepare(out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from benchmarks.engine_throughput import load_prompt_set
    from shared.model.loader import load_model_files
    from shared.model.locate import default_model_path

    out.mkdir(parents=True, exist_ok=True)
    gguf = default_model_path()
    hf = out / "hf"
    if not (hf / "config.json").exists():  # our loader's float32 weights (HF names) + a Llama config.json
        config, weights, _ = load_model_files(gguf)
        hf.mkdir(parents=True, exist_ok=True)
        if config.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        save_file({k: v.contiguous() for k, v in weights.items()}, str(hf / "model.safetensors"))
        (hf / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings, "hidden_act": "silu",
            "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids), "torch_dtype": "float32"}, indent=1))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(hf)
    for name in ("distinct", "shared-prefix"):
        (out / f"{name}.json").write_text(json.dumps(load_prompt_set(name, 64)))
    print(f"prepared {hf} and the prompt sets in {out}")


def run(out: Path, names: list[str], new_tokens: int, dtype: str) -> None:
    threads = len(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_start = time.perf_counter()
    llm = LLM(model=str(out / "hf"), dtype=dtype, enable_prefix_caching=True, max_model_len=2048)
    startup = time.perf_counter() - t_start
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for name in names:  # one engine for every set; each set's prefixes are its own (none is shared between them)
        prompts = json.loads((out / f"{name}.json").read_text())
        t0 = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        wall = time.perf_counter() - t0
        ids = [list(r.outputs[0].token_ids) for r in results]
        n_out = sum(map(len, ids))
        cached = sum(r.num_cached_tokens or 0 for r in results)
        (out / f"vllm-{name}-{dtype}.json").write_text(json.dumps(ids))
        print(f"vLLM {name} {dtype}: {n_out} tokens in {wall:.1f} s = {n_out / wall:.1f} out tok/s "
              f"(start-up {startup:.0f} s, prompt tokens from cache {cached})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("--out", type=Path, default=Path("/tmp/vllm-cmp"))
    ap.add_argument("--set", default="distinct", help="distinct, shared-prefix, or both comma-separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.step == "prepare":
        prepare(args.out)
    else:
        names = args.set.split(",")
        if not set(names) <= {"distinct", "shared-prefix"}:
            ap.error(f"unknown prompt set in {args.set!r}")
        run(args.out, names, args.new_tokens, args.dtype)


if __name__ == "__main__":
    sys.exit(main())
