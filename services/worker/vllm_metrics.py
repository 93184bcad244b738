"""A worker's metrics under vLLM's names (``vllm:*``), beside deepinfer's own (``services/worker/metrics.py``):
what vLLM dashboards, KEDA rules and the Gateway API Inference Extension's model-server protocol read (waiting and
running requests, KV-cache utilisation) works unchanged against a deepinfer worker's ``/metrics``.

Every series is labelled ``model_name`` (the model's served name, ``shared/model/locate.served_model_name``: a
router's ``--served-model-name`` is the router's own) and ``worker``, as vLLM labels its series ``model_name`` (and
one ``engine``): ``sum by (model_name)`` over workers is a deployment's figure.

Semantics, as vLLM's production-metrics docs state them, per worker:
- gauges ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (the engine's batch and queue) and
  ``vllm:kv_cache_usage_perc`` (fraction of KV blocks in use, 0-1; also under the older name
  ``vllm:gpu_cache_usage_perc``, which the inference extension's older releases read);
- counters ``vllm:prompt_tokens_total`` (prompt tokens prefilled here), ``vllm:generation_tokens_total`` (tokens
  sampled here), ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens looked up / found),
  ``vllm:num_preemptions_total``, ``vllm:request_success_total`` by ``finished_reason`` (stop / length);
- histograms ``vllm:time_to_first_token_seconds`` (arrival here to the first token; a hand-off's decode side
  streams no first token), ``vllm:inter_token_latency_seconds`` (gaps between a request's tokens, one observation
  per token), ``vllm:request_time_per_output_token_seconds`` (a finished request's mean),
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens`` (the
  tokens this worker streamed for a finished request: a hand-off's first token was its prefill worker's);
- ``vllm:cache_config_info`` (value 1; labels ``block_size``, ``num_gpu_blocks``: the KV pool's size).
No LoRA adapters are served, so ``vllm:lora_requests_info`` is not exported (vLLM omits it without LoRA too).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from shared.metrics.common import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, counter, gauge

V = "vllm"
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
SUCCESS_REASONS = ("stop", "length")


class VllmRequestMetrics:
    """Per-request histograms and counters, fed by ``WorkerMetrics``' events."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.labels, names, r = labels, list(labels), registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{V}:{name}", doc, names, buckets=buckets, registry=r).labels(**labels)
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens", "Number of generation tokens processed.",
                                      TOKEN_BUCKETS)
        self.prompt_total = Counter(f"{V}:prompt_tokens", "Number of prefill tokens processed.", names,
                                    registry=r).labels(**labels)
        self.generation_total = Counter(f"{V}:generation_tokens", "Number of generation tokens processed.", names,
                                        registry=r).labels(**labels)
        self._success = Counter(f"{V}:request_success", "Count of successfully processed requests.",
                                [*names, "finished_reason"], registry=r)
        for reason in SUCCESS_REASONS:   # present at 0 from the start, as vLLM's
            self._success.labels(**labels, finished_reason=reason)
        self._last: dict[str, tuple[float, int]] = {}   # request id -> (last token time, tokens so far)

    def output(self, request_id: str, start: float | None, seq: int, num_tokens: int, finish_reason: str | None,
               tpot_s: float | None, now: float) -> None:
        """One chunk of ``num_tokens`` streamed at ``now`` (``start``: the request's arrival here, if tracked)."""
        if num_tokens:
            self.generation_total.inc(num_tokens)
        last = self._last.get(request_id)
        if last is not None and num_tokens:
            gap = max(0.0, now - last[0]) / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(gap)
        count = (last[1] if last else 0) + num_tokens
        if start is not None and seq == 0:
            self.ttft.observe(max(0.0, now - start))
        if finish_reason is not None:
            self._last.pop(request_id, None)
            if finish_reason in SUCCESS_REASONS:
                self._success.labels(**self.labels, finished_reason=finish_reason).inc()
                self.generation_tokens.observe(count)
                if start is not None:
                    self.e2e.observe(max(0.0, now - start))
                if tpot_s:
                    self.tpot.observe(tpot_s)
        elif start is not None or last is not None:
            self._last[request_id] = (now, count)

    def forget(self, request_id: str) -> None:
        """The request left this worker (any outcome): no more gaps are measured for it."""
        self._last.pop(request_id, None)

    def prompt_done(self, prompt_tokens: int) -> None:
        self.prompt_total.inc(max(0, prompt_tokens))
        self.prompt_tokens.observe(max(0, prompt_tokens))


def vllm_engine_metrics(labels: dict[str, str], load: dict, block_manager, num_preemptions: int):
    """Scrape-time gauges and counters from the engine's load and block manager."""
    yield gauge(f"{V}:num_requests_running", "Number of requests in model execution batches.", labels,
                load["num_running"])
    yield gauge(f"{V}:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                load["num_waiting"])
    for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
        yield gauge(f"{V}:{name}", "KV-cache usage. 1 means 100 percent usage.", labels, load["kv_usage"])
    yield counter(f"{V}:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                  labels, block_manager.num_query_tokens)
    yield counter(f"{V}:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels,
                  block_manager.num_hit_tokens)
    yield counter(f"{V}:num_preemptions", "Cumulative number of preemption from the engine.", labels,
                  num_preemptions)
    info = GaugeMetricFamily(f"{V}:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=[*labels, "block_size", "num_gpu_blocks"])
    info.add_metric([*labels.values(), str(block_manager.block_size), str(block_manager.num_blocks)], 1.0)
    yield info
