"""Admission control, live: with a TTFT SLO, a burst well above capacity gets early `overloaded` errors
(before any token) while every admitted request finishes with the exact greedy output."""
import asyncio

import pytest

from cli.launcher import Cluster, ClusterSpec
from cli.main import build_parser
from shared import protocol
from services.router.config import RouterConfig
from shared.config import load_config
from shared.errors import DeepinferError, ErrorCode
from tests.integration.services_harness import InProcessCluster, generate_once, reference_outputs
from tests.model_factory import write_tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=1024)


async def test_burst_above_capacity_is_shed_early_and_admitted_requests_finish(nats_server, folder):
    # the router predicts with the smollm2-cpu profile: one 100-token prefill ~0.33 s, so a 1 s SLO admits a
    # queue of about three such prompts on the one worker and sheds the rest of a burst of 24
    prompts = [[3 + i, *range(10 + i, 109 + i)] for i in range(24)]
    expected = reference_outputs(folder, prompts, 8)
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, router_kw={"ttft_slo_s": 1.0}):
        async def one(prompt):
            try:
                return await generate_once(nats_server.url, protocol.GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True))
            except DeepinferError as err:
                return err

        results = await asyncio.gather(*(one(p) for p in prompts))
        after = await one(prompts[0])  # once the burst is over, the same request is admitted again
    rejected = [r for r in results if isinstance(r, DeepinferError)]
    admitted = [(r, want) for r, want in zip(results, expected) if not isinstance(r, DeepinferError)]
    assert all(err.code == ErrorCode.OVERLOADED and "predicted TTFT" in err.message for err in rejected)
    assert len(rejected) >= 12 and len(admitted) >= 2, (len(rejected), len(admitted))
    for (ids, _, usage), want in admitted:
        assert ids == want and usage["completion_tokens"] == 8
    assert not isinstance(after, DeepinferError) and after[0] == expected[0]


def test_up_ttft_slo_reaches_the_router():
    """`deepinfer up --ttft-slo S` → ClusterSpec → the router's command line → RouterConfig.ttft_slo_s."""
    args = build_parser().parse_args(["up", "--ttft-slo", "2.5"])
    cluster = Cluster(ClusterSpec(ttft_slo_s=args.admission_ttft, nats_url="nats://127.0.0.1:1"))
    config = load_config(RouterConfig, cluster.router_args())
    assert config.ttft_slo_s == 2.5 and config.nats_url == "nats://127.0.0.1:1"
