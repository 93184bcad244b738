"""The cache tier's per-tenant, per-retention-class accounting: what each (tenant, class) stored and read.

Invariants: every put and get of the service is recorded exactly once, under ``(tenant or "default",
retention)``; ``blocks_hit_dram + blocks_hit_ssd + blocks_missed`` equals the blocks asked for by gets;
bounded at ``MAX_LEDGER_KEYS`` keys (later keys fold into ``_other``, counted, never dropped). Puts are also
counted per writer (the putting service, as its NATS subject names it; bounded the same way). Store-wide
quantities (bytes held, evictions, expiries) are the store's own counters (``TieredBlockStore.stats``):
blocks are shared by hash, so they are not attributed to one tenant.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from shared.accounting import MAX_LEDGER_KEYS, bounded_line


@dataclass(slots=True)
class TierLine:
    puts: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    gets: int = 0
    blocks_hit_dram: int = 0
    blocks_hit_ssd: int = 0
    blocks_missed: int = 0
    tokens_served: int = 0
    bytes_read: int = 0


class TierLedger:
    def __init__(self, max_keys: int = MAX_LEDGER_KEYS) -> None:
        self.max_keys = max_keys
        self.lines: dict[tuple[str, str], TierLine] = {}
        self.writers: dict[tuple[str, str], TierLine] = {}   # (writer, "puts") -> puts/blocks/bytes written

    def line(self, tenant: str, retention: str) -> TierLine:
        return bounded_line(self.lines, tenant, retention, TierLine, self.max_keys)

    def record_put(self, tenant: str, retention: str, blocks: int, nbytes: int, writer: str = "") -> None:
        for line in (self.line(tenant, retention),
                     bounded_line(self.writers, writer or "unknown", "puts", TierLine, self.max_keys)):
            line.puts += 1
            line.blocks_written += blocks
            line.bytes_written += nbytes

    def record_get(self, tenant: str, retention: str, asked: int, dram: int, ssd: int, tokens: int,
                   nbytes: int) -> None:
        line = self.line(tenant, retention)
        line.gets += 1
        line.blocks_hit_dram += dram
        line.blocks_hit_ssd += ssd
        line.blocks_missed += asked - dram - ssd
        line.tokens_served += tokens
        line.bytes_read += nbytes

    def as_dict(self) -> dict:
        """``{"by_tenant": {tenant: {class: line}}, "by_writer": {writer: puts}, "total": line}``."""
        out: dict[str, dict] = {}
        total = TierLine()
        for (tenant, retention), line in sorted(self.lines.items()):
            out.setdefault(tenant, {})[retention] = asdict(line)
            for name, value in asdict(line).items():
                setattr(total, name, getattr(total, name) + value)
        by_writer = {w: {k: v for k, v in asdict(line).items() if k in ("puts", "blocks_written", "bytes_written")}
                     for (w, _), line in sorted(self.writers.items())}
        return {"by_tenant": out, "by_writer": by_writer, "total": asdict(total)}
