"""Where the CLIs find request traces: ``--trace PATH``, else the Mooncake synthetic trace that sits beside the
checkout (``<repo>/../shared/traces/mooncake_synthetic.jsonl``; the repo is the parent of ``benchmarks/``).

Invariant: ``resolve_trace`` returns the path of an existing file or raises ``DeepinferError``
(``invalid_request``) naming the path it tried and the ``--trace`` flag; the CLI prints it and exits 2.
"""
from __future__ import annotations

from pathlib import Path

from shared.errors import DeepinferError, ErrorCode

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
DEFAULT_TRACE_HELP = "Mooncake JSONL trace (default: ../shared/traces/mooncake_synthetic.jsonl beside the checkout)"


def resolve_trace(path: str | None) -> str:
    """The trace to read: ``path`` if given, else ``DEFAULT_TRACE``; raises if that is not a file."""
    chosen = Path(path) if path else DEFAULT_TRACE
    if not chosen.is_file():
        what = "trace file" if path else "default trace file"
        raise DeepinferError(ErrorCode.INVALID_REQUEST,
                             f"{what} not found: {chosen} (pass --trace PATH to a Mooncake JSONL trace)")
    return str(chosen)
