"""The CLI's one vocabulary (``cli/flags.py``): ``up`` and ``node`` share their flags and defaults, a NATS
server is ``--nats-url`` everywhere, old spellings still work (with a warning), and every KV-budget and drafter
default is the same value."""
from __future__ import annotations

import logging

import pytest

from cli.cluster_spec import ClusterSpec
from cli.main import build_parser, main
from services.draft.config import DraftConfig
from services.worker.config import WorkerConfig
from shared.engine.config import DEFAULT_KV_CACHE_MB, EngineConfig
from shared.spec.factory import DEFAULT_DRAFTER

SHARED = ("model", "served_model_name", "dtype", "kv_cache_mb", "transports", "local_prefill_threshold", "policy",
          "admission_ttft", "cache_tier_dir", "tier_dram_mb", "no_tier_reserve", "draft", "draft_services",
          "drafter", "http_host", "http_port")


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_up_and_node_share_every_cluster_flag_with_one_default():
    up, node = vars(parse("up")), vars(parse("node", "--no-auth"))
    assert {k: up[k] for k in SHARED} == {k: node[k] for k in SHARED}


def test_one_kv_budget_and_one_drafter_default_everywhere():
    assert parse("up").kv_cache_mb == ClusterSpec().kv_cache_mb == WorkerConfig().kv_cache_mb == DEFAULT_KV_CACHE_MB
    assert EngineConfig().kv_cache_bytes == DEFAULT_KV_CACHE_MB << 20
    assert parse("bench", "--nats-url", "nats://h:1").sim_kv_cache_mb == DEFAULT_KV_CACHE_MB
    assert parse("up").drafter == ClusterSpec().drafter == WorkerConfig().drafter == DraftConfig().drafter \
        == DEFAULT_DRAFTER


@pytest.mark.parametrize("argv, dest, value", [
    (["up", "--nats", "nats://h:1"], "nats_url", "nats://h:1"),
    (["status", "--url", "nats://h:1"], "nats_url", "nats://h:1"),
    (["generate", "hi", "--url", "nats://h:1"], "nats_url", "nats://h:1"),
    (["up", "--ttft-slo", "2.5"], "admission_ttft", 2.5),
    (["bench", "--url", "nats://h:1", "--prefill", "2", "--kv-cache-mb", "64"], "sim_prefill", 2),
    (["bench", "--url", "nats://h:1", "--profile", "llama70b-h200"], "sim_profile", "llama70b-h200"),
    (["node", "--no-auth", "--nats-port", "4333"], "nats_port", 4333),
])
def test_old_spellings_store_into_the_new_flag_and_warn(argv, dest, value, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.cli"):
        args = parse(*argv)
    assert getattr(args, dest) == value
    assert "is deprecated" in caplog.text


def test_new_spellings_do_not_warn_and_measurement_slos_stay_apart(caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.cli"):
        args = parse("bench", "--nats-url", "nats://h:1", "--ttft-slo", "3", "--sim-decode", "2")
    assert (args.ttft_slo, args.sim_decode) == (3.0, 2) and not caplog.text
    assert not hasattr(args, "admission_ttft")        # bench measures SLOs; only up/node admit by one


def test_a_command_that_needs_a_nats_server_says_so(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["status"])
    assert exit_.value.code == 2 and "--nats-url is required" in capsys.readouterr().err


def test_node_listens_where_its_nats_url_says():
    from cli.node import node_spec

    spec = node_spec(parse("node", "--no-auth", "--nats-url", "nats://10.0.0.5:4333"))
    assert (spec.nats_host, spec.nats_port) == ("10.0.0.5", 4333)
    old = node_spec(parse("node", "--no-auth", "--nats-host", "10.0.0.6"))
    assert (old.nats_host, old.nats_port) == ("10.0.0.6", 4222)
