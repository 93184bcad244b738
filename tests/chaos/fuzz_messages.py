"""A deterministic generator of hostile NATS messages for every subject a client can reach.

``Fuzzer(seed, ...).messages(n)`` yields ``FuzzMessage(subject, data, reply, kind)``; the same seed and
arguments give the same sequence. Kinds: ``random_bytes``, ``truncated`` / ``garbled`` / ``trailing`` (a
valid message's bytes cut, flipped or extended), ``msgpack_bombs`` (declared lengths far beyond the body,
deep nesting, ext types), ``not_a_map``, ``bad_envelope`` (wrong or missing ``v`` / ``type``), ``mutated``
(a real message type with one to three fields or nested values replaced by huge or negative ints, wrong
types, NaN/inf, long strings, huge lists, extra or missing fields) and ``valid`` (well-formed, cheap).

Invariant: whatever the mutation, a message that the cluster would accept as work is cheap (``bounded``):
at most ``MAX_WORK_TOKENS`` new tokens (or, for a client request, a timeout of at most ``SHORT_TIMEOUT_S``
that the router enforces) and a prompt either short or past the context window (rejected at once).

The cache tier's subjects and messages come from ``tests/chaos/fuzz_cache.py`` (when ``tiers`` are given).

Request ids come from a small pool (``fz-<k>``, and the workers' ``fz-<k>~<attempt>``) so duplicates, cancels
of live requests and pulls of live ``stream`` transfers (``kvx.prefill-0.fz-<k>~0``) happen.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from shared import protocol, subjects
from shared.errors import DeepinferError
from tests.chaos.fuzz_cache import FAMILY_TYPES, FAMILY_WEIGHTS, TierBlocks, cache_base, cache_subjects
from tests.chaos.fuzz_mutations import Mutations

MAX_WORK_TOKENS = 8
SHORT_TIMEOUT_S = 1.5
SHORT_PROMPT = 512
ID_POOL = 48
MAX_PAYLOAD = 8 * 1024 * 1024 - 4096  # the test server's max_payload, minus the protocol line

ITEM_BYTES = {"float64": 8, "float32": 4, "int64": 8, "int32": 4}


@dataclasses.dataclass(frozen=True, slots=True)
class FuzzMessage:
    subject: str
    data: bytes
    reply: str | None
    kind: str


class Fuzzer(Mutations):
    """``workers``: the cluster's ids (router, prefill and decode); ``block_shape`` / ``dtype``: its KV layout
    (one block); ``prompt_tokens(request)``: how many tokens the router makes of a text or chat prompt (without
    it, text prompts over 100 characters count as costly); ``tiers``: its cache tiers' ids; ``tier_blocks``:
    blocks stored in the first tier, for fuzzed gets that hit."""

    def __init__(self, seed: int, *, workers: list[str], vocab: int, block_shape: list[int], dtype: str,
                 max_model_len: int, prompt_tokens: Callable[[protocol.GenerateRequest], int] | None = None,
                 tiers: list[str] = (), tier_blocks: TierBlocks | None = None) -> None:
        self.rng = random.Random(seed)
        self.workers = list(workers)
        self.vocab, self.block_shape, self.dtype = vocab, list(block_shape), dtype
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.fake_workers = ["decode-7", "prefill-9", "ghost", "router-2", "x" * 128]
        self.tiers, self.tier_blocks = list(tiers), tier_blocks
        self.redraws = 0   # drawn messages replaced because they were costly work
        self._n = 0
        self.subjects = self._subjects()
        families = {f for _, f in self.subjects}
        self.families = [f for f in self._FAMILY_WEIGHTS if f in families]
        self.family_weights = [self._FAMILY_WEIGHTS[f] for f in self.families]

    # ---- subjects ------------------------------------------------------------------------------------------
    def _subjects(self) -> list[tuple[str, str]]:
        """(subject, the message family it expects)."""
        out = [(subjects.GENERATE, "generate"), (subjects.CANCEL, "cancel")]
        for w in self.workers:
            out.append((subjects.kv_events(w), "kv_event"))
            role = w.split("-")[0] if w.split("-")[0] in ("prefill", "decode", "router") else "decode"
            out += [(subjects.load(w, role), "load"), (subjects.prefill(w), "prefill"), (subjects.decode(w), "decode"),
                    (subjects.ctl(w, "kv_snapshot"), "ctl")]
        prefillers = [w for w in self.workers if w.startswith("prefill")] or self.workers[:1]
        for k in range(0, ID_POOL, 6):  # live `stream` transfers of the pool's ids, and ones that never exist
            out.append((subjects.kv_pull(prefillers[0], subjects.safe_token(f"fz-{k}~0")), "kvx"))
        out += [(subjects.kv_pull("nobody", "fz-1~0"), "kvx"), (subjects.kv_pull("x" * 128, "y" * 128), "kvx")]
        if self.tiers:
            out += cache_subjects(self.workers, self.tiers, ID_POOL)
        return out

    # ---- small pieces --------------------------------------------------------------------------------------
    def _rid(self) -> str:
        r = self.rng.random()
        k = self.rng.randrange(ID_POOL)
        if r < 0.6:
            return f"fz-{k}"
        if r < 0.9:
            return f"fz-{k}~{self.rng.randrange(3)}"
        return self.rng.choice(["", "~", "a.b", "*", ">", " ", "x" * 300, "é\u202e", "\x00"])

    def _inbox(self) -> str:
        self._n += 1
        return f"_INBOX.fz.{self._n}"

    def _tokens(self, lo: int = 1, hi: int = 40) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(lo, hi))]

    def _text(self, lo: int = 1, hi: int = 60) -> str:
        alphabet = "abcdefgh ijklmnop.,!?\n\t<>{}|*~é中🙂\u200b"
        return "".join(self.rng.choice(alphabet) for _ in range(self.rng.randint(lo, hi)))

    def _sampling(self) -> dict[str, Any]:
        d: dict[str, Any] = {"max_tokens": self.rng.randint(1, 4), "temperature": self.rng.choice([0.0, 0.0, 0.8]),
                             "ignore_eos": self.rng.random() < 0.5}
        if self.rng.random() < 0.3:
            d.update(top_k=self.rng.choice([0, 1, 5]), top_p=self.rng.choice([1.0, 0.9]), seed=self.rng.randrange(99))
        if self.rng.random() < 0.2:
            d.update(stop=["a"], stop_token_ids=[self.rng.randrange(self.vocab)], min_tokens=1)
        return d

    def _worker(self, role: str) -> str:
        real = [w for w in self.workers if w.startswith(role)]
        return self.rng.choice(real) if real and self.rng.random() < 0.8 else self.rng.choice(self.fake_workers)

    def _handle(self, transport: str, num_blocks: int) -> dict[str, Any]:
        shape = [num_blocks, *self.block_shape]
        nbytes = math.prod(shape) * ITEM_BYTES.get(self.dtype, 2)
        if transport == "stream":
            k = self.rng.randrange(ID_POOL)
            subject = subjects.kv_pull(self._worker("prefill"), subjects.safe_token(f"fz-{k}~0"))
            return {"transport": "stream", "subject": subject, "chunk": 1 << 20, "chunks": -(-nbytes // (1 << 20)),
                    "nbytes": nbytes, "dtype": self.dtype, "shape": shape}
        return {"transport": transport, "segment": f"psm_fz{self.rng.randrange(1000)}",
                "token": self.rng.randrange(1, 2**63),
                "offset": 4096, "nbytes": nbytes, "dtype": self.dtype, "shape": shape}

    # ---- valid bases, one per message type -----------------------------------------------------------------
    def base(self, type_name: str) -> dict[str, Any]:
        """A well-formed, cheap message of ``type_name`` as a dict (without ``v`` / ``type``)."""
        rng = self.rng
        if type_name == "GenerateRequest":
            d: dict[str, Any] = {"request_id": self._rid() if rng.random() < 0.7 else "",
                                 "max_tokens": rng.randint(1, 4), "temperature": rng.choice([0.0, 0.7]),
                                 "timeout_s": rng.choice([1.0, 3.0, 5.0]), "ignore_eos": rng.random() < 0.5}
            form = rng.randrange(3)
            if form == 0:
                d["prompt"] = self._text()
            elif form == 1:
                d["messages"] = [{"role": rng.choice(["user", "system", "assistant"]), "content": self._text()}
                                 for _ in range(rng.randint(1, 3))]
            else:
                d["prompt_token_ids"] = self._tokens()
            if rng.random() < 0.5:
                d["prefill_mode"] = rng.choice(["auto", "remote", "local"])
            if rng.random() < 0.5:
                d["transport"] = rng.choice(["shm", "stream", "nixl", "cuda_ipc", "pigeon"])
            if rng.random() < 0.2:
                d.update(seed=rng.randrange(1000), top_k=rng.randrange(5), top_p=0.9, cache_salt="s",
                         stop=["x"], stop_token_ids=[5], min_tokens=1,
                         model=rng.choice(["", "default", "tiny-llama", "nope"]))
            return d
        if type_name in ("PrefillRequest", "DecodeLocalRequest", "KVHandoff"):
            prompt = self._tokens(1, 60)
            d = {"request_id": self._rid() or "fz-0", "prompt_token_ids": prompt, "sampling": self._sampling(),
                 "reply_to": self._inbox(), "cache_salt": rng.choice(["", "", "salt"])}
            if type_name == "PrefillRequest":
                d.update(decode_worker=self._worker("decode"),
                         transport=rng.choice(["shm", "stream", "stream", "nixl"]),
                         deadline_s=rng.choice([0.0, 1.0, 3.0, -5.0]))
            elif type_name == "DecodeLocalRequest":
                d["deadline_s"] = rng.choice([1.0, 3.0, 60.0])
            else:
                transport = rng.choice(["shm", "stream"])
                num_blocks = -(-len(prompt) // self.block_shape[3])
                d.update(first_token=rng.randrange(self.vocab), num_blocks=num_blocks, block_shape=self.block_shape,
                         dtype=self.dtype, transport=transport, handle=self._handle(transport, num_blocks),
                         num_cached_tokens=0, ttft_ms=1.0, prefill_worker=self._worker("prefill"))
            return d
        if type_name in ("CachePut", "CacheGet", "CacheRelease", "StatsRequest"):
            return cache_base(self, type_name)
        if type_name == "CancelRequest":
            return {"request_id": self._rid() or "fz-1"}
        if type_name == "LoadReport":
            wid = rng.choice(self.workers + self.fake_workers)
            role = wid.split("-")[0] if wid.split("-")[0] in protocol.ROLES else rng.choice(protocol.ROLES)
            return {"worker_id": wid, "role": role, "model_id": rng.choice(["tiny-llama", "", "other"]),
                    "num_running": rng.randrange(5), "num_waiting": rng.randrange(5), "kv_usage": rng.random(),
                    "num_free_blocks": rng.randrange(500), "num_total_blocks": 512, "block_size": 16,
                    "transports": rng.choice([["shm", "stream"], ["stream"], [], ["pigeon"]]), "host": "fuzzhost",
                    "timestamp": 1.0e9, "queued_prefill_tokens": rng.randrange(100),
                    "kv_event_seq": rng.choice([0, 1, 5, 10**6])}
        if type_name == "KVEvent":
            return {"worker_id": rng.choice(self.workers + self.fake_workers),
                    "seq": rng.choice([0, 1, 2, 3, 50, 10**9]),
                    "kind": rng.choice(protocol.KV_EVENT_KINDS),
                    "block_hashes": [rng.randrange(2**64) for _ in range(rng.randint(0, 20))],
                    "tier": rng.choice(["device", "device", "host", "disk", "cache_tier"])}
        if type_name == "KVSnapshot":
            return {"worker_id": rng.choice(self.workers), "seq": rng.randrange(10), "block_hashes": [1, 2, 3]}
        if type_name == "TokenChunk":
            return {"request_id": self._rid() or "fz-2", "seq": rng.randrange(3), "token_ids": [5], "text": "a",
                    "final": True, "finish_reason": "stop", "usage": {"prompt_tokens": 1}}
        if type_name == "WorkerInfo":
            return {"worker_id": rng.choice(self.workers + self.fake_workers), "role": "decode",
                    "model_id": "tiny-llama",
                    "host": "h", "pid": 1, "transports": ["shm"], "block_size": 16, "started_at": 0.0}
        if type_name == "ErrorReply":
            return {"code": rng.choice(["internal", "worker_lost", "nope"]), "message": "fuzz"}
        return {"ok": rng.random() < 0.5, "detail": "fuzz"}  # Ack

    _FAMILY_WEIGHTS = {"generate": 15, "cancel": 8, "kv_event": 10, "load": 12, "prefill": 15, "decode": 15,
                       "ctl": 8, "kvx": 10, **FAMILY_WEIGHTS}
    _FAMILY_TYPES = {"generate": ["GenerateRequest"], "cancel": ["CancelRequest"], "kv_event": ["KVEvent"],
                     "load": ["LoadReport"], "prefill": ["PrefillRequest"],
                     "decode": ["KVHandoff", "DecodeLocalRequest"], "ctl": ["KVSnapshot", "CancelRequest"],
                     "kvx": ["Ack"], **FAMILY_TYPES}

    def _type_for(self, family: str) -> str:
        if self.rng.random() < 0.8:
            return self.rng.choice(self._FAMILY_TYPES[family])
        return self.rng.choice(sorted(protocol.MESSAGE_TYPES))

    # ---- encodings -----------------------------------------------------------------------------------------
    @staticmethod
    def _pack(d: dict[str, Any], type_name: str | None, v: Any = protocol.PROTOCOL_VERSION) -> bytes:
        body = {"v": v, "type": type_name, **d} if type_name is not None else d
        return msgpack.packb(body, use_bin_type=True)

    def one(self) -> FuzzMessage:
        """The next message (redrawn until it is bounded work)."""
        while True:
            msg = self._draw()
            if self.bounded(msg.data):
                return msg
            self.redraws += 1

    def _draw(self) -> FuzzMessage:
        rng = self.rng
        family = rng.choices(self.families, self.family_weights)[0]
        subject = rng.choice([s for s, f in self.subjects if f == family])
        r = rng.random()
        reply = self._inbox() if r < 0.6 else None if r < 0.85 else rng.choice(
            [subjects.GENERATE, subjects.CANCEL, subjects.kv_events("fz"), subjects.load("router", "router"),
             subjects.decode(self.workers[-1]), "_INBOX.x", "fz"])
        if family == "kvx" and rng.random() < 0.7:  # a pull body: {"i": chunk}
            i = rng.choice([0, 1, 2, -1, 2**63 - 1, "0", None, 0.5, math.nan, math.inf, [], {"j": 1}])
            body = {"i": i} if rng.random() < 0.9 else {"j": 0}
            data = msgpack.packb(body) if rng.random() < 0.8 else rng.randbytes(rng.randrange(20))
            return FuzzMessage(subject, data, reply if rng.random() < 0.2 else self._inbox(), "kvx_pull")
        if family == "ctl" and rng.random() < 0.5:
            return FuzzMessage(subject, rng.choice([b"", b"\x00", rng.randbytes(100)]), reply, "ctl_body")
        type_name = self._type_for(family)
        d = self.base(type_name)
        r = rng.random()
        if r < 0.05:
            return FuzzMessage(subject, self._pack(d, type_name), reply, "valid")
        if r < 0.3:
            valid = self._pack(d, type_name)
            data, kind = self._bytes_kind(valid)
            return FuzzMessage(subject, data, reply, kind)
        if r < 0.4:
            v = rng.choice([0, 2, -1, 2**64 - 1, "1", 1.0, True, None, [1], {"v": 1}])
            t = rng.choice([type_name, "generaterequest", "", "Nope", None, 1, ["GenerateRequest"], "WireModel",
                            "__init__", "x" * 1000])
            body = {"type": t, **d} if rng.random() < 0.5 else {"v": v, **d}
            if rng.random() < 0.5:
                body["v"], body["type"] = v, t
            return FuzzMessage(subject, msgpack.packb(body, use_bin_type=True), reply, "bad_envelope")
        self._mutate(d)
        try:
            data = self._pack(d, type_name)
        except (OverflowError, TypeError, ValueError):
            data = self._pack(self.base(type_name), type_name)
        if len(data) > MAX_PAYLOAD:
            data = data[:MAX_PAYLOAD]
        return FuzzMessage(subject, data, reply, "mutated")

    # ---- the cost guard ------------------------------------------------------------------------------------
    def _prompt_ok(self, n: int) -> bool:
        return n <= SHORT_PROMPT or n >= self.max_model_len

    def bounded(self, data: bytes) -> bool:
        """False if the cluster would accept ``data`` as work that is not cheap (see the module invariant)."""
        try:
            msg = protocol.decode(data)
        except DeepinferError:
            return True
        if isinstance(msg, protocol.GenerateRequest):
            if msg.max_tokens > MAX_WORK_TOKENS and (msg.timeout_s or protocol.MAX_REQUEST_S) > SHORT_TIMEOUT_S:
                return False
            if msg.prompt_token_ids is not None:
                return self._prompt_ok(len(msg.prompt_token_ids))
            if self.prompt_tokens is None:
                return len(msg.prompt or "") + sum(len(m.get("content", "")) for m in msg.messages or []) <= 100
            try:
                return self._prompt_ok(self.prompt_tokens(msg))
            except Exception:  # the router cannot tokenize it either: it answers with an error
                return True
        if isinstance(msg, (protocol.PrefillRequest, protocol.DecodeLocalRequest, protocol.KVHandoff)):
            sampling = msg.sampling  # a dict or a nested wire message, depending on the protocol version
            max_tokens = sampling.get("max_tokens", 256) if isinstance(sampling, dict) else sampling.max_tokens
            return (isinstance(max_tokens, int) and max_tokens <= MAX_WORK_TOKENS
                    and self._prompt_ok(len(msg.prompt_token_ids)))
        return True

    def messages(self, n: int) -> Iterator[FuzzMessage]:
        for _ in range(n):
            yield self.one()
