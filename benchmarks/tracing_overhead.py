"""What tracing costs on the served path: output tokens/s and TTFT of the whole bench prompt set through
``deepinfer up``'s processes (SmolLM2-135M fp32, router + one prefill + one decode worker, remote prefill, the
plain NATS API, greedy) with tracing off vs on (``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a collector this
script runs: an HTTP server that counts the OTLP requests and spans it is sent). One run each, alternating.

    python -m benchmarks.tracing_overhead [--prompts 64] [--tokens 32] [--concurrency 16]
"""
from __future__ import annotations

import argparse
import asyncio
import http.server
import logging
import statistics
import threading
import time

from benchmarks.e2e_services import pct
from benchmarks.engine_throughput import load_prompt_set
from benchmarks.slo_classes import ttft
from cli.launcher import Cluster, ClusterSpec
from shared import protocol
from shared.bus import connect

logger = logging.getLogger("tracing_overhead")


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP stand-in: counts POSTs and the spans in them."""
    posts = 0
    spans = 0

    def do_POST(self):   # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        sent = ExportTraceServiceRequest.FromString(body)
        Collector.posts += 1
        Collector.spans += sum(len(ss.spans) for rs in sent.resource_spans for ss in rs.scope_spans)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


async def run(traced: bool, endpoint: str, args, prompts: list[list[int]]) -> dict:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint} if traced else {}
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, cache_tier=0, metrics=False, http_port=-1,
                                  local_prefill_threshold=0, extra_env=env))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "bench")
        limit = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int, p: list[int]):
            async with limit:
                return await ttft(nc, protocol.GenerateRequest(prompt_token_ids=p, max_tokens=args.tokens,
                                                              temperature=0.0, ignore_eos=True,
                                                              prefill_mode="remote", request_id=f"r{i}"))
        await bounded(-1, prompts[0])   # warm-up
        t0 = time.perf_counter()
        done = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)   # the services flush their spans as they close
    ttfts = [t or 0.0 for t, _, _ in done]
    return {"tok_s": sum(n for _, n, _ in done) / wall, "ttft_p50": statistics.median(ttfts), "ttft_p99": pct(ttfts, 0.99)}


async def main_async(args) -> None:
    prompts = load_prompt_set("distinct", args.prompts)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    try:
        off = await run(False, endpoint, args, prompts)
        on = await run(True, endpoint, args, prompts)
    finally:
        server.shutdown()
        server.server_close()
    for name, r in (("off", off), ("on", on)):
        logger.info("  tracing %-3s: %.1f output tok/s, TTFT p50 %.0f ms p99 %.0f ms", name, r["tok_s"],
                    r["ttft_p50"] * 1000, r["ttft_p99"] * 1000)
    logger.info("tracing on / off throughput: %.3fx; collector got %d spans in %d requests (%d requests sent)",
                on["tok_s"] / off["tok_s"], Collector.spans, Collector.posts, len(prompts) + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
