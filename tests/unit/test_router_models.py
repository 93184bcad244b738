"""The router places a request only on workers of one model build (services/router/models.py, placement.py):
the serving fingerprint, kept while it has at least as many decode workers as any other; a failover
continuation stays on its own build while that has a decode worker."""
import pytest

from services.router.models import ServingModel
from services.router.placement import Placer
from services.router.workers import WorkerTable
from shared import protocol
from shared.errors import DeepinferError, ErrorCode
from shared.kv.block_hash import hash_prompt_blocks
from services.router.policy.kv_index import KVIndex
from services.router.policy.types import CostModel

A, B = "a" * 32, "b" * 32


def report(wid: str, role: str, fp: str, **kw) -> protocol.LoadReport:
    fields = dict(worker_id=wid, role=role, model_id="same-name", num_running=0, num_waiting=0, kv_usage=0.0,
                  num_free_blocks=100, num_total_blocks=100, block_size=8, transports=["shm", "stream"], host="h",
                  timestamp=0.0, model_fingerprint=fp)
    return protocol.LoadReport(**{**fields, **kw})


def cluster(*workers: tuple[str, str, str]) -> tuple[WorkerTable, Placer, KVIndex]:
    table, index = WorkerTable(3.0), KVIndex()
    for wid, role, fp in workers:
        table.update(report(wid, role, fp))
    return table, Placer("predictive", table, index, CostModel(), 0), index


def place(placer: Placer, rid: str = "r", fingerprint: str | None = None, mode: str = "auto", prompt=None):
    return placer.place(rid, prompt or list(range(40)), 8, "", mode, fingerprint=fingerprint)


def test_a_pair_never_mixes_builds_and_the_majority_serves():
    table, placer, _ = cluster(("p-a", "prefill", A), ("p-b", "prefill", B), ("d-a1", "decode", A),
                               ("d-a2", "decode", A), ("d-b", "decode", B))
    for i in range(6):
        prefill, decode, transport, fp = place(placer, f"r{i}", mode="remote")
        assert fp == A and prefill.report.worker_id == "p-a" and decode.report.worker_id in ("d-a1", "d-a2")
    table.update(report("d-b2", "decode", B))               # a tie keeps the incumbent
    assert place(placer)[3] == A
    table.update(report("d-b3", "decode", B))               # the new build holds the majority: it serves
    prefill, decode, _, fp = place(placer, mode="remote")
    assert fp == B and prefill.report.worker_id == "p-b" and decode.report.model_fingerprint == B


def test_a_continuation_stays_on_its_build_while_that_has_a_decode_worker():
    table, placer, _ = cluster(("p-a", "prefill", A), ("d-a", "decode", A), ("d-b1", "decode", B),
                               ("d-b2", "decode", B))
    assert place(placer)[3] == B                              # B has the majority
    prefill, decode, _, fp = place(placer, fingerprint=A, mode="remote")     # a stream that began on A
    assert fp == A and (prefill.report.worker_id, decode.report.worker_id) == ("p-a", "d-a")
    table.update(report("d-a", "decode", A, draining=True))   # A's last decode worker drains
    prefill, decode, _, fp = place(placer, fingerprint=A)
    assert fp == B and prefill is None and decode.report.model_fingerprint == B   # A's prefill is not paired
    with pytest.raises(DeepinferError) as err:                # remote prefill demanded, no prefill worker of B
        placer.place("r", list(range(40)), 8, "", "remote", fingerprint=A)
    assert err.value.code == ErrorCode.UNAVAILABLE


def test_overlap_is_looked_up_under_the_serving_build():
    """The router hashes the prompt under the serving build's fingerprint: blocks another build cached under
    the same tokens are not counted as a prefix hit."""
    from shared.protocol import KVEvent

    table, placer, index = cluster(("d-a", "decode", A), ("d-b", "decode", B), ("d-a2", "decode", A))
    prompt = list(range(40))
    index.apply(KVEvent(worker_id="d-b", seq=1, kind="stored", block_hashes=hash_prompt_blocks(prompt, 8, B)))
    assert index.overlap(hash_prompt_blocks(prompt, 8, A)) == {}
    index.apply(KVEvent(worker_id="d-a2", seq=1, kind="stored", block_hashes=hash_prompt_blocks(prompt, 8, A)))
    _, decode, _, fp = place(placer, prompt=prompt, mode="local")
    assert fp == A and decode.report.worker_id == "d-a2"     # the cache-aware choice, within build A


def test_serving_model_ties_break_alike_everywhere():
    table, _, _ = cluster(("d-b", "decode", B), ("d-a", "decode", A))
    states = table.alive("decode")
    assert ServingModel().choose(states) == A == ServingModel().choose(list(reversed(states)))
