"""TTFT of a long context four ways, one run: cold (computed), device prefix hit, DRAM tier hit, SSD tier hit.

Starts a real cluster (nats-server, router, cache tier, one prefill and one decode process — or, with
``--prefill-workers 0 --mode local``, one aggregated worker with both cores) serving ``--model``
(default the packaged Gemma 3 270M, 32K context), and for each of ``--tokens`` (default 8,192 and 32,000) sends a
prompt of that many tokens (the engine benchmark prompts, cycled; a fresh first token per length) four times:

1. **cold**: nothing cached, the prefill worker computes it;
2. **device**: again, a hit in the prefill worker's own prefix cache;
3. **DRAM**: after both workers restarted (empty pools): the prefix comes from the tier's DRAM;
4. **SSD**: after the workers and the tier restarted (its DRAM is empty) with the tier's files dropped from the
   page cache (``posix_fadvise(DONTNEED)``): the prefix is read from its segment files.

After each restart a short unrelated request warms the new processes first (their first step's one-off costs are
not the tier's).

``--passkey`` puts a five-digit pass key at the start of the prompt and asks for it at the end (the prompt's
filler is the cycled benchmark prompts): the greedy answer shows whether the model still reads its whole context,
e.g. past the trained context under ``--rope-scaling`` (YaRN). ``--dtype`` and ``--rope-scaling`` are the
workers' flags.

Beside them: the bytes each hit moved (the tier's ``ssd_bytes_read`` for SSD; cached tokens x KV bytes per token
otherwise), the SSD read rate, and the disk's own ceiling measured on the tier's directory in the same run
(``dd`` with O_DIRECT, 1 GiB). Prints the cold / hit ratios beside the seed's price ratio (1/50). Checks the greedy
tokens are identical in all four cases.

    python -m benchmarks.long_context [--model gemma3-270m] [--tokens 8192,32000] [--mode remote|local]
    python -m benchmarks.long_context --model ~/.cache/deepinfer/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --tokens 77000 --dtype bfloat16 --passkey --rope-scaling \
        '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}'
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path

from benchmarks.tier_ttft import PROMPTS, restart, send
from cli.launcher import Cluster, ClusterSpec
from shared import protocol, subjects
from shared.bus import connect

SEED_HIT_PRICE_RATIO = 50.0   # the seed: a hit costs 1/50 of a miss


def cycled_prompt(tokens: int, salt: int) -> list[int]:
    """``tokens`` ids from the benchmark prompts, cycled, with a first id of its own (a cold prefix per length)."""
    pool = [t for p in json.loads(PROMPTS.read_text())["prompts"] for t in p["token_ids"]]
    ids = (pool * (tokens // len(pool) + 1))[:tokens]
    return [pool[0] + 1 + salt] + ids[1:]


PASSKEY = "71432"


def passkey_prompt(tokens: int, salt: int, model: str) -> tuple[list[int], str]:
    """``tokens`` ids: a pass key stated first, the cycled benchmark prompts as filler, the question last; and the
    answer a model that read the whole context gives."""
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(os.path.expanduser(model))
    head = tok.encode(f"Note {salt}: the pass key is {PASSKEY}. Remember it; you will be asked for it.\n\n")
    tail = tok.encode("\n\nWhat is the pass key stated at the start of this text? The pass key is", False)
    filler = cycled_prompt(tokens - len(head) - len(tail), salt)[1:]
    return head + filler + tail, PASSKEY


def drop_page_cache(directory: str) -> int:
    """Evict every file under ``directory`` from the page cache; returns their bytes."""
    total = 0
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += path.stat().st_size
            finally:
                os.close(fd)
    return total


def disk_ceiling(directory: str) -> dict[str, float]:
    """The disk's own sequential write and read rates (GB/s) on ``directory``: ``dd`` of 1 GiB with O_DIRECT."""
    target = os.path.join(directory, "dd-ceiling.bin")
    rates = {}
    try:
        for name, cmd in (("write", ["dd", "if=/dev/zero", f"of={target}", "bs=4M", "count=256", "oflag=direct"]),
                          ("read", ["dd", f"if={target}", "of=/dev/null", "bs=4M", "iflag=direct"])):
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
            m = re.search(r"([\d.]+) s, ", out)
            rates[name] = round((1 << 30) / float(m.group(1)) / 1e9, 2) if m else 0.0
    except (subprocess.CalledProcessError, OSError, ValueError) as err:
        logging.warning("dd on %s failed: %s", directory, err)
    finally:
        if os.path.exists(target):
            os.remove(target)
    return rates


async def tier_stats(url: str, service: str = "cache-0") -> dict:
    nc = await connect(url, "long-context")
    try:
        reply = await nc.request(subjects.stats(service), protocol.encode(protocol.StatsRequest()), timeout=10)
        return protocol.decode_reply(reply.data, protocol.StatsReply).stats
    finally:
        await nc.close()


async def run(args) -> dict:
    lengths = [int(x) for x in args.tokens.split(",")]
    if args.prefill_workers == 0 and args.mode == "remote":
        raise SystemExit("--prefill-workers 0 (one aggregated worker with every core) needs --mode local")
    cluster = Cluster(ClusterSpec(prefill=args.prefill_workers, decode=1, model=args.model, kv_cache_mb=args.kv_cache_mb,
                                  dtype=args.dtype, rope_scaling=args.rope_scaling,
                                  local_prefill_threshold=0, transports="shm,stream", cache_tier=1,
                                  cache_tier_dram_mb=args.tier_dram_mb, cache_tier_ssd_mb=args.tier_ssd_mb,
                                  http_port=-1, metrics=False))
    workers = ["prefill-0", "decode-0"] if args.prefill_workers else ["decode-0"]
    results = {"model": args.model, "mode": args.mode, "lengths": {}}
    await cluster.start()
    try:
        results["disk_gb_s"] = await asyncio.to_thread(disk_ceiling, cluster.spec.tier_dir(0))
        for i, n in enumerate(lengths):
            row, outputs = {}, set()
            prompt, answer = passkey_prompt(n, i, args.model) if args.passkey else (cycled_prompt(n, i), None)
            deadline = min(protocol.MAX_REQUEST_S, 600 + n / 25)  # a cold prefill at 25 tokens/s at worst
            for case in ("cold", "device", "dram", "ssd"):
                if case == "dram":
                    await restart(cluster, workers)
                elif case == "ssd":
                    await restart(cluster, workers + ["cache-0"])
                    row["page_cache_dropped_bytes"] = drop_page_cache(cluster.spec.tier_dir(0))
                if case in ("dram", "ssd"):   # warm the fresh processes on a short unrelated prompt first
                    await send(cluster.nats_url, [7 + i] * 64, args.mode, 1)
                before = await tier_stats(cluster.nats_url)
                t0 = time.perf_counter()
                ttft, tokens, usage = await send(cluster.nats_url, prompt, args.mode, args.new_tokens, deadline)
                after = await tier_stats(cluster.nats_url)
                outputs.add(tuple(tokens))
                puller = (await tier_stats(cluster.nats_url, "prefill-0" if args.mode == "remote" else "decode-0"))
                read = after["store"]["ssd_bytes_read"] - before["store"]["ssd_bytes_read"]
                row[case] = {"ttft_s": round(ttft, 3), "cached_tokens": usage.get("cached_tokens"),
                             "tier_cached_tokens": usage.get("tier_cached_tokens"), "ssd_bytes_read": read,
                             "block_pull_s": (puller.get("tier") or {}).get("block_pull_s"),
                             "wall_s": round(time.perf_counter() - t0, 3)}
            if len(outputs) != 1:
                raise RuntimeError(f"{n} tokens: greedy tokens differ between the four cases")
            if answer is not None:
                from shared.model.tokenizer import Tokenizer

                text = Tokenizer.from_gguf(os.path.expanduser(args.model)).decode(list(next(iter(outputs))))
                row["passkey"] = {"answer": text, "found": answer in text}
            ssd = row["ssd"]
            ssd["ssd_gb_s"] = round(ssd["ssd_bytes_read"] / ssd["ttft_s"] / 1e9, 3) if ssd["ttft_s"] else 0.0
            results["lengths"][n] = row
            logging.warning("%d tokens: %s", n, json.dumps(row))
    finally:
        await asyncio.to_thread(cluster.stop)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", default="8192,32000")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--mode", default="remote", choices=["remote", "local"])
    ap.add_argument("--kv-cache-mb", type=int, default=2048)
    ap.add_argument("--tier-dram-mb", type=int, default=4096)
    ap.add_argument("--tier-ssd-mb", type=int, default=16384)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefill-workers", type=int, default=1, choices=[0, 1],
                    help="0: one aggregated decode worker with every core (needs --mode local)")
    ap.add_argument("--rope-scaling", default="", metavar="JSON", help="the workers' --rope-scaling")
    ap.add_argument("--passkey", action="store_true", help="a pass key first, asked for last (GGUF models)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    res = asyncio.run(run(args))
    disk = res["disk_gb_s"]
    print(f"{res['model']}, {res['mode']} prefill; disk ceiling on the tier's directory (dd, O_DIRECT): "
          f"write {disk.get('write', 0):.2f} GB/s, read {disk.get('read', 0):.2f} GB/s")
    print(f"{'tokens':>7} {'case':<7} {'TTFT s':>8} {'cold/x':>7} {'cached':>7} {'tier':>7} {'SSD MB read':>11}")
    for n, row in res["lengths"].items():
        cold = row["cold"]["ttft_s"]
        for case in ("cold", "device", "dram", "ssd"):
            c = row[case]
            print(f"{n:>7} {case:<7} {c['ttft_s']:>8.3f} {cold / c['ttft_s']:>6.1f}x {c['cached_tokens'] or 0:>7} "
                  f"{c['tier_cached_tokens'] or 0:>7} {c['ssd_bytes_read'] / 1e6:>11.1f}")
        print(f"{'':>7} SSD read {row['ssd'].get('ssd_gb_s', 0):.2f} GB/s over its TTFT; the seed prices a hit at "
              f"1/{SEED_HIT_PRICE_RATIO:.0f} of a miss")
        if "passkey" in row:
            print(f"{'':>7} pass key {PASSKEY} {'found' if row['passkey']['found'] else 'NOT found'} in the answer "
                  f"{row['passkey']['answer']!r}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
