"""SLO classes in the simulator (``shared/slo_classes.py``): each trace request gets a class from a mix, and with
classes on each worker's waiting queue is ordered as the router's gate and the engine's ``priority`` policy order
it — by the class's priority, then arrival — and a placement is refused on a predicted TTFT past the class's
target only for classes no more urgent than the default (the router's rule). With classes off every request
waits in arrival order under the deployment's one target, and is still counted under its class, so the two runs
compare per class.

Not modelled: the gate's dispatch beyond a full window and the engine taking a seat back for an urgent arrival
(the live system's larger effect: ``benchmarks/slo_classes.py``); an urgent request here waits for a seat.

Invariants: ``assign`` is deterministic under its seed and gives every request a class of the mix; attainment per
class counts every request of the class (refused ones as missed), a TTFT target of 0 as none.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shared.slo_classes import SloClasses
from simulator.metrics import percentiles


@dataclass(frozen=True, slots=True)
class ClassMix:
    shares: tuple[tuple[str, float], ...]   # (class, share of requests), shares summing to 1
    slo: SloClasses
    on: bool = True

    @classmethod
    def parse(cls, spec: str, slo_spec: str = "", on: bool = True, ttft_slo_s: float | None = None) -> ClassMix:
        """``"interactive=0.3,batch=0.7"`` (shares normalised) over ``slo_spec``'s classes (default ones; the
        deployment's ``ttft_slo_s`` is the default class's TTFT target when it sets none, as in the router);
        ``ValueError`` for an unknown class or a share that is not positive."""
        slo = SloClasses.from_spec(slo_spec, default=_default(slo_spec), ttft_slo_s=ttft_slo_s or 0.0)
        shares = []
        for item in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = item.partition("=")
            try:
                share = float(value)
            except ValueError:
                share = -1.0
            if name.strip() not in slo.classes or not share > 0:
                raise ValueError(f"class share {item!r}: expected <class>=<positive share>, classes {slo.names}")
            shares.append((name.strip(), share))
        if not shares:
            raise ValueError("a class mix names at least one class")
        total = sum(s for _, s in shares)
        return cls(tuple((n, s / total) for n, s in shares), slo, on)

    def assign(self, n: int, seed: int) -> list[str]:
        """The classes of ``n`` requests in trace order (a seeded draw per request)."""
        rng = random.Random(seed * 7919 + 17)
        names, weights = [n_ for n_, _ in self.shares], [s for _, s in self.shares]
        return [rng.choices(names, weights)[0] for _ in range(n)]

    def priority(self, name: str) -> int:
        return self.slo.classes[name].priority if self.on else 0

    def ttft_target(self, name: str, deployment_ttft_s: float | None) -> float | None:
        """The TTFT a placement must be predicted to meet (None: none), as the router decides it."""
        return self.slo.refusal_target(self.slo.classes[name]) if self.on else deployment_ttft_s


def _default(slo_spec: str) -> str:
    """The default class of a spec: ``standard`` when it has one, else its first class."""
    names = [item.partition("=")[0].strip() for item in (slo_spec or "").split(";") if item.strip()]
    return "standard" if not names or "standard" in names else names[0]


def class_metrics(mix: ClassMix, classes: Sequence[str], served: Sequence[tuple[int, float | None, float | None]]
                  ) -> dict[str, dict]:
    """Per class: requests, served, SLO attainment against the class's own targets, TTFT percentiles.
    ``served``: ``(trace position, ttft_s, tpot_s)`` of each served request."""
    out = {}
    for name, _ in mix.shares:
        klass = mix.slo.classes[name]
        rows = [(t, p) for i, t, p in served if classes[i] == name]
        met = sum(1 for t, p in rows if t is not None and (not klass.ttft_s or t <= klass.ttft_s)
                  and (p is None or not klass.tpot_s or p <= klass.tpot_s))
        requests = sum(1 for c in classes if c == name)
        out[name] = {"requests": requests, "served": len(rows),
                     "slo_attainment": round(met / requests, 6) if requests else 0.0,
                     **percentiles([t for t, _ in rows if t is not None], "ttft")}
    return out


def format_classes(results: Sequence[dict]) -> str:
    """One line per (run, class): attainment and TTFT percentiles."""
    lines = [f"{'run':<24} {'class':<12} {'requests':>8} {'served':>7} {'slo':>6} {'ttft p50':>9} {'ttft p99':>9}"]
    for res in results:
        label = f"{res['policy']} x{res['speed']:g} {'on' if res.get('classes_on') else 'off'}"
        for name, row in res.get("classes", {}).items():
            p50, p99 = row["ttft_p50_s"], row["ttft_p99_s"]
            lines.append(f"{label:<24} {name:<12} {row['requests']:>8} {row['served']:>7} "
                         f"{row['slo_attainment']:>6.3f} {p50 if p50 is None else round(p50, 3):>9} "
                         f"{p99 if p99 is None else round(p99, 3):>9}")
    return "\n".join(lines)
