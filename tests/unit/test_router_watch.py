"""RouterLiveness: when a worker considers the router relaying a request gone (services/worker/router_watch.py)."""
from services.worker.router_watch import RouterLiveness


def test_silence_counts_from_the_last_heartbeat_or_the_start_of_the_watch():
    s = RouterLiveness(dead_after_s=3.0)
    assert s.hold("a", "router-0", "i1", now=0.0) is not None  # new router: subscribe
    assert s.hold("b", "router-0", "i1", now=1.0) is None      # known router: nothing to do
    assert s.orphans(now=2.9) == []                             # no heartbeat yet, but the watch is young
    assert s.orphans(now=3.0) == ["a", "b"]
    s.heartbeat("router-0", "i1", now=3.5)
    assert s.orphans(now=6.4) == []
    assert s.orphans(now=6.5) == ["a", "b"]


def test_another_instance_under_the_same_id_orphans_at_once():
    s = RouterLiveness(dead_after_s=3.0)
    s.hold("a", "router-0", "i1", now=0.0)
    s.heartbeat("router-0", "i1", now=0.5)
    s.hold("c", "router-0", "i2", now=1.0)  # the restarted router places new work here
    s.heartbeat("router-0", "i2", now=1.1)
    assert s.orphans(now=1.2) == ["a"]


def test_work_without_a_router_is_never_orphaned_and_releases_unsubscribe_the_last():
    s = RouterLiveness(dead_after_s=1.0)
    assert s.hold("x", "", "", now=0.0) is None
    s.hold("a", "router-0", "i1", now=0.0)
    s.hold("b", "router-0", "i1", now=0.0)
    assert s.orphans(now=100.0) == ["a", "b"]
    assert s.release("a") is None
    assert s.release("b") is not None  # no request names router-0 any more: drop its subscription
    assert s.release("x") is None and s.routers == {} and s.requests == {}


def test_a_reconnect_of_the_worker_restarts_the_count():
    """The worker was cut off from NATS: the heartbeats it missed do not make the router dead."""
    s = RouterLiveness(dead_after_s=3.0)
    s.hold("a", "router-0", "i1", now=0.0)
    s.heartbeat("router-0", "i1", now=0.5)
    s.reconnected_at = 10.0
    assert s.orphans(now=10.5) == []
    assert s.orphans(now=13.0) == ["a"]


def test_forgetting_a_router_unwatches_all_its_work():
    s = RouterLiveness(dead_after_s=1.0)
    s.hold("a", "router-0", "i1", now=0.0)
    s.hold("b", "router-0", "i1", now=0.0)
    s.forget("router-0")
    assert s.orphans(now=100.0) == [] and s.routers == {} and s.requests == {}
    assert s.release("a") is None
