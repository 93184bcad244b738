"""A NATS client that runs inside a simulated host (``python -m tests.cluster.client_main``): sends every request of
a JSON file at once to ``di.v1.generate``, records each stream with the chaos harness's ``stream_request`` (gaps,
duplicates, late chunks, errors, client timeouts), and writes one JSON object per request to ``--out``.

Input: ``[{"request_id", "prompt_token_ids", "max_tokens"}, ...]`` (greedy, ``ignore_eos``). Credentials come from
``DEEPINFER_NATS_USER``/``DEEPINFER_NATS_PASSWORD``. Once every request is published it writes ``--started``
(an empty file), so a test can inject its fault while the streams run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from shared import protocol
from shared.bus import connect
from tests.chaos.harness import stream_request


async def run(args: argparse.Namespace) -> int:
    jobs = json.loads(Path(args.requests).read_text())
    nc = await connect(args.url, "cluster-test-client", user=os.environ.get("DEEPINFER_NATS_USER", ""),
                       password=os.environ.get("DEEPINFER_NATS_PASSWORD", ""))
    try:
        requests = [protocol.GenerateRequest(request_id=j["request_id"], prompt_token_ids=j["prompt_token_ids"],
                                             max_tokens=j["max_tokens"], temperature=0.0, ignore_eos=True,
                                             timeout_s=args.timeout_s) for j in jobs]
        tasks = [asyncio.create_task(stream_request(nc, r, idle_timeout_s=args.idle_timeout_s)) for r in requests]
        await asyncio.sleep(0.2)
        Path(args.started).write_text("")
        outcomes = await asyncio.gather(*tasks)
    finally:
        await nc.close()
    rows = [{"request_id": o.request.request_id, "tokens": o.tokens, "completed": o.completed, "gaps": o.gaps,
             "duplicates": o.duplicates, "late": o.late, "error": o.error, "client_timeout": o.client_timeout,
             "usage": o.usage} for o in outcomes]
    Path(args.out).write_text(json.dumps(rows))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.client_main")
    parser.add_argument("--url", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--started", required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--idle-timeout-s", type=float, default=30.0)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
