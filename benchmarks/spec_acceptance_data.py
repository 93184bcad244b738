"""Acceptance log for the confidence head, generated offline (no speculative engine path needed).

SmolLM2 generates greedily for a set of prompts (24 from ``data/engine_prompts.json`` plus code-edit prompts
whose answer repeats code from the prompt). Then at every output position ``i`` a drafter proposes ``k``
tokens from ``prompt + output[:i]``; drafted token ``j`` is accepted iff it equals ``output[i + j]`` (the target's
greedy token there) and tokens ``0..j-1`` were accepted — what greedy verification would decide.

Every drafted token is logged, also those after the first rejection (labelled 0): training uses only the
tokens up to and including the first rejection (``train_head.conditional_mask``), and the full proposals
let the simulation count what verifying an untrimmed proposal costs (all ``k`` tokens go to the target).
Positions whose proposal would run past an EOS that ended the output are skipped (counted).

Train/test split (``split_of``): every prompt of the pool (all of ``engine_prompts.json`` and every code-edit
task) belongs to ``train`` or ``test`` by a stable hash of its *group* (``group_key``: its source file with the
docstring-only variant folded onto the file, the GNU licences folded into one group, a code-edit task's code),
so a prompt and its near-duplicates are always on the same side. ``--split train`` logs the training side
only. The shipped prompt-lookup head is fitted on the train side by ``benchmarks/spec_head_eval.py --ship``,
which also reports it on both sides.

    python -m benchmarks.spec_acceptance_data --split train --out /tmp/pl.jsonl --head /tmp/prompt_lookup.json
    python -m benchmarks.spec_acceptance_data --drafter draft_model --draft self:8 --stride 8 --out /tmp/dm.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import time
from pathlib import Path

from shared.spec.acceptance_log import AcceptanceLog

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"
log = logging.getLogger("bench.spec_acceptance")

# (instruction, code): the answer is mostly the code again, edited -- the case prompt lookup is for
EDIT_TASKS = [
    ("Rewrite this function with type hints:", "def mean(values):\n    total = 0\n    for v in values:\n"
     "        total += v\n    return total / len(values)\n"),
    ("Rewrite this function with type hints:", "def find_user(users, name, default=None):\n    for user in users:\n"
     "        if user['name'] == name:\n            return user\n    return default\n"),
    ("Add a docstring to this function and return the whole function:", "def chunks(items, size):\n"
     "    out = []\n    for i in range(0, len(items), size):\n        out.append(items[i:i + size])\n    return out\n"),
    ("Rename the variable `x` to `count` in this code and return the full code:", "def count_words(text):\n"
     "    x = {}\n    for word in text.split():\n        x[word] = x.get(word, 0) + 1\n    return x\n"),
    ("Fix the bug in this function and return the corrected function:", "def is_sorted(values):\n"
     "    for i in range(len(values)):\n        if values[i] > values[i + 1]:\n            return False\n"
     "    return True\n"),
    ("Rewrite this class with type hints:", "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
     "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
     "        return self.items.pop()\n\n    def is_empty(self):\n        return len(self.items) == 0\n"),
    ("Convert this loop into a list comprehension and return the function:", "def squares(numbers):\n"
     "    result = []\n    for n in numbers:\n        if n % 2 == 0:\n            result.append(n * n)\n"
     "    return result\n"),
    ("Add error handling for a missing file to this function and return the whole function:",
     "import json\n\ndef load_config(path):\n    with open(path) as f:\n        config = json.load(f)\n"
     "    config['loaded'] = True\n    return config\n"),
]


def build_prompts(tokenizer, num_bench: int, num_edit: int) -> list[tuple[str, list[int]]]:
    """(name, token ids): ``num_bench`` evenly spaced benchmark prompts, then ``num_edit`` code-edit ones."""
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    step = max(1, len(prompts) // max(1, num_bench))
    out = [(f"bench{p['id']}-{p['kind']}-{p['family']}", list(p["token_ids"]))
           for p in prompts[::step][:num_bench]]
    for i, (instruction, code) in enumerate(EDIT_TASKS[:num_edit]):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}])
        out.append((f"edit{i}", tokenizer.encode(text)))
    return out


SPLIT_SALT = "deepinfer-spec-head-split/v1"
_GNU_LICENCES = ("common-licenses/GPL", "common-licenses/LGPL", "common-licenses/GFDL")


def group_key(source: str) -> str:
    """Near-duplicate group of a benchmark prompt's source: ``python-stdlib-docstrings/x.py`` (the docstrings of
    ``x.py``) joins ``python-stdlib/x.py``; the GNU licences (GPL, LGPL, GFDL: shared boilerplate) are one group."""
    if source.startswith(_GNU_LICENCES):
        return "common-licenses/GNU"
    return source.replace("python-stdlib-docstrings/", "python-stdlib/", 1)


def split_of(key: str, salt: str = SPLIT_SALT, train_fraction: float = 0.5) -> str:
    """``"train"`` or ``"test"``: a pure function of ``(salt, key)`` (SHA-256), independent of order and run."""
    bucket = int.from_bytes(hashlib.sha256(f"{salt}\0{key}".encode()).digest()[:8], "big") / 2.0 ** 64
    return "train" if bucket < train_fraction else "test"


def prompt_pool(tokenizer) -> list[tuple[str, str, list[int]]]:
    """(name, group key, token ids) of every benchmark prompt, then every code-edit task (names as in
    ``build_prompts``)."""
    out = [(f"bench{p['id']}-{p['kind']}-{p['family']}", group_key(p["source"]), list(p["token_ids"]))
           for p in json.loads(PROMPTS.read_text())["prompts"]]
    for i, (instruction, code) in enumerate(EDIT_TASKS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}])
        out.append((f"edit{i}", f"edit:{code}", tokenizer.encode(text)))
    return out


def split_pool(tokenizer, split: str, salt: str = SPLIT_SALT) -> list[tuple[str, list[int]]]:
    """(name, token ids) of the pool's prompts on side ``split`` (``"train"`` or ``"test"``), in pool order."""
    return [(name, ids) for name, key, ids in prompt_pool(tokenizer) if split_of(key, salt) == split]


def make_drafter(args: argparse.Namespace, target):
    """The drafter named by ``--drafter``; ``draft_model`` is ``shared/spec/draft_model.py`` on ``--draft``."""
    if args.drafter == "prompt_lookup":
        from shared.spec.prompt_lookup import PromptLookupDrafter
        return PromptLookupDrafter(max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    from shared.spec.draft_model import load_drafter
    return load_drafter(args.draft, target)


def label(drafted: list[int], output: list[int], i: int) -> list[bool]:
    """Acceptance of each drafted token at output position ``i``: equal to the target's and all before."""
    accepted, ok = [], True
    for j, tok in enumerate(drafted):
        ok = ok and i + j < len(output) and tok == output[i + j]
        accepted.append(ok)
    return accepted


def log_acceptance(drafter, prompt_ids: list[int], output: list[int], num_positions: int, k: int,
                   ended_by_eos: bool, alog: AcceptanceLog, stride: int = 1, batch: int = 32) -> dict[str, int]:
    """Draft at output positions ``0, stride, ...`` below ``num_positions``, log every drafted token; counts."""
    from shared.spec.types import DraftInput

    counts = {"positions": 0, "empty": 0, "skipped_eos": 0, "tokens": 0, "accepted": 0}
    seq = prompt_ids + output
    positions = list(range(0, min(num_positions, len(output)), stride))
    for lo in range(0, len(positions), batch):
        part = positions[lo:lo + batch]
        proposals = drafter.propose([DraftInput(f"s{i}", seq[:len(prompt_ids) + i]) for i in part], k)
        for i, proposal in zip(part, proposals):
            counts["positions"] += 1
            if not proposal.tokens:
                counts["empty"] += 1
                continue
            if ended_by_eos and i + len(proposal.tokens) > len(output):
                counts["skipped_eos"] += 1
                continue
            accepted = label(proposal.tokens, output, i)
            alog.record_proposal(proposal.features, accepted, drafter.name)
            counts["tokens"] += len(accepted)
            counts["accepted"] += sum(accepted)
    return counts


def target_outputs(engine, prompts: list[tuple[str, list[int]]], max_tokens: int,
                   cache: str | None) -> list[list[int]]:
    """The target's greedy outputs (``max_tokens`` each, or fewer ending in EOS), reused from ``cache`` when it
    holds exactly these prompts and ``max_tokens``."""
    from shared.sampling import SamplingParams

    key = {"max_tokens": max_tokens, "prompts": [ids for _, ids in prompts]}
    if cache and Path(cache).is_file():
        saved = json.loads(Path(cache).read_text())
        if saved.get("key") == key:
            log.info("target outputs from %s", cache)
            return saved["outputs"]
    t0 = time.perf_counter()
    outputs = engine.generate(key["prompts"], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    log.info("generated %d tokens for %d prompts in %.1f s", sum(map(len, outputs)), len(prompts),
             time.perf_counter() - t0)
    if cache:
        Path(cache).write_text(json.dumps({"key": key, "outputs": outputs}))
    return outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="spec_acceptance.jsonl", help="acceptance log to write (overwritten)")
    ap.add_argument("--drafter", default="prompt_lookup", choices=("prompt_lookup", "draft_model"))
    ap.add_argument("--split", choices=("train", "test"), default=None, help="log every prompt of this side of "
                    "the train/test split (then --num-prompts and --num-edit are ignored)")
    ap.add_argument("--num-prompts", type=int, default=24, help="prompts from data/engine_prompts.json")
    ap.add_argument("--num-edit", type=int, default=len(EDIT_TASKS), help=f"code-edit prompts (<= {len(EDIT_TASKS)})")
    ap.add_argument("--new-tokens", type=int, default=128, help="output positions drafted at per prompt")
    ap.add_argument("--k", type=int, default=5, help="drafted tokens per proposal")
    ap.add_argument("--draft", default="self:8", help="draft model for --drafter draft_model (self:N = the "
                    "target's first N layers, or a GGUF file / HF folder)")
    ap.add_argument("--stride", type=int, default=1, help="draft at every N-th output position (a slow drafter)")
    ap.add_argument("--max-ngram", type=int, default=4)
    ap.add_argument("--min-ngram", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="order of prompts in the log (the held-out split is the end)")
    ap.add_argument("--outputs", default=None, help="cache of the target's outputs (JSON; reused when it matches)")
    ap.add_argument("--head", default=None, help="also train a head on the log and write it here")
    ap.add_argument("--threshold", type=float, default=0.3)
    ap.add_argument("--l2", type=float, default=1.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", device="cpu", num_threads=args.threads))
    if args.split:
        prompts = split_pool(engine.tokenizer, args.split)
    else:
        prompts = build_prompts(engine.tokenizer, args.num_prompts, args.num_edit)
    random.Random(args.seed).shuffle(prompts)
    # k extra tokens: the labels of a proposal drafted at the last logged position
    outputs = target_outputs(engine, prompts, args.new_tokens + args.k, args.outputs)
    eos = set(engine.eos_token_ids)
    drafter = make_drafter(args, engine.model)
    totals: dict[str, int] = {}
    t0 = time.perf_counter()
    with AcceptanceLog(args.out, max_records=10_000_000, append=False) as alog:
        for (name, ids), output in zip(prompts, outputs):
            ended = bool(output) and output[-1] in eos
            counts = log_acceptance(drafter, ids, output, args.new_tokens, args.k, ended, alog, args.stride)
            log.info("%-24s prompt %4d output %3d: %s", name, len(ids), len(output), counts)
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
    proposals = totals["positions"] - totals["empty"] - totals["skipped_eos"]
    log.info("drafted in %.1f s; %s; %d proposals, %.3f drafted tokens accepted", time.perf_counter() - t0,
             totals, proposals, totals["accepted"] / max(1, totals["tokens"]))
    if args.head:
        from shared.spec import train_head
        targs = argparse.Namespace(log=args.out, out=args.head, threshold=args.threshold, l2=args.l2,
                                   holdout=0.2, drafter=drafter.name, json=False)
        raise SystemExit(train_head.run(targs, print))


if __name__ == "__main__":
    main()
