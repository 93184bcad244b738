"""SLO classes: what a request's latency target is and how urgent it is against other requests.

A deployment names its classes (``slo_classes`` in the router's config, ``DEEPINFER_SLO_CLASSES``); each has
- ``priority``: added to a request's own ``priority`` (vLLM's integer, lower first) to give the one number the
  router's gate and the engines' ``priority`` scheduling order by, so every request of a more urgent class comes
  before any of a less urgent one (the defaults are a million apart) and a request's own ``priority`` orders it
  within its class;
- ``ttft_s`` / ``tpot_s``: its targets (0: none). A class with a TTFT target is refused (``overloaded``, HTTP 429
  with ``Retry-After``) when the router predicts it would miss it; a class without one (``batch``) is never
  refused on a prediction: it waits.

Default spec (``DEFAULT_SPEC``): ``interactive`` (TTFT 1 s, TPOT 50 ms, priority -1,000,000), ``standard`` (no
targets but the router's ``ttft_slo_s``; priority 0: today's behaviour for a request that names no class),
``batch`` (no targets, priority +1,000,000).

A request's class: its own ``slo_class``; else OpenAI's ``service_tier`` (``priority`` -> the most urgent class,
``flex`` -> the least urgent, ``default`` / ``auto`` -> the deployment's default); else its tenant's class
(``tenant_classes``, ``acme=interactive``); else the deployment's default (``default_slo_class``). A tenant's class
is also the most urgent it may ask for: a request naming a more urgent one runs in its tenant's class (``usage``
says which class a request got).

Spec: ``name=ttft:1,tpot:0.05,priority:-1000000;name2=...`` (classes by ``;``, fields by ``,``; omitted fields
0).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from shared.errors import invalid

DEFAULT_SPEC = "interactive=ttft:1,tpot:0.05,priority:-1000000;standard=priority:0;batch=priority:1000000"
MAX_CLASSES = 16
MAX_CLASS_PRIORITY = 1 << 30   # a class's priority plus a request's stays within the engine's int range
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
SERVICE_TIERS = ("auto", "default", "flex", "priority")


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    priority: int = 0
    ttft_s: float = 0.0    # 0: no TTFT target
    tpot_s: float = 0.0    # 0: no TPOT target


@dataclass(frozen=True, slots=True)
class SloClasses:
    """One deployment's classes. Invariant: at least one class, names unique, ``default`` among them."""
    classes: Mapping[str, SloClass]
    default: str

    @classmethod
    def from_spec(cls, spec: str, default: str = "standard", ttft_slo_s: float = 0.0) -> SloClasses:
        """Parse ``spec`` (``DEFAULT_SPEC`` when empty); ``ttft_slo_s`` (the router's global target) becomes the
        default class's TTFT target when it sets none. ``ValueError`` on a bad spec or an unknown default."""
        classes: dict[str, SloClass] = {}
        for item in filter(None, (part.strip() for part in (spec or DEFAULT_SPEC).split(";"))):
            name, sep, body = item.partition("=")
            name = name.strip()
            if not _NAME.fullmatch(name) or name in classes:
                raise ValueError(f"SLO class {item!r}: expected a unique name of [A-Za-z0-9_.-] before '='")
            fields = {"priority": 0.0, "ttft": 0.0, "tpot": 0.0}
            for part in filter(None, (p.strip() for p in body.split(","))):
                key, colon, value = part.partition(":")
                try:
                    number = float(value)
                except ValueError:
                    number = math.nan
                if not colon or key.strip() not in fields or not math.isfinite(number) or \
                        (key.strip() != "priority" and not 0 <= number <= 3600):
                    raise ValueError(f"SLO class {name!r}: field {part!r} is not ttft:<s>, tpot:<s> or "
                                     f"priority:<int>")
                fields[key.strip()] = number
            priority = fields["priority"]
            if priority != int(priority) or abs(priority) > MAX_CLASS_PRIORITY:
                raise ValueError(f"SLO class {name!r}: priority must be an integer within ±{MAX_CLASS_PRIORITY}")
            classes[name] = SloClass(name, int(priority), fields["ttft"], fields["tpot"])
        if not classes or len(classes) > MAX_CLASSES:
            raise ValueError(f"an SLO class spec names 1 to {MAX_CLASSES} classes, got {len(classes)}")
        if default not in classes:
            raise ValueError(f"default SLO class {default!r} is not among {sorted(classes)}")
        if ttft_slo_s > 0 and not classes[default].ttft_s:
            classes[default] = SloClass(default, classes[default].priority, ttft_slo_s, classes[default].tpot_s)
        return cls(MappingProxyType(classes), default)

    @property
    def names(self) -> list[str]:
        return list(self.classes)

    def most_urgent(self) -> SloClass:
        return min(self.classes.values(), key=lambda c: c.priority)

    def least_urgent(self) -> SloClass:
        return max(self.classes.values(), key=lambda c: c.priority)

    def refusal_target(self, klass: SloClass) -> float | None:
        """The TTFT a placement of ``klass`` must be predicted to meet, else ``overloaded``: its target, for classes
        no more urgent than the default (the prediction counts every request queued on a worker, and a more urgent
        class is scheduled ahead of the less urgent ones among them); None: no target."""
        if not klass.ttft_s or klass.priority < self.classes[self.default].priority:
            return None
        return klass.ttft_s

    def resolve(self, slo_class: str = "", service_tier: str = "", tenant_class: str = "") -> SloClass:
        """The class a request runs in (module docstring); ``invalid_request`` for an unknown class or tier."""
        if slo_class and slo_class not in self.classes:
            raise invalid(f"unknown slo_class {slo_class!r} (known: {self.names})")
        if service_tier and service_tier not in SERVICE_TIERS:
            raise invalid(f"service_tier must be one of {list(SERVICE_TIERS)}, got {service_tier!r}")
        chosen = (self.classes[slo_class] if slo_class else
                  self.most_urgent() if service_tier == "priority" else
                  self.least_urgent() if service_tier == "flex" else
                  self.classes.get(tenant_class) or self.classes[self.default])
        ceiling = self.classes.get(tenant_class)
        if ceiling is not None and chosen.priority < ceiling.priority:   # more urgent than the tenant may ask
            return ceiling
        return chosen


def parse_tenant_classes(spec: str) -> dict[str, str]:
    """``"acme=interactive,etl=batch"`` -> ``{"acme": "interactive", "etl": "batch"}``."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        tenant, sep, name = item.partition("=")
        if not sep or not tenant.strip() or not _NAME.fullmatch(name.strip()):
            raise ValueError(f"tenant class {item!r}: expected <tenant>=<class>")
        out[tenant.strip()] = name.strip()
    return out
