"""The P:D planner scales a deployment whose workers cannot switch role (issue 20), with ``deepinfer up``'s
launcher as the deployment: real processes, a real nats-server under auth. Prefill is short (the TTFT SLO is set
below any prefill) while decode idles: the planner asks the launcher for a prefill worker, which starts and serves
exactly; once the load is gone the idle role shrinks back (the newest worker drains). The launcher refuses to go
past its maximum or below one worker per role."""
import asyncio

import pytest

from shared import protocol, subjects
from shared.client import generate
from shared.errors import DeepinferError, ErrorCode
from cli.launcher import Cluster, ClusterSpec
from cli.launcher_scale import LauncherScaleDesk
from tests.integration.services_harness import reference_outputs
from tests.model_factory import write_tiny_hf_folder

PLANNER_ENV = {"DEEPINFER_PLANNER_TTFT_SLO_S": "0.001", "DEEPINFER_PLANNER_TPOT_SLO_S": "100",
               "DEEPINFER_PLANNER_SUSTAIN": "2", "DEEPINFER_PLANNER_INTERVAL_S": "0.2",
               "DEEPINFER_PLANNER_COOLDOWN_S": "3", "DEEPINFER_HEARTBEAT_S": "0.2"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=2048)


async def wait_for(predicate, timeout_s: float) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


@pytest.mark.timeout(240)
async def test_the_planner_asks_the_launcher_for_a_prefill_worker_and_gives_it_back(folder):
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, model=str(folder), kv_cache_mb=32, dtype="float64",
                                  local_prefill_threshold=0, transports="stream", auth=True, metrics=False,
                                  http_port=-1, cache_tier=0, planner=True, planner_max_prefill=2,
                                  extra_env=PLANNER_ENV))
    assert cluster.scales
    def prompt(i: int) -> list[int]:   # distinct from the first token: no prefix-cache hits
        return [(7 * i + 3 * j) % 250 + 3 for j in range(600)]
    desk = LauncherScaleDesk(cluster, {"prefill": 2, "decode": 0})
    sent: dict[int, list[int]] = {}
    try:
        await cluster.start()
        await desk.start()
        nc = await cluster.connect_client()
        try:
            async def ask(i: int) -> None:
                req = protocol.GenerateRequest(prompt_token_ids=prompt(i), request_id=f"s{i}", max_tokens=4,
                                               temperature=0.0, ignore_eos=True, timeout_s=120.0,
                                               prefill_mode="remote")
                sent[i] = (await generate(nc, req))[0]
            wave = 0
            while "prefill-1" not in cluster.procs and wave < 30:   # queued prompts: prefill is short
                await asyncio.gather(*(ask(4 * wave + i) for i in range(4)))
                wave += 1
            assert "prefill-1" in cluster.procs, "the planner never scaled prefill"
            await cluster.wait_healthy(["prefill-1"], 120)
            await asyncio.gather(*(ask(1000 + i) for i in range(4)))   # two prefill workers now
            assert await wait_for(lambda: cluster.procs["prefill-1"].poll() is not None, 60), \
                "the idle prefill role never shrank back"
        finally:
            await nc.close()
        assert [sent[i] for i in sorted(sent)] == reference_outputs(folder, [prompt(i) for i in sorted(sent)], 4)
        assert desk.count("prefill") == 1 and cluster.procs["prefill-1"].returncode == 0   # a clean drain
        with pytest.raises(DeepinferError) as floor:
            desk.shrink("prefill")
        assert floor.value.code is ErrorCode.UNAVAILABLE
        router = await cluster.connect_as("router")
        try:   # the decode role has no room to grow here: the launcher says so, through the wire
            reply = await router.request(subjects.launcher_scale(),
                                         protocol.encode(protocol.ScaleRequest(role="decode", delta=1)), timeout=5)
            with pytest.raises(DeepinferError) as ceiling:
                protocol.decode_reply(reply.data, protocol.Ack)
            assert ceiling.value.code is ErrorCode.OVERLOADED
        finally:
            await router.close()
    finally:
        await desk.close()
        cluster.stop()
    log = cluster.log_tail("router", 1 << 20)
    assert "planner: scale prefill by +1" in log and "planner: scale prefill by -1" in log, log[-3000:]
    assert "not carried out" not in log, log[-3000:]   # every scale order answered (none lost to a config reload)
    for name in cluster.procs:
        assert "NATS refused" not in cluster.log_tail(name, 1 << 20), name
