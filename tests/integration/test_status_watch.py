"""``deepinfer status --watch`` (``cli/status_watch.py``) against a live in-process cluster over a real
nats-server: frames drawn through ``rich``'s own recording console show every worker by role with its load and
KV bar, the router, the cache tier's blocks after a write-back, and the frame count requested; with no service
up the frame says so."""
from rich.console import Console

from cli import status_watch
from shared import protocol
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, generate_once, wait_until
from tests.model_factory import write_tiny_hf_folder


async def test_watch_draws_workers_router_and_tier(nats_server, tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=3)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, tier_dir=tmp_path / "tier") as cluster:
        req = protocol.GenerateRequest(prompt_token_ids=list(range(5, 40)), max_tokens=4, temperature=0.0,
                                       ignore_eos=True, prefill_mode="remote")
        await generate_once(nats_server.url, req)
        assert await wait_until(lambda: cluster.tier.store.stats()["dram_blocks"] > 0, timeout=20)
        nc = await connect(nats_server.url)
        try:
            console = Console(record=True, width=220, force_terminal=True, color_system=None)
            drawn = await status_watch.watch(nc, interval_s=0.6, listen_s=0.5, frames=2, console=console)
        finally:
            await nc.close()
        router_id = cluster.router.config.worker_id
    text = console.export_text()
    assert drawn == 2
    for title in ("workers", "routers", "cache tiers", "recent planner decisions"):
        assert title in text
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("│") and len(line.split()) > 2}
    assert "prefill" in lines["prefill-0"] and "decode" in lines["decode-0"] and "serving" in lines["decode-0"]
    assert "%" in lines["decode-0"] and router_id in lines and "off" in lines[router_id]   # KV bar; no planner
    tier = lines["cache-0"].split("│")
    assert int(tier[2]) > 0   # DRAM blocks after the write-back


def test_a_frame_without_services_says_so():
    console = Console(record=True, width=120)
    console.print(status_watch.render({"services": {}}))
    assert "no deepinfer service heartbeated" in console.export_text()
