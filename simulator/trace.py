"""Mooncake-format workload traces (see ../shared/traces/README.md): one request per JSON line with an
arrival timestamp in ms, input/output lengths and chained prefix-block ids (512 tokens per block)."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    idx: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str, limit: int | None = None, speed: float = 1.0, offset: int = 0) -> list[TraceRequest]:
    """Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids); ``speed`` > 1 compresses time.
    ``offset`` skips that many requests first (a later window of the trace); ``idx`` is the row's position
    among the file's requests, arrivals keep the file's clock (consumers measure from the first one)."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    out: list[TraceRequest] = []
    row = 0
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            row += 1
            if row <= offset:
                continue
            d = json.loads(line)
            out.append(TraceRequest(row - 1, d["timestamp"] / 1000.0 / speed, int(d["input_length"]),
                                    int(d["output_length"]), tuple(d["hash_ids"])))
    return out


def write_trace(requests: list[TraceRequest], path: str) -> int:
    """Write ``requests`` as Mooncake JSONL (what ``load_trace`` reads back: timestamps in ms); returns the count."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
    return len(requests)
