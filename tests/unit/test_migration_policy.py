"""When streams move (services/router/policy/migration_policy.py): all of a draining worker's, one per full worker to one
with room, the cheapest to move first; bounded per source, no ping-pong, never to the source or a draining one."""
import dataclasses

from services.router.policy.migration_policy import DecodeLoad, MigrationConfig, MovableStream, choose_moves

CFG = MigrationConfig(kv_high=0.9, kv_low=0.6, cooldown_s=10.0, per_source=2, min_tokens_left=16, skew_min=0)
SKEW = MigrationConfig(skew_min=4, skew_ratio=2.0)


def stream(rid, source, context=100, left=100, moved_at=None, moving=False):
    return MovableStream(rid, source, context, left, moved_at, moving)


def test_a_draining_worker_is_emptied_two_at_a_time_onto_the_least_loaded():
    workers = [DecodeLoad("d0", 3, 0.5, draining=True), DecodeLoad("d1", 5, 0.5), DecodeLoad("d2", 1, 0.5)]
    streams = [stream(f"s{i}", "d0", left=2) for i in range(3)] + [stream("t", "d1")]
    moves = choose_moves(CFG, 0.0, workers, streams, {})
    assert [(r, why) for r, _, why in moves] == [("s0", "drain"), ("s1", "drain")]  # per_source bound
    assert [t for _, t, _ in moves] == ["d2", "d2"]       # 1 -> 2 running, still below d1's 5
    assert choose_moves(CFG, 0.0, workers, streams, {"d0": 2}) == []  # two under way already
    assert choose_moves(CFG, 0.0, [workers[0]], streams, {}) == []    # nowhere to go: handed back at the end


def test_a_full_worker_moves_one_stream_the_cheapest_per_token_left_to_a_worker_with_room():
    workers = [DecodeLoad("d0", 4, 0.95), DecodeLoad("d1", 2, 0.7), DecodeLoad("d2", 3, 0.3)]
    streams = [stream("long-context", "d0", context=4000, left=200), stream("short", "d0", context=100, left=200),
               stream("ending", "d0", context=50, left=5), stream("other", "d2")]
    assert choose_moves(CFG, 0.0, workers, streams, {}) == [("short", "d2", "kv_pressure")]
    calm = [DecodeLoad("d0", 4, 0.85), *workers[1:]]
    assert choose_moves(CFG, 0.0, calm, streams, {}) == []             # below kv_high: nothing moves
    full = [workers[0], DecodeLoad("d1", 2, 0.7), DecodeLoad("d2", 3, 0.65)]
    assert choose_moves(CFG, 0.0, full, streams, {}) == []             # no worker below kv_low


def test_no_ping_pong_and_nothing_moves_twice_at_once():
    workers = [DecodeLoad("d0", 4, 0.95), DecodeLoad("d1", 1, 0.1)]
    recent = [stream("a", "d0", moved_at=95.0), stream("b", "d0", moving=True)]
    assert choose_moves(CFG, 100.0, workers, recent, {}) == []
    assert choose_moves(CFG, 106.0, workers, recent, {}) == [("a", "d1", "kv_pressure")]
    draining = [DecodeLoad("d0", 4, 0.5, draining=True), DecodeLoad("d1", 1, 0.1)]
    assert choose_moves(CFG, 100.0, draining, recent, {}) == [("a", "d1", "drain")]  # a drain overrides cooldown


def test_a_skewed_pair_evens_out_one_stream_per_evaluation():
    workers = [DecodeLoad("old", 12, 0.5), DecodeLoad("new", 0, 0.0)]
    streams = [stream(f"s{i}", "old", context=100 + i, left=200) for i in range(12)]
    moves = choose_moves(SKEW, 0.0, workers, streams, {})
    assert moves == [("s0", "new", "skew")]                       # most tokens left per token of context
    near = [DecodeLoad("old", 5, 0.5), DecodeLoad("new", 3, 0.5)]
    assert choose_moves(SKEW, 0.0, near, streams, {}) == []       # 2 apart: not skewed
    assert choose_moves(CFG, 0.0, workers, streams, {}) == []     # rule off


def test_a_worker_over_the_tpot_slo_sheds_one_stream_to_one_with_headroom():
    cfg = MigrationConfig(skew_min=0, kv_high=2.0, tpot_slo_s=0.1, tpot_headroom=0.7)
    workers = [DecodeLoad("d0", 6, 0.3, step_s=0.15), DecodeLoad("d1", 2, 0.2, step_s=0.08),
               DecodeLoad("d2", 3, 0.2, step_s=0.05)]
    streams = [stream("a", "d0", left=50), stream("b", "d0", context=10, left=500)]
    assert choose_moves(cfg, 0.0, workers, streams, {}) == [("b", "d2", "tpot")]  # d1 has no headroom
    slow_everywhere = [workers[0], DecodeLoad("d1", 2, 0.2, step_s=0.09)]
    assert choose_moves(cfg, 0.0, slow_everywhere, streams, {}) == []
    within = [DecodeLoad("d0", 6, 0.3, step_s=0.1), workers[2]]
    assert choose_moves(cfg, 0.0, within, streams, {}) == []           # at the SLO, not over it
    off = MigrationConfig(skew_min=0, kv_high=2.0)
    assert choose_moves(off, 0.0, workers, streams, {}) == []


def test_a_full_worker_moves_a_batch_stream_before_an_interactive_one():
    workers = [DecodeLoad("d0", 3, 0.95), DecodeLoad("d1", 1, 0.3)]
    streams = [MovableStream("chat", "d0", 100, 400, priority=-1_000_000),      # the cheapest per token left
               MovableStream("batch", "d0", 2000, 100, priority=1_000_000),
               MovableStream("standard", "d0", 500, 200)]
    assert choose_moves(CFG, 0.0, workers, streams, {}) == [("batch", "d1", "kv_pressure")]
    same = [dataclasses.replace(s, priority=0) for s in streams]
    assert choose_moves(CFG, 0.0, workers, same, {}) == [("chat", "d1", "kv_pressure")]   # one class: as before


def test_a_worker_whose_seats_are_full_makes_room_for_an_urgent_stream_placed_there():
    """Rule 4: a chat stream placed on d0 (its seats all taken by batch and standard streams) has not started: the
    least urgent stream there moves to a worker with a free seat; nothing moves for a waiting stream no more urgent
    than those running, nor to a worker without a seat, nor when the rule is off."""
    workers = [DecodeLoad("d0", 4, 0.5, seats=4), DecodeLoad("d1", 4, 0.2, seats=4), DecodeLoad("d2", 1, 0.3, seats=4)]
    streams = [MovableStream("batch", "d0", 500, 300, priority=1_000_000),
               MovableStream("standard", "d0", 500, 300),
               MovableStream("other", "d2", 100, 100)]
    chat = -1_000_000
    assert choose_moves(CFG, 0.0, workers, streams, {}, {"d0": chat}) == [("batch", "d2", "urgent")]
    assert choose_moves(CFG, 0.0, workers, streams, {}, {"d0": 1_000_000}) == []   # a batch waiting: no one less urgent
    assert choose_moves(CFG, 0.0, workers, streams, {}, {"d0": 0}) == [("batch", "d2", "urgent")]
    no_seat = [workers[0], workers[1], DecodeLoad("d2", 4, 0.3, seats=4)]
    assert choose_moves(CFG, 0.0, no_seat, streams, {}, {"d0": chat}) == []          # nowhere with a free seat
    room = [DecodeLoad("d0", 3, 0.5, seats=4), *workers[1:]]
    assert choose_moves(CFG, 0.0, room, streams, {}, {"d0": chat}) == []             # a seat is free on d0
    assert choose_moves(CFG, 0.0, workers, streams, {}) == []                        # nobody waits
    kv_full = [DecodeLoad("d0", 2, 0.95), DecodeLoad("d2", 1, 0.3)]
    assert choose_moves(dataclasses.replace(CFG, kv_high=2.0), 0.0, kv_full, streams, {}, {"d0": chat}) == []
    assert choose_moves(dataclasses.replace(CFG, kv_high=0.9), 0.0, kv_full, streams, {}, {"d0": chat}) == \
        [("batch", "d2", "kv_pressure")]   # rule 2 relieved it already: one move per source


def test_the_router_names_streams_placed_but_not_started_as_waiting_for_room():
    """``Migrator.consider`` (the router's side of rule 4): a stream whose attempt is placed on a decode worker and
    not yet decoding counts as waiting there; with the rule off (``migrate_for_urgent``) nothing moves for it."""
    import time

    from services.router.migration import Migrator
    from services.router.relay import Attempt, Relay, Stream
    from services.router.workers import InflightAccount, WorkerTable
    from tests.unit.test_router_state import report

    now = time.monotonic()
    table = WorkerTable(dead_after_s=30.0)
    table.update(report("d0", num_running=2, max_num_seqs=2), now=now)
    table.update(report("d1", max_num_seqs=2), now=now)
    relay = Relay(None, None, table, 1.0, 2)

    async def send(chunk):
        return None

    def place(rid: str, priority: int, decoding: bool) -> None:
        w = table.workers["d0"]
        stream = Stream(rid, send, prompt_len=100, deadline=now + 60.0, max_tokens=300, priority=priority)
        stream.attempt = Attempt(rid, None, w, InflightAccount(None, w, 0), decoding=decoding)
        relay.live[rid] = stream

    place("batch", 1_000_000, True)
    place("standard", 0, True)
    place("chat", -1_000_000, False)
    for on in (True, False):
        spawned = []
        migrator = Migrator(None, relay, table, policy=dataclasses.replace(CFG, urgent=on), spawn=spawned.append)
        moves = migrator.consider(now + 1.0)
        for coro in spawned:
            coro.close()
        assert moves == ([("batch", "d1", "urgent")] if on else [])
