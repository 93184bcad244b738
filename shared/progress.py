"""Progress bars for what a user waits on (joining a packaged model, loading one, a simulation): ``tqdm`` on
stderr, shown only when stderr is a terminal, so logs, pipes and CI output stay clean. ``DEEPINFER_PROGRESS``
overrides the choice (``1``: always, ``0``: never)."""
from __future__ import annotations

import os
import sys

from tqdm import tqdm


def shown() -> bool:
    """Whether bars are drawn: ``DEEPINFER_PROGRESS`` if set, else whether stderr is a terminal."""
    forced = os.environ.get("DEEPINFER_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def bar(total: float | None, desc: str, unit: str = "it", **kwargs) -> tqdm:
    """A bar on stderr (disabled, a no-op, unless ``shown()``); closes itself when the task ends (``leave``
    False: the terminal keeps no trace of it)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not shown(), leave=False,
                dynamic_ncols=True, **kwargs)


async def gather(aws, desc: str, unit: str = "req") -> list:
    """``asyncio.gather(*aws)`` (results in order, the first error raised) with a bar counting the ones done."""
    import asyncio

    tasks = [asyncio.ensure_future(a) for a in aws]
    with bar(len(tasks), desc, unit) as b:
        for t in tasks:
            t.add_done_callback(lambda _t: b.update(1))
        return await asyncio.gather(*tasks)
