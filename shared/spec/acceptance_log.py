"""Acceptance log: one JSON line per verified drafted token, the confidence head's training data.

Line format: ``{"f": [top1_prob, entropy, ngram_len, position], "accepted": 0|1, "drafter": name, "p": i}`` —
``f`` is ``TokenFeatures.as_list()`` (position is the token's index within its proposal), ``p`` the proposal
index. ``accepted`` is 1 iff the target accepted the token and every earlier token of its proposal.

Invariants:
- A proposal is a run of consecutive lines with the same ``p`` and ``drafter`` and increasing positions;
  ``read_log_groups`` splits runs there, so a log appended to by a restarted writer (whose ``p`` starts over)
  still reads back as the right proposals.
- With ``proposal=None`` ``record`` starts a new proposal at every ``position == 0``: the tokens of one
  proposal must then be recorded consecutively, in order (pass ``proposal=next_proposal()`` otherwise).
- The writer is bounded: at most ``max_records`` lines per ``AcceptanceLog``; later records are counted in
  ``num_dropped`` and not written. It never raises on I/O errors after opening: the first failed write is
  logged, the log stops and what it could not write is counted as dropped (the token path must not fail).
- Lines are buffered (``flush_every``) and written on ``flush``/``close``; ``close`` is idempotent.
- One writer per instance; not thread-safe.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.spec.types import FEATURE_NAMES, TokenFeatures

logger = logging.getLogger(__name__)


class AcceptanceLog:
    """Bounded, buffered JSON-lines writer (see the module invariants)."""

    def __init__(self, path: str | Path, max_records: int = 1_000_000, flush_every: int = 256,
                 append: bool = True) -> None:
        if max_records < 0 or flush_every < 1:
            raise ValueError(f"need max_records >= 0 and flush_every >= 1, got {max_records}, {flush_every}")
        self.path = Path(path)
        self.max_records, self.flush_every = max_records, flush_every
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # closed in close()
        self._buffer: list[str] = []
        self._next_p = 0
        self._current_p = -1
        self.num_written = 0   # lines handed to the file (flushed)
        self.num_dropped = 0   # records past max_records or lost to an I/O error
        self._failed = False

    def next_proposal(self) -> int:
        """A fresh proposal index (for callers that interleave the tokens of several proposals)."""
        self._current_p = self._next_p
        self._next_p += 1
        return self._current_p

    def record(self, features: TokenFeatures, accepted: bool, drafter: str, proposal: int | None = None) -> bool:
        """Append one verified drafted token; False if it was dropped (bound reached, log failed or closed)."""
        if proposal is None:
            proposal = self.next_proposal() if features.position == 0 or self._current_p < 0 else self._current_p
        if self._file is None or self._failed or self.num_written + len(self._buffer) >= self.max_records:
            if self.num_dropped == 0 and not self._failed and self._file is not None:
                logger.warning("acceptance log %s: %d records written, dropping the rest", self.path,
                               self.max_records)
            self.num_dropped += 1
            return False
        self._buffer.append(json.dumps({"f": features.as_list(), "accepted": int(bool(accepted)),
                                        "drafter": drafter, "p": int(proposal)}) + "\n")
        if len(self._buffer) >= self.flush_every:
            self.flush()
        return True

    def record_proposal(self, features: Sequence[TokenFeatures], accepted: Sequence[bool], drafter: str) -> int:
        """Record one proposal's verified tokens under a fresh index; returns how many were written."""
        if len(features) != len(accepted):
            raise ValueError(f"{len(features)} feature rows but {len(accepted)} labels")
        p = self.next_proposal()
        return sum(self.record(f, a, drafter, p) for f, a in zip(features, accepted))

    def flush(self) -> None:
        if not self._buffer or self._file is None or self._failed:
            return
        lines, self._buffer = self._buffer, []
        try:
            self._file.write("".join(lines))
            self._file.flush()
        except OSError as err:  # disk full, file gone: stop logging, never fail the caller
            logger.warning("acceptance log %s: write failed (%s); logging stopped", self.path, err)
            self._failed = True
            self.num_dropped += len(lines)
            return
        self.num_written += len(lines)

    def close(self) -> None:
        if self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None
        logger.info("acceptance log %s closed: %d written, %d dropped", self.path, self.num_written,
                    self.num_dropped)

    def __enter__(self) -> AcceptanceLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_log_groups(path: str | Path, drafter: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X [N, 4] float64, y [N] int64, g [N] int64): rows in file order, ``g`` numbering proposals 0, 1, ...

    ``drafter`` keeps only that drafter's lines. Malformed lines (e.g. a torn last line) are skipped and
    counted in one warning.
    """
    rows: list[list[float]] = []
    labels: list[int] = []
    groups: list[int] = []
    prev: tuple[int, str, float] | None = None  # (p, drafter, position) of the previous kept line
    group, bad = -1, 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                f = [float(v) for v in rec["f"]]
                label, name, p = int(rec["accepted"]), str(rec.get("drafter", "")), int(rec.get("p", -1))
                if len(f) != len(FEATURE_NAMES) or label not in (0, 1):
                    raise ValueError(line)
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            if drafter is not None and name != drafter:
                continue
            if prev is None or (p, name) != prev[:2] or f[3] <= prev[2]:
                group += 1
            prev = (p, name, f[3])
            rows.append(f)
            labels.append(label)
            groups.append(group)
    if bad:
        logger.warning("acceptance log %s: skipped %d malformed lines", path, bad)
    x = np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))
    return x, np.asarray(labels, dtype=np.int64), np.asarray(groups, dtype=np.int64)


def read_log(path: str | Path, drafter: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(X [N, 4], y [N]) of every record (see ``read_log_groups``)."""
    x, y, _ = read_log_groups(path, drafter)
    return x, y
