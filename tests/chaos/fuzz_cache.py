"""The cache tier's part of the chaos fuzz (``fuzz_messages.Fuzzer`` draws from it).

- ``cache_subjects(services, tiers, pool)``: (subject, family) of what a client can reach on a tier: its
  put/get/release/stats operations, its load and snapshot subjects, the ``stream`` pulls of its staged gets
  (transfer ids from the fuzzer's id pool), and every service's ``subjects.stats``.
- ``cache_base(fz, type_name)``: a cheap, well-formed ``CachePut`` / ``CacheGet`` / ``CacheRelease`` /
  ``StatsRequest`` (without ``v`` / ``type``). Puts name handles of the pool's transfers (live prefill ones
  included) or of none; gets ask random hashes or, when the fuzzer knows ``TierBlocks``, a leading run of
  blocks the tier really holds, so hits are staged (and released, or left to the tier's TTL).
- ``seed_tier`` / ``served_exactly``: store ``TierBlocks`` through the ``stream`` transport before the fuzzing,
  and check afterwards that the tier still serves them byte for byte (hostile input changed nothing stored).
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Any

import torch

from shared import protocol, subjects
from shared.kv.transport import parse_dtype
from shared.kv.transport_stream import StreamTransport

FAMILY_TYPES = {"cache_put": ["CachePut"], "cache_get": ["CacheGet"], "cache_release": ["CacheRelease"],
                "stats": ["StatsRequest"]}
FAMILY_WEIGHTS = {"cache_put": 6, "cache_get": 6, "cache_release": 3, "stats": 5}
SEED_BLOCKS, SEED_BLOCK_SIZE = 3, 4
CLIENT = "fuzz-seed"


@dataclasses.dataclass(frozen=True)
class TierBlocks:
    """Blocks stored in a tier before the fuzzing: hashes in order, their tokens, layout and KV."""
    tier: str
    hashes: list[int]
    token_ids: list[int]
    dtype: str
    block_shape: list[int]
    kv: torch.Tensor            # [len(hashes), *block_shape]

    def get(self, transfer_id: str, n: int, transports: list[str], host: str = "") -> dict[str, Any]:
        """A ``CacheGet`` body for the first ``n`` blocks."""
        return {"transfer_id": transfer_id, "worker_id": CLIENT, "retention": "chat", "block_hashes": self.hashes[:n],
                "token_ids": self.token_ids[:n * SEED_BLOCK_SIZE], "block_size": SEED_BLOCK_SIZE,
                "dtype": self.dtype, "block_shape": self.block_shape, "transports": transports, "host": host}


def cache_subjects(services: list[str], tiers: list[str], pool: int) -> list[tuple[str, str]]:
    out = []
    for t in tiers:
        out += [(subjects.cache_put(t, "fuzz"), "cache_put")]
        out += [(subjects.cache(op, t), f"cache_{op}") for op in ("get", "release")]
        out += [(subjects.cache("stats", t), "stats"), (subjects.load(t, "cache_tier"), "load"),
                (subjects.ctl(t, "kv_snapshot"), "ctl")]
        out += [(subjects.kv_pull(t, f"fz-{k}"), "kvx") for k in range(0, pool, 6)]
    return out + [(subjects.stats(s), "stats") for s in [*services, *tiers]]


def cache_base(fz, type_name: str) -> dict[str, Any]:
    """A well-formed, cheap cache-tier message; ``fz`` is the ``Fuzzer`` (its rng, ids, layout, handles)."""
    rng = fz.rng
    if type_name == "StatsRequest":
        return {}
    if type_name == "CacheRelease":
        return {"transfer_id": fz._rid() or "fz-3"}
    transports = rng.choice([["stream"], ["shm", "stream"], ["shm"], ["nixl", "stream"], ["pigeon"]])
    host = rng.choice(["", socket.gethostname(), "elsewhere"])
    if type_name == "CacheGet" and fz.tier_blocks is not None and rng.random() < 0.6:
        blocks = fz.tier_blocks
        return blocks.get(fz._rid() or "fz-4", rng.randint(1, len(blocks.hashes)), transports, host)
    n, block_size = rng.randint(1, 4), rng.choice([4, 8, 16])
    d: dict[str, Any] = {"transfer_id": fz._rid() or "fz-5", "worker_id": fz._worker(rng.choice(["prefill", "decode"])),
                         "retention": rng.choice(["chat", "chat", "agent", "none", "forever"]),
                         "block_hashes": [rng.randrange(2**64) for _ in range(n)],
                         "token_ids": [rng.randrange(fz.vocab) for _ in range(n * block_size)],
                         "block_size": block_size, "dtype": fz.dtype, "block_shape": list(fz.block_shape),
                         "tenant": rng.choice(["", "", "acme"])}
    if type_name == "CachePut":
        transport = rng.choice(["stream", "stream", "shm"])
        d.update(transport=transport, handle=fz._handle(transport, n))
    else:
        d.update(transports=transports, host=host)
    return d


async def seed_tier(nc, tier: str, dtype: str, block_shape: list[int], seed: int) -> TierBlocks:
    """Put ``SEED_BLOCKS`` blocks of random KV into ``tier`` (hashes no fuzzed message names by chance)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((SEED_BLOCKS, *block_shape), generator=gen).to(parse_dtype(dtype))   # [n, *block_shape]
    hashes = [int(h) for h in torch.randint(1, 2**62, (SEED_BLOCKS,), generator=gen)]
    blocks = TierBlocks(tier, hashes, list(range(7, 7 + SEED_BLOCKS * SEED_BLOCK_SIZE)), dtype, list(block_shape), kv)
    sender = StreamTransport(nc, CLIENT)
    try:
        handle = await sender.stage(kv, "seed")
        put = protocol.CachePut(transfer_id="seed", worker_id=CLIENT, retention="chat", block_hashes=hashes,
                                token_ids=blocks.token_ids, block_size=SEED_BLOCK_SIZE, dtype=dtype,
                                block_shape=list(block_shape), transport="stream", handle=handle)
        reply = await nc.request(subjects.cache_put(tier, put.worker_id), protocol.encode(put), timeout=10)
        protocol.decode_reply(reply.data, protocol.Ack)
    finally:
        await sender.close()
    return blocks


async def served_exactly(nc, blocks: TierBlocks, transfer_id: str) -> bool:
    """Whether the tier serves all of ``blocks`` with exactly the bytes stored."""
    get = protocol.CacheGet(**blocks.get(transfer_id, len(blocks.hashes), ["stream"]))
    reply = await nc.request(subjects.cache("get", blocks.tier), protocol.encode(get), timeout=10)
    got = protocol.decode_reply(reply.data, protocol.CacheGetReply)
    if got.num_blocks != len(blocks.hashes):
        return False
    receiver = StreamTransport(nc, f"{CLIENT}-r")
    try:
        return torch.equal(await receiver.fetch(got.handle, timeout=10), blocks.kv)
    finally:
        await receiver.close()
        await nc.publish(subjects.cache("release", blocks.tier),
                         protocol.encode(protocol.CacheRelease(transfer_id=transfer_id)))
