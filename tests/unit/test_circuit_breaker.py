"""CircuitBreaker (shared/spec/breaker.py): closed → open after failures in a row → one trial per cooldown."""
from shared.spec.breaker import CircuitBreaker


def test_opens_after_failures_in_a_row_and_a_success_in_between_resets():
    b = CircuitBreaker(threshold=3, cooldown_s=2.0)
    b.failure(0.0), b.failure(0.1), b.success(), b.failure(0.2), b.failure(0.3)
    assert b.state == "closed" and b.allow(0.3)
    b.failure(0.4)
    assert b.state == "open" and not b.allow(0.5) and not b.allow(2.3)
    assert b.skipped == 2


def test_one_trial_per_cooldown_and_the_cooldown_doubles_while_trials_fail():
    b = CircuitBreaker(threshold=1, cooldown_s=1.0, max_cooldown_s=3.0)
    b.failure(0.0)                                  # open until 1.0
    assert b.allow(1.0) and b.state == "half-open"  # the trial goes out
    assert not b.allow(1.01)                        # only one
    b.failure(1.1)                                  # open until 3.1 (2 s)
    assert not b.allow(3.0) and b.allow(3.1)
    b.failure(3.2)                                  # open until 6.2 (3 s: the cap)
    assert not b.allow(6.1) and b.allow(6.2)
    b.success()                                     # the trial worked: closed, cooldown back to 1 s
    assert b.state == "closed" and b.cooldown_s == 1.0 and b.allow(6.3)
    assert b.opened == 3


def test_failed_waits_over_a_minute_of_a_dead_service_stay_few():
    """Every allowed call fails (a dead service): over 60 s of calls every 10 ms, only a handful go out."""
    b = CircuitBreaker()
    calls = 0
    for i in range(6000):
        now = i * 0.01
        if b.allow(now):
            calls += 1
            b.failure(now)
    assert calls <= 3 + 6, calls  # threshold, then trials at +2, +4, +8, +16, +32 s
