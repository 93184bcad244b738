"""The cluster's control-plane wire messages: heartbeats (``LoadReport``), registry entries (``WorkerInfo``), KV
events and snapshots for the router's KV index, and request probes. Same codec and rules as every message
(``shared.wire_validation``); import them from ``shared.protocol``, which re-exports them."""
from __future__ import annotations

import math

from shared.wire_fields import check_fingerprint, check_id, check_one_of, check_range, check_worker, require
from shared.wire_validation import MAX_MESSAGE_BYTES, WireModel, wire_message

MAX_CONTROL_BYTES = 64 * 1024         # acks, errors, heartbeats, registry entries

ROLES = ("prefill", "decode", "router", "draft", "cache_tier")
KV_EVENT_KINDS = ("stored", "removed", "cleared")
KV_TIERS = ("device", "host", "disk", "cache_tier")  # a worker's pool, its host memory, its disk, the cache tier


@wire_message(MAX_CONTROL_BYTES)
class RequestProbe(WireModel):
    """Router -> worker on ``subjects.ctl(worker, "probe")``: do you still hold ``request_id``? The reply is an
    ``Ack`` whose ``ok`` says so (a stream whose chunks stopped while no worker holds it lost its end in
    transit)."""
    request_id: str

    def _check(self) -> None:
        check_id("request_id", self.request_id)


@wire_message(MAX_CONTROL_BYTES)
class MigrateRequest(WireModel):
    """Move a running stream to another decode worker (live migration). Router -> the decode worker running
    ``request_id`` on ``subjects.ctl(worker, "migrate")``: hand it to ``target`` over ``transport``; the reply
    (an ``Ack`` naming the target, or an ``ErrorReply``) comes once the target runs it, or the source runs it
    again. Operator -> router on ``subjects.ctl(router, "migrate")``: ``request_id`` is the client's, ``target``
    may be "" (the router picks the least loaded decode worker of the stream's build), ``transport`` is ""."""
    request_id: str
    target: str = ""
    transport: str = ""

    def _check(self) -> None:
        check_id("request_id", self.request_id)
        if self.target:
            check_worker("target", self.target)
        check_id("transport", self.transport, allow_empty=True)


@wire_message(MAX_CONTROL_BYTES)
class LoadReport(WireModel):
    """Heartbeat on ``subjects.load(worker_id)``: queue and KV-memory metrics. ``model_fingerprint``: the build
    whose KV the worker computes (the router groups workers by it; "" for services without a model)."""
    worker_id: str
    role: str
    model_id: str
    num_running: int
    num_waiting: int
    kv_usage: float                 # fraction of KV blocks in use, [0, 1]
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    transports: list[str]
    host: str
    timestamp: float
    queued_prefill_tokens: int = 0  # prompt tokens admitted but not yet computed
    kv_event_seq: int = 0           # seq of the last KV event published (lets the router spot a gap)
    draining: bool = False          # shutting down: finishes what it holds, takes nothing new
    tier_block_s: float = 0.0       # measured seconds per block pulled from the cache tier (0 = none yet)
    block_bytes: int = 0            # bytes of one KV block as it travels (MLA latents: a fraction of GQA's; 0 = n/a)
    model_fingerprint: str = ""
    instance: str = ""              # random per process start: a restart under the same worker id is another one
    max_model_len: int = 0          # the engine's context window in tokens (0 = no model / not reported)
    max_num_seqs: int = 0           # sequences the engine batches at once (the router's dispatch window; 0 = n/a)
    step_ms: float = 0.0            # recent engine step time while it has work (decode: ms per output token)
    switchable: bool = False        # a prefill/decode worker that changes role on ``ctl(worker, "role")``

    def _check(self) -> None:
        check_worker("worker_id", self.worker_id)
        check_one_of("role", self.role, ROLES)
        check_id("instance", self.instance, allow_empty=True)
        check_range("max_model_len", self.max_model_len, 0)
        check_range("max_num_seqs", self.max_num_seqs, 0)
        check_fingerprint("model_fingerprint", self.model_fingerprint)
        for name in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "block_size",
                     "queued_prefill_tokens", "kv_event_seq", "block_bytes"):
            check_range(name, getattr(self, name), 0)
        check_range("kv_usage", self.kv_usage, 0.0, 1.0)
        check_range("tier_block_s", self.tier_block_s, 0.0, 60.0)
        check_range("step_ms", self.step_ms, 0.0, 3.6e6)
        require(math.isfinite(self.timestamp), "field 'timestamp': must be finite")


@wire_message(MAX_CONTROL_BYTES)
class RoleSwitch(WireModel):
    """Router (its P:D planner) or operator -> a switchable worker on ``subjects.ctl(worker, "role")``: drain
    (prefills finish, decode streams migrate or are handed back), then serve ``role``; the model stays loaded.
    The reply (an ``Ack``, or an ``ErrorReply``) comes once the worker serves the new role."""
    role: str

    def _check(self) -> None:
        check_one_of("role", self.role, ("prefill", "decode"))


@wire_message(MAX_CONTROL_BYTES)
class ScaleRequest(WireModel):
    """Router (its P:D planner) -> ``deepinfer up`` on ``subjects.launcher_scale()``: ``delta`` workers of ``role``
    more (1) or fewer (-1). The reply is an ``Ack`` whose ``detail`` is the role's new worker count."""
    role: str
    delta: int

    def _check(self) -> None:
        check_one_of("role", self.role, ("prefill", "decode"))
        require(self.delta in (-1, 1), f"field 'delta': must be -1 or 1, got {self.delta!r}")


@wire_message(MAX_CONTROL_BYTES)
class WorkerInfo(WireModel):
    """Registry entry, stored under ``worker_id`` in the ``subjects.REGISTRY_BUCKET`` KV bucket."""
    worker_id: str
    role: str
    model_id: str
    host: str
    pid: int
    transports: list[str]
    block_size: int
    started_at: float
    draining: bool = False
    model_fingerprint: str = ""     # as in LoadReport

    def _check(self) -> None:
        check_worker("worker_id", self.worker_id)
        check_one_of("role", self.role, ROLES)
        check_fingerprint("model_fingerprint", self.model_fingerprint)
        check_range("pid", self.pid, 0)
        check_range("block_size", self.block_size, 0)


@wire_message(MAX_MESSAGE_BYTES)
class KVEvent(WireModel):
    """Blocks ``stored`` / ``removed`` on, or all ``cleared`` from, one worker's tier. ``seq`` increases by
    one per event per worker, so a gap tells the KV index to resync. Hashes are uint64."""
    worker_id: str
    seq: int
    kind: str
    block_hashes: list[int]
    tier: str = "device"

    def _check(self) -> None:
        check_worker("worker_id", self.worker_id)
        check_range("seq", self.seq, 0)
        check_one_of("kind", self.kind, KV_EVENT_KINDS)
        require(not self.block_hashes or min(self.block_hashes) >= 0,
                 "field 'block_hashes': hashes must be unsigned 64-bit ints")
        check_one_of("tier", self.tier, KV_TIERS)


@wire_message(MAX_MESSAGE_BYTES)
class KVSnapshot(WireModel):
    """Reply to ``subjects.ctl(worker, "kv_snapshot")``: every block hash the worker holds in ``tier`` (its
    device cache; the cache tier's store) as of event ``seq`` (the index resumes from ``seq + 1``)."""
    worker_id: str
    seq: int
    block_hashes: list[int]
    tier: str = "device"

    def _check(self) -> None:
        check_worker("worker_id", self.worker_id)
        check_range("seq", self.seq, 0)
        check_one_of("tier", self.tier, KV_TIERS)


MAX_TENANTS = 256   # tenant clients one launcher serves


@wire_message(MAX_CONTROL_BYTES)
class ClientAdmin(WireModel):
    """Operator (``admin``) -> ``deepinfer up`` on ``subjects.launcher_clients()``: ``add`` a tenant client (a NATS
    user ``client-<tenant>`` with a fresh password), ``remove`` one (the server drops its connections), or
    ``list`` them. The reply is a ``ClientAdminReply``."""
    op: str
    tenant: str = ""

    def _check(self) -> None:
        check_one_of("op", self.op, ("add", "remove", "list"))
        if self.op != "list":
            check_id("tenant", self.tenant)


@wire_message(MAX_CONTROL_BYTES)
class ClientAdminReply(WireModel):
    """The tenants after the operation; for ``add``, the new client's NATS user and password (only the operator's
    inbox hears it)."""
    tenants: list[str]
    user: str = ""
    password: str = ""

    def _check(self) -> None:
        require(len(self.tenants) <= MAX_TENANTS, f"field 'tenants': at most {MAX_TENANTS}")
