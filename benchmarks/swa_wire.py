"""SWA-aware hand-off and cache tier on the real Gemma 3 270M: KV bytes per request, both ways, full KV vs
SWA-aware, through the code the services run.

One request: a ``--context``-token prompt, prefilled in ``--chunk``-token chunks by a "prefill" engine (held),
handed off to a "decode" engine (``kv_source`` -> payload -> ``kv_port.unpack`` -> ``import_prefilled``), decoded
``--new-tokens`` greedy tokens; both engines write their computed blocks back to a tier (the cache tier's own
``to_blocks`` on a validated ``CachePut``, first writer wins per block); then the next turn (prompt + answer +
``--turn`` more tokens) asks the tier (``CacheGet`` -> ``fits`` / ``to_payload``) on a fresh engine and imports
what it serves. Printed per layout: hand-off bytes (prefill -> decode), tier bytes written (prefill and decode
write-backs), tier bytes served to the next turn, and the tokens the next turn found cached; greedy tokens of
the two layouts must agree.

    python -m benchmarks.swa_wire                      # 8K context (about 4 min on 2 CPU cores)
    python -m benchmarks.swa_wire --context 2048 --chunk 512
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cache_tier.blocks import fits, to_blocks, to_payload, window_mask
from shared import protocol
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.kv import block_pack
from shared.model.locate import resolve_model

BS = 16


def run(eng: LLMEngine, rid: str) -> list[int]:
    got = []
    while eng.has_unfinished():
        got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return got


def write_back(eng: LLMEngine, rid: str, first: int, tier: dict, writer: str) -> int:
    """The worker's write-back of ``rid``'s computed blocks from ``first`` on; returns the bytes put."""
    ids, chain, tokens = eng.kv_port.tier_blocks(rid, first)
    if not ids:
        return 0
    cache, rows, mask = eng.kv_port.source(rid, ids)
    payload = cache[torch.tensor(rows, dtype=torch.long)]
    put = protocol.CachePut(transfer_id=f"wb-{writer}", worker_id=writer, retention="chat",
                            block_hashes=list(chain.keys), block_digests=chain.packed_digests(),
                            model_fingerprint=chain.model_fingerprint, token_ids=tokens, block_size=BS,
                            dtype=str(payload.dtype).removeprefix("torch."), block_shape=eng.kv_port.block_shape,
                            transport="shm", handle={"x": 1}, full_layers=eng.kv_port.full_layers, window_mask=mask)
    for block in to_blocks(put, payload, writer):
        tier.setdefault(block.block_hash, block)          # first writer wins
    return payload.numel() * payload.element_size()


def tier_get(eng: LLMEngine, prompt: list[int], tier: dict) -> tuple[int, int]:
    """The next turn's pull: ``(bytes served, blocks imported into the prefix cache)``."""
    first, chain = eng.kv_port.missing_blocks(prompt)
    get = protocol.CacheGet(transfer_id="tg-next", worker_id="next", retention="chat",
                            block_hashes=list(chain.keys), block_digests=chain.packed_digests(),
                            model_fingerprint=chain.model_fingerprint, token_ids=prompt[:len(chain) * BS],
                            block_size=BS, dtype=str(eng.kv_port.kv_cache.dtype).removeprefix("torch."),
                            block_shape=eng.kv_port.block_shape, transports=["shm"], full_layers=eng.kv_port.full_layers)
    found = []
    for i, h in enumerate(get.block_hashes):
        block = tier.get(h)
        if block is None or not block.matches(prompt[i * BS:(i + 1) * BS], get.digests()[i], chain.model_fingerprint) \
                or not fits(block, get):
            break
        found.append(block)
    if not found:
        return 0, 0
    payload, mask = to_payload(found, get), window_mask(found, get)
    kv, has_window = eng.kv_port.unpack(payload, len(found), mask)
    return payload.numel() * payload.element_size(), eng.kv_port.import_tier_blocks(prompt, "", first, kv, has_window)


def one_layout(model, swa: bool, prompt: list[int], turn: list[int], args) -> dict:
    cfg = EngineConfig(block_size=BS, kv_cache_bytes=args.pool_mib << 20, swa_kv=swa, dtype="float32",
                       max_num_batched_tokens=args.chunk, device="cpu")
    tier: dict = {}
    pre = LLMEngine(model, cfg)
    t0 = time.perf_counter()
    rid = pre.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
    first = run(pre, rid)[0]
    prefill_s = time.perf_counter() - t0
    ids = pre.kv_port.prompt_block_ids(rid)
    cache, rows, mask = pre.kv_port.source(rid, ids, len(prompt))
    payload = cache[torch.tensor(rows, dtype=torch.long)]
    handoff = payload.numel() * payload.element_size()
    put_prefill = write_back(pre, rid, 0, tier, "prefill-0")
    pre.kv_port.release_held(rid)
    dec = LLMEngine(model, cfg)
    kv, _ = dec.kv_port.unpack(payload, len(ids), mask)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    assert dec.kv_port.import_prefilled("d", prompt, first, params, kv, hold_kv=True, model_fingerprint=pre.fingerprint)
    answer = [first] + run(dec, "d")
    put_decode = write_back(dec, "d", len(prompt) // BS, tier, "decode-0")
    dec.kv_port.release_held("d")
    nxt = LLMEngine(model, cfg)
    served, imported = tier_get(nxt, prompt + answer + turn, tier)
    return {"handoff": handoff, "put_prefill": put_prefill, "put_decode": put_decode, "served": served,
            "cached": imported * BS, "answer": answer, "prefill_s": prefill_s, "blocks": len(ids),
            "window_blocks_sent": sum(block_pack.decode_mask(mask, len(ids)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--pool-mib", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    probe = LLMEngine.from_path(resolve_model("gemma3-270m"), EngineConfig(num_kv_blocks=16, dtype="float32",
                                                                           device="cpu"))
    model, vocab = probe.model, probe.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, min(vocab, 200000), (args.context,), generator=gen).tolist()
    turn = torch.randint(1000, min(vocab, 200000), (args.turn,), generator=gen).tolist()
    rows = {swa: one_layout(model, swa, prompt, turn, args) for swa in (False, True)}
    mib = 2 ** 20
    full, swa = rows[False], rows[True]
    print(f"Gemma 3 270M, fp32 KV, block {BS}, prompt {args.context} tokens (prefill chunks of {args.chunk}), "
          f"{args.new_tokens} new tokens, next turn +{args.turn} tokens")
    print(f"{'layout':<12}{'hand-off MiB':>14}{'tier put MiB (prefill + decode)':>34}{'tier get MiB':>14}"
          f"{'next turn cached':>18}{'prefill s':>11}")
    for name, r in (("full KV", full), ("SWA-aware", swa)):
        print(f"{name:<12}{r['handoff'] / mib:>14.1f}{(r['put_prefill'] + r['put_decode']) / mib:>22.1f}"
              f" ({r['put_prefill'] / mib:.1f} + {r['put_decode'] / mib:.1f}){r['served'] / mib:>14.1f}"
              f"{r['cached']:>18d}{r['prefill_s']:>11.1f}")
    put = {k: r["put_prefill"] + r["put_decode"] for k, r in rows.items()}
    print(f"hand-off: {full['handoff'] / swa['handoff']:.2f}x fewer bytes ({swa['window_blocks_sent']} of "
          f"{swa['blocks']} blocks carry window rows); tier put {put[False] / max(1, put[True]):.2f}x; "
          f"tier get {full['served'] / max(1, swa['served']):.2f}x")
    print(f"greedy tokens identical: {full['answer'] == swa['answer']}")


if __name__ == "__main__":
    main()
