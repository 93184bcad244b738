"""The Grafana dashboard (``compose/k8s/base/monitoring/deepinfer-dashboard.json``, also compose's and the
Kubernetes ConfigMap's) is a well-formed dashboard model, and every query in it names only metrics a live
cluster serves: router, prefill and decode workers and the cache tier (real processes, ``cli.launcher``) are
scraped after requests went through, and each name in each ``expr`` must be a sample name of a family they
expose (with its type's suffixes: ``_total`` for counters, ``_bucket`` / ``_count`` / ``_sum`` for histograms)."""
import json
import re
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cli.launcher import Cluster, ClusterSpec
from shared import protocol
from shared.client import generate
from tests.integration.conftest import connect
from tests.model_factory import write_tiny_hf_folder

DASHBOARD = Path(__file__).resolve().parents[2] / "compose" / "k8s" / "base" / "monitoring" / "deepinfer-dashboard.json"
METRIC = re.compile(r"\b(?:deepinfer_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_is_a_grafana_dashboard_model():
    """The fields Grafana's dashboard model needs, panels on the 24-column grid with unique ids, each query
    panel with Prometheus targets (refId, expr) on the dashboard's data-source variable."""
    d = dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    queries = [p for p in d["panels"] if p["type"] != "row"]
    assert len(queries) >= 20 and {p["type"] for p in queries} == {"timeseries"}
    for p in d["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    for p in queries:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]


def sample_names(body: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(body):
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
    return names


async def test_every_dashboard_query_names_metrics_a_live_cluster_serves(nats_server, tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=8)
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, nats_url=nats_server.url, model=str(folder), kv_cache_mb=32,
                                  local_prefill_threshold=0, dtype="float64", http_port=0, planner=True,
                                  extra_env={"DEEPINFER_PLANNER_INTERVAL_S": "0.2"}))
    served: set[str] = set()
    try:
        await cluster.start()
        nc = await connect(nats_server.url)
        try:
            for i, mode in enumerate(["remote", "local", "remote"]):
                await generate(nc, protocol.GenerateRequest(prompt_token_ids=[3 + i] + list(range(10, 40)),
                                                            max_tokens=4, temperature=0.0, ignore_eos=True,
                                                            prefill_mode=mode))
        finally:
            await nc.close()
        async with aiohttp.ClientSession() as http:
            urls = [f"{cluster.http_url}/metrics"] + [f"http://127.0.0.1:{port}/metrics"
                                                      for port in cluster.metrics_ports.values()]
            for url in urls:
                async with http.get(url) as resp:
                    assert resp.status == 200, url
                    served |= sample_names(await resp.text())
    finally:
        cluster.stop()
    missing = {(p["title"], name) for p in dashboard()["panels"] for t in p.get("targets", [])
               for name in METRIC.findall(t["expr"]) if name not in served}
    assert not missing, sorted(missing)
    assert "vllm:num_requests_waiting" in served and "deepinfer_router_ledger_cost_total" in served
