"""The one rule for where prefill runs and which KV transport a pair uses (services/router/policy/placement.py), for
every policy: request modes, the local-prefill threshold of load-only policies, transport fallback."""
import pytest

from services.router.policy.placement import choose_transport, place_request
from services.router.policy.policies import make_policy
from services.router.policy.types import ClusterView, Placement, Reject, RequestInfo, WorkerView


def w(wid, role, host="h1", transports=("shm", "stream"), **kw) -> WorkerView:
    return WorkerView(wid, role, num_free_blocks=100, num_total_blocks=100, host=host, transports=transports, **kw)


def req(tokens: int) -> RequestInfo:
    return RequestInfo("r", tokens, tuple(range(tokens // 16)), 16)


VIEW = ClusterView(prefill=(w("p0", "prefill"), w("p1", "prefill", num_running=3)), decode=(w("d0", "decode"),))


def test_choose_transport():
    p = w("p", "prefill", transports=("cuda_ipc", "shm", "stream"))
    assert choose_transport(p, w("d", "decode")) == "shm"
    assert choose_transport(p, w("d", "decode", host="h2")) == "stream"
    assert choose_transport(p, w("d", "decode", host="h2", transports=("shm",))) is None
    assert choose_transport(p, w("d", "decode"), forced="stream") == "stream"
    assert choose_transport(p, w("d", "decode", host="h2"), forced="shm") is None  # same-host only
    assert choose_transport(p, w("d", "decode", transports=("shm",)), forced="nixl") is None


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware", "kv_cost"])
def test_load_only_policies_prefill_short_prompts_locally_in_auto_mode(policy):
    short = place_request(make_policy(policy), req(40), VIEW, "auto", local_prefill_tokens=64)
    long = place_request(make_policy(policy), req(400), VIEW, "auto", local_prefill_tokens=64)
    assert short == Placement("d0", None, short.predicted_ttft_s, short.reason)
    assert long.prefill_worker in ("p0", "p1") and long.decode_worker == "d0" and long.transport == "shm"


def test_predictive_decides_the_site_itself():
    """A busy decode worker: predictive sends even a short prompt to a prefill worker, and the load-only
    threshold does not move it back (it does for a load-only policy)."""
    busy = ClusterView(prefill=VIEW.prefill, decode=(w("d0", "decode", num_running=5, queued_prefill_tokens=2000),))
    decision = place_request(make_policy("predictive", local_prefill_tokens=0), req(40), busy, "auto",
                             local_prefill_tokens=10_000)
    assert decision.prefill_worker == "p0" and decision.transport == "shm"
    assert place_request(make_policy("least_loaded"), req(40), busy, "auto", 10_000).prefill_worker is None


def test_modes():
    policy = make_policy("least_loaded")
    local = place_request(policy, req(400), VIEW, "local")
    assert local.prefill_worker is None and local.decode_worker == "d0" and local.transport is None
    remote = place_request(policy, req(8), VIEW, "remote")  # short, but remote is forced
    assert remote.prefill_worker == "p0" and remote.transport == "shm"
    no_prefill = ClusterView(prefill=(), decode=VIEW.decode)
    assert isinstance(place_request(policy, req(400), no_prefill, "remote"), Reject)
    with pytest.raises(ValueError):
        place_request(policy, req(8), VIEW, "sideways")


def test_no_common_transport_falls_back_to_local_unless_forced():
    apart = ClusterView(prefill=(w("p0", "prefill", transports=("shm",)),),
                        decode=(w("d0", "decode", host="h2", transports=("shm",)),))
    policy = make_policy("least_loaded")
    fallback = place_request(policy, req(400), apart, "auto")
    assert fallback.prefill_worker is None and fallback.transport is None
    for mode, transport in (("remote", ""), ("auto", "shm")):
        rejected = place_request(policy, req(400), apart, mode, transport=transport)
        assert isinstance(rejected, Reject) and rejected.reason.startswith("unavailable: no common KV transport")
