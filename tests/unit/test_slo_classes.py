"""SLO classes (``shared/slo_classes.py``): the default spec, a deployment's own, and which class a request runs
in (its ``slo_class``, OpenAI's ``service_tier``, its tenant's class as a ceiling, the default)."""
import pytest

from services.router.config import RouterConfig
from shared.errors import DeepinferError, ErrorCode
from shared.slo_classes import SloClass, SloClasses, parse_tenant_classes


def test_the_default_classes_and_a_deployments_own():
    slo = SloClasses.from_spec("")
    assert slo.names == ["interactive", "standard", "batch"] and slo.default == "standard"
    assert slo.classes["interactive"] == SloClass("interactive", -1_000_000, 1.0, 0.05)
    assert slo.classes["batch"] == SloClass("batch", 1_000_000, 0.0, 0.0)
    assert slo.classes["standard"].ttft_s == 0.0
    assert SloClasses.from_spec("", ttft_slo_s=4.0).classes["standard"].ttft_s == 4.0   # the router's global one
    own = SloClasses.from_spec("gold=ttft:0.5,priority:-5; bronze = priority:5", default="bronze")
    assert own.classes["gold"] == SloClass("gold", -5, 0.5, 0.0) and own.default == "bronze"
    assert own.most_urgent().name == "gold" and own.least_urgent().name == "bronze"
    for bad in ("gold=ttft:x", "gold=speed:1", "gold=priority:0.5", "gold=ttft:-1", "a=priority:1;a=priority:2",
                "=priority:1", "bad name=priority:1"):
        with pytest.raises(ValueError):
            SloClasses.from_spec(bad, default="gold")
    with pytest.raises(ValueError, match="default"):
        SloClasses.from_spec("gold=priority:1")
    with pytest.raises(ValueError, match="unknown SLO classes"):
        RouterConfig(tenant_classes="acme=platinum")
    assert parse_tenant_classes("acme=interactive, etl=batch") == {"acme": "interactive", "etl": "batch"}


def test_a_requests_class_by_field_tier_tenant_and_default():
    slo = SloClasses.from_spec("")
    assert slo.resolve().name == "standard"
    assert slo.resolve("batch").name == "batch"
    assert slo.resolve(service_tier="priority").name == "interactive"
    assert slo.resolve(service_tier="flex").name == "batch"
    assert slo.resolve(service_tier="auto").name == slo.resolve(service_tier="default").name == "standard"
    assert slo.resolve(tenant_class="batch").name == "batch"
    assert slo.resolve("interactive", tenant_class="batch").name == "batch"     # the tenant's class is a ceiling
    assert slo.resolve("batch", tenant_class="standard").name == "batch"        # less urgent is allowed
    assert slo.resolve(service_tier="priority", tenant_class="standard").name == "standard"
    for kwargs in ({"slo_class": "gold"}, {"service_tier": "scale"}):
        with pytest.raises(DeepinferError) as err:
            slo.resolve(**kwargs)
        assert err.value.code == ErrorCode.INVALID_REQUEST
