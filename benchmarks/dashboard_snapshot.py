"""The Grafana dashboard rendered from a live cluster, without Grafana: a real Prometheus (Debian's ``prometheus``
package) scrapes a ``deepinfer`` cluster that serves a mixed load, then every panel of
``compose/k8s/base/monitoring/deepinfer-dashboard.json`` is drawn by matplotlib from Prometheus's own answers to
the panel's queries (``/api/v1/query_range``: PromQL evaluated by Prometheus, not by us).

The cluster: router (HTTP, the P:D planner on), one prefill and one decode worker (switchable) and a cache tier
(SmolLM2-135M, one engine thread each), every service's ``/metrics`` scraped every 2 s. The load, over ``--seconds``: chat requests of the bench prompts in
the ``interactive``, ``standard`` and ``batch`` classes, a third of them repeats (prefix hits), remote and local
prefill (one decode worker: nothing migrates, so those panels stay empty). Prints each panel with the number of
series it drew (a panel with none names the queries that returned nothing).

    python -m benchmarks.dashboard_snapshot [--seconds 90] [--out dashboard.png]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from benchmarks import plots
from benchmarks.engine_throughput import load_prompt_set
from cli.launcher import Cluster, ClusterSpec
from shared import progress, protocol
from shared.bus import connect
from shared.client import generate
from shared.errors import DeepinferError
from shared.nats_server import free_port

logger = logging.getLogger("dashboard_snapshot")
DASHBOARD = Path(__file__).resolve().parents[1] / "compose/k8s/base/monitoring/deepinfer-dashboard.json"
SCRAPE_S = 2


def prometheus_config(targets: list[str], path: Path) -> None:
    path.write_text("global:\n  scrape_interval: %ds\n  evaluation_interval: %ds\nscrape_configs:\n"
                    "  - job_name: deepinfer\n    static_configs:\n      - targets: [%s]\n"
                    % (SCRAPE_S, SCRAPE_S, ", ".join(f"'{t}'" for t in targets)))


def query_range(base: str, expr: str, start: float, end: float) -> list[dict]:
    """Prometheus's answer to ``expr`` over ``[start, end]`` (matrix: a list of {metric, values})."""
    qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": SCRAPE_S})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{qs}", timeout=30) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


async def load(cluster: Cluster, seconds: float) -> int:
    """Mixed chat load until ``seconds`` have passed; returns the requests answered."""
    prompts = load_prompt_set("distinct", 64)
    nc = await connect(cluster.nats_url, "dashboard")
    rng, end, done = random.Random(3), time.monotonic() + seconds, 0

    async def one(i: int) -> int:
        prompt = prompts[rng.randrange(8)] if rng.random() < 0.33 else prompts[8 + i % 56]
        req = protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=rng.choice([8, 16, 32]),
                                       temperature=0.0, ignore_eos=True, timeout_s=120.0,
                                       slo_class=rng.choice(["interactive", "standard", "batch"]),
                                       prefill_mode=rng.choice(["remote", "local"]))
        try:
            await generate(nc, req)
            return 1
        except DeepinferError:
            return 0
    try:
        i = 0
        with progress.bar(seconds, "load", "s") as shown:
            while time.monotonic() < end:
                batch = await asyncio.gather(*(one(i + k) for k in range(4)))
                done, i = done + sum(batch), i + 4
                shown.n = min(seconds, seconds - (end - time.monotonic()))
                shown.refresh()
    finally:
        await nc.close()
    return done


def series_label(metric: dict, legend: str) -> str:
    if legend:
        return legend.replace("{{", "{").replace("}}", "}").format_map(_Missing(metric))
    return ",".join(f"{k}={v}" for k, v in sorted(metric.items()) if k not in ("__name__", "instance", "job")) \
        or metric.get("__name__", "value")


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def draw(panels: list[dict], answers: list[list[tuple[str, list[dict]]]], start: float, path: str) -> None:
    cols = 4
    rows = math.ceil(len(panels) / cols)
    plt, fig, axes = plots.panels(cols, f"deepinfer dashboard, rendered from Prometheus ({DASHBOARD.name})",
                                  rows=rows, width=5.0, height=3.0)
    for ax, panel, targets in zip(axes, panels, answers):
        for legend, result in targets:
            for s in result:
                t = [float(ts) - start for ts, _ in s["values"]]
                y = [float(v) if v not in ("NaN", "+Inf", "-Inf") else math.nan for _, v in s["values"]]
                ax.plot(t, y, label=series_label(s["metric"], legend)[:40])
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in axes[len(panels):]:
        ax.axis("off")
    plots.save(plt, fig, path)


async def main_async(args) -> None:
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Prometheus: apt-get install prometheus (Debian)")
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, cache_tier=1, metrics=True, http_port=0,
                                  local_prefill_threshold=0, switchable=True, planner=True))
    await cluster.start()
    work = Path(tempfile.mkdtemp(prefix="deepinfer-prom-"))
    prom = None
    try:
        targets = [f"127.0.0.1:{port}" for port in cluster.metrics_ports.values()]
        if cluster.http_url:
            targets.append(cluster.http_url.removeprefix("http://"))
        prometheus_config(sorted(set(targets)), work / "prometheus.yml")
        port = free_port()
        prom = subprocess.Popen(["prometheus", f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        start = time.time()
        served = await load(cluster, args.seconds)
        await asyncio.sleep(3 * SCRAPE_S)    # the last scrapes
        end = time.time()
        logger.info("%d requests served in %.0f s; %d scrape targets", served, end - start, len(targets))
        answers = []
        for panel in panels:
            got = [(t.get("legendFormat", ""), query_range(base, t["expr"], start, end)) for t in panel["targets"]]
            answers.append(got)
            empty = [t["expr"] for t, (_, r) in zip(panel["targets"], got) if not r]
            logger.info("  %-45s %2d series%s", panel["title"], sum(len(r) for _, r in got),
                        f"  (none from: {'; '.join(empty)})" if empty else "")
        plots.plot_or_exit(lambda: draw(panels, answers, start, args.out))
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        await asyncio.to_thread(cluster.stop)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--out", default="dashboard.png")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
