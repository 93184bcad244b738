"""A 3-host deepinfer cluster vs the same services on one host, same work and cores (as root: simulated hosts).

Both layouts run ``deepinfer node`` inside simulated hosts (``tests/cluster/netns.py``) with the default model
and the bench prompts (``benchmarks/data/engine_prompts.json``, all sent at once over NATS by a client on the
router's host, greedy, ``ignore_eos``):

- ``one host``: router + cache tier + 1 prefill + 1 decode in one host (``deepinfer up``'s default layout;
  the node splits the 2 CPUs between its engines, 1 thread each);
- ``three hosts``: router + cache tier on ``a``, prefill on ``b`` (CPU 0), decode on ``c`` (CPU 1): KV hand-offs
  and tier transfers cross hosts (veth links, UCX held to TCP).

Reported: requests ok, output tok/s over the wall time, TTFT p50/p99 (the router's, from usage), and the ratio
three hosts / one host.

    python -m benchmarks.multi_host [--limit 32] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tests.cluster.multi_host import MultiHostCluster
from tests.cluster.netns import SimulatedHosts

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"
LAYOUTS = {
    "one host": ({"a": ["--router", "--cache-tier", "1", "--prefill", "1", "--decode", "1"]}, {}),
    "three hosts": ({"a": ["--router", "--cache-tier", "1"], "b": ["--prefill", "1", "--tier", "cache-a-0"],
                     "c": ["--decode", "1", "--tier", "cache-a-0"]}, {"b": "0", "c": "1"}),
}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_layout(name: str, jobs: list[dict], new_tokens: int) -> dict:
    roles, cpus = LAYOUTS[name]
    with SimulatedHosts(list(roles)) as hosts, tempfile.TemporaryDirectory() as tmp:
        cluster = MultiHostCluster(hosts, Path(tmp), None, roles, dtype="float32", cpus=cpus,
                                   extra=["--kv-cache-mb", "256", "--local-prefill-threshold", "64"])
        try:
            cluster.start(timeout_s=600)
            cluster.client("a", jobs[:2], "warm").results()            # load paths, first transfers
            t0 = time.perf_counter()
            results = cluster.client("a", jobs, "bench", timeout_s=600).results(timeout_s=900)
            wall = time.perf_counter() - t0
        finally:
            cluster.stop()
    ok = [r for r in results if r["completed"]]
    ttft = [r["usage"]["ttft_ms"] / 1e3 for r in ok]
    return {"ok": len(ok), "sent": len(jobs), "tok_s": sum(len(r["tokens"]) for r in ok) / wall, "wall": wall,
            "ttft_p50": pct(ttft, 0.5) if ttft else float("nan"), "ttft_p99": pct(ttft, 0.99) if ttft else float("nan"),
            "tokens": {r["request_id"]: r["tokens"] for r in ok}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    prompts = [p["token_ids"] for p in json.loads(PROMPTS.read_text())["prompts"][:args.limit]]
    jobs = [{"request_id": f"b{i}", "prompt_token_ids": p, "max_tokens": args.new_tokens} for i, p in enumerate(prompts)]
    rows = {name: run_layout(name, jobs, args.new_tokens) for name in LAYOUTS}
    same = rows["one host"]["tokens"] == rows["three hosts"]["tokens"]
    print(f"\n{len(jobs)} bench prompts x {args.new_tokens} tokens, all at once, greedy; {os.cpu_count()} CPUs; "
          f"outputs identical across layouts: {same}")
    hdr = f"{'layout':<14}{'ok':>8}{'out tok/s':>11}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'wall s':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows.items():
        print(f"{name:<14}{r['ok']:>4}/{r['sent']:<3}{r['tok_s']:11.1f}{r['ttft_p50']:12.2f}{r['ttft_p99']:12.2f}"
              f"{r['wall']:8.1f}")
    one, three = rows["one host"], rows["three hosts"]
    print(f"three hosts / one host: throughput {three['tok_s'] / one['tok_s']:.2f}x, "
          f"TTFT p50 {three['ttft_p50'] / one['ttft_p50']:.2f}x, p99 {three['ttft_p99'] / one['ttft_p99']:.2f}x")


if __name__ == "__main__":
    main()
