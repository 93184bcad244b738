"""Multi-host configuration, no processes: host ids, NATS server lists, cluster nodes' configs (checked by
``nats-server -t``), the passwords file every node reads, and ``deepinfer node``'s spec."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess

import pytest

from cli import node as cli_node
from shared import host_identity, nats_auth
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from shared.config import load_config, nats_servers
from shared.nats_cluster import NatsClusterNode, route_url
from shared.nats_server import find_nats_server


def test_host_id_is_distinct_per_hostname_and_machine_and_stable():
    a = host_identity.derive_host_id("node", "machine-1")
    assert a == host_identity.derive_host_id("node", "machine-1")
    assert a.startswith("node-")
    assert a != host_identity.derive_host_id("node", "machine-2")  # same hostname on another machine
    assert a != host_identity.derive_host_id("node2", "machine-1")  # another UTS namespace on one machine


def test_host_id_configured_wins_then_environment(monkeypatch):
    monkeypatch.setenv(host_identity.HOST_ID_ENV, "from-env")
    assert host_identity.host_id() == "from-env"
    assert host_identity.host_id("configured") == "configured"
    monkeypatch.delenv(host_identity.HOST_ID_ENV)
    assert host_identity.host_id() == host_identity.derive_host_id(
        host_identity.socket.gethostname(), host_identity.machine_identity())


def test_nats_url_takes_several_servers_and_the_short_flag(monkeypatch):
    assert nats_servers("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    config = load_config(RouterConfig, ["--nats", "nats://a:4222,nats://b:4222", "--registry-replicas", "3"])
    assert config.nats_url == "nats://a:4222,nats://b:4222" and config.registry_replicas == 3
    monkeypatch.setenv("DEEPINFER_NATS_URL", "nats://c:4222,nats://d:4222")
    assert nats_servers(load_config(WorkerConfig, []).nats_url) == ["nats://c:4222", "nats://d:4222"]
    with pytest.raises(ValueError, match="nats_url"):
        RouterConfig(nats_url="a:4222")
    with pytest.raises(ValueError, match="registry_replicas"):
        RouterConfig(registry_replicas=7)


def test_route_urls_and_cluster_block():
    assert route_url("10.0.0.2") == "nats-route://10.0.0.2:6222"
    assert route_url("nats-route://b:7000") == "nats-route://b:7000"
    with pytest.raises(ValueError):
        route_url("nats-route://user:pw@b:7000")  # credentials come from the node, not the address
    node = NatsClusterNode("a", routes=("b", "c:7000"), route_password="secret")
    text = "\n".join(node.render())
    assert 'server_name: "a"' in text and 'user: "route"' in text
    assert '"nats-route://route:secret@b:6222"' in text and '"nats-route://route:secret@c:7000"' in text
    with pytest.raises(ValueError):
        NatsClusterNode("a b")


def test_nats_server_accepts_a_cluster_node_config(tmp_path):
    passwords = nats_auth.generate_passwords()
    conf = tmp_path / "node.conf"
    conf.write_text(nats_auth.render_server_config(
        listen="127.0.0.1:4222", store_dir=str(tmp_path / "js"), users=nats_auth.users(passwords),
        cluster=NatsClusterNode("n1", listen="127.0.0.1:6222", routes=("127.0.0.1:6223",), route_password="pw")))
    proc = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_passwords_file_round_trip_and_refusals():
    passwords = {**nats_auth.generate_passwords(), "route": "r-pw"}
    text = "# cluster.env\n" + "".join(f"{nats_auth.password_env(u)}={p}\n" for u, p in passwords.items())
    assert nats_auth.read_passwords(text) == passwords
    with pytest.raises(ValueError, match="known user"):
        nats_auth.read_passwords(text + "NATS_PASSWORD_NOBODY=x\n")
    with pytest.raises(ValueError, match="missing"):
        nats_auth.read_passwords("NATS_PASSWORD_ROUTER=x\n")


def node_args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_node.add_parser(parser.add_subparsers(dest="command"))
    argv = ["node", "--name", "c", "--join", "10.0.0.1,10.0.0.2:7000", "--no-auth", "--decode", "2",
            "--tier", "cache-a-0"]
    return parser.parse_args(argv + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_node_spec_joins_the_cluster_and_names_its_services():
    spec = cli_node.node_spec(node_args())
    assert spec.nats_cluster.routes == ("nats-route://10.0.0.1:6222", "nats-route://10.0.0.2:7000")
    assert spec.nats_peers == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
    assert spec.registry_replicas == 3 and not spec.router and spec.http_port == -1
    assert spec.decode == 2 and spec.prefill == 0 and spec.tier_id == "cache-a-0" and not spec.auth
    from cli.launcher import Cluster

    cluster = Cluster(spec)
    assert cluster.service_id("decode", 1) == "decode-c-1"


def test_node_needs_the_route_password_with_auth(tmp_path):
    env = tmp_path / "cluster.env"
    env.write_text("".join(f"{nats_auth.password_env(u)}={p}\n" for u, p in nats_auth.generate_passwords().items()))
    args = node_args()
    args.no_auth, args.passwords_file = False, str(env)
    with pytest.raises(ValueError, match="ROUTE"):
        cli_node.node_spec(args)


def test_one_vocabulary_for_tiers_and_drafts():
    worker = load_config(WorkerConfig, ["--tier", "cache-b-0"])
    assert worker.cache_tier == "cache-b-0"  # a worker names its tier as deepinfer node --tier does
    assert load_config(WorkerConfig, ["--cache-tier", "cache-b-0"]).cache_tier == "cache-b-0"  # old spelling
    from cli import up as cli_up

    notes = []

    def spec(draft: str, services: int = 1) -> str:
        return cli_up.draft_spec(argparse.Namespace(draft=draft, draft_services=services),
                                 lambda *a, **k: notes.append(a[0]))
    assert spec("") == "" and spec("local") == "local"
    assert spec("remote") == "1" and spec("remote", 3) == "3"
    assert spec("2") == "2" and "deprecated" in notes[-1]
    with pytest.raises(ValueError, match="local or remote"):
        spec("sometimes")


def test_a_node_without_peers_runs_a_standalone_server():
    args = node_args()
    args.join = ""
    spec = cli_node.node_spec(args)
    assert spec.nats_cluster is None and spec.nats_peers == [] and spec.registry_replicas == 1


def test_up_and_node_reserve_the_tier_dram_and_size_the_kv_pool_like_the_engine():
    """``up``/``node`` fault the tiers' DRAM in at start unless told not to, and give each worker the engine's
    1 GiB KV pool (256 MiB preempted a 64-request burst); the tier service itself reserves only when asked."""
    from cli import up as cli_up
    from cli.main import build_parser
    from services.cache_tier.config import CacheTierConfig

    spec = cli_up.spec_from_args(build_parser().parse_args(["up"]), print)
    assert spec.cache_tier_reserve_dram and spec.cache_tier_dram_mb == 1024 and spec.kv_cache_mb == 1024
    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--no-tier-reserve", "--tier-dram-mb", "64"]),
                                 print)
    assert not spec.cache_tier_reserve_dram and spec.cache_tier_dram_mb == 64
    assert spec.dtype == "auto"
    assert cli_up.spec_from_args(build_parser().parse_args(["up", "--dtype", "bfloat16"]), print).dtype == "bfloat16"
    assert cli_node.node_spec(node_args()).cache_tier_reserve_dram
    assert not load_config(CacheTierConfig, []).reserve_dram
    assert load_config(CacheTierConfig, ["--reserve-dram", str(True)]).reserve_dram   # as the launcher passes it


def test_up_switchable_and_planner_flags_reach_the_workers_and_the_router(tmp_path):
    """``up --switchable --planner``: workers run ``services.switchable`` as ``worker-<n>`` with their starting
    role, the router gets ``--planner true``; switchable workers with auth need the embedded server."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.cluster_spec import ClusterSpec
    from cli.launcher import Cluster

    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--prefill", "1", "--decode", "2", "--switchable",
                                                            "--planner", "--cache-tier-dir", str(tmp_path)]), print)
    assert spec.switchable and spec.planner
    cluster = Cluster(spec)
    assert [cluster.worker_id("prefill", 0), cluster.worker_id("decode", 0), cluster.worker_id("decode", 1)] == \
        ["worker-0", "worker-1", "worker-2"]
    args = cluster.router_args()
    assert args[args.index("--planner") + 1] == "true"
    assert load_config(RouterConfig, ["--planner", "true"]).planner
    assert load_config(WorkerConfig, ["--switchable", "true"]).switchable
    with pytest.raises(ValueError, match="switchable"):
        ClusterSpec(switchable=True, auth=True, nats_url="nats://x:4222", passwords={"router": "p"}, cache_tier=0)
    with pytest.raises(ValueError):
        RouterConfig(planner_scaler="helm")


def test_swa_kv_context_reaches_each_worker_and_its_engine(monkeypatch, tmp_path):
    """``up --swa-kv-context N`` (and ``node``): every worker is started with it and sizes its engine's
    full/window split by it; 0 (the default) leaves the engine's own default."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.launcher import Cluster

    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--swa-kv-context", "8192", "--cache-tier-dir",
                                                            str(tmp_path)]), print)
    assert spec.swa_kv_context == 8192 and cli_node.node_spec(node_args()).swa_kv_context == 0
    assert cli_node.node_spec(node_args(swa_kv_context=2048)).swa_kv_context == 2048
    spawned = []
    monkeypatch.setattr(Cluster, "_spawn", lambda self, name, module, argv, *rest: spawned.append(argv))
    Cluster(spec).spawn_worker("decode", 0)
    assert spawned[0][spawned[0].index("--swa-kv-context") + 1] == "8192"
    assert load_config(WorkerConfig, spawned[0][spawned[0].index("--swa-kv-context"):][:2]).swa_kv_context == 8192
    with pytest.raises(ValueError, match="swa_kv_context"):
        WorkerConfig(swa_kv_context=-1)


def test_the_mtp_drafter_is_refused_for_draft_services():
    from cli.cluster_spec import ClusterSpec

    with pytest.raises(ValueError, match="inside the decode workers"):
        ClusterSpec(model="m", draft="2", drafter="mtp")
    assert ClusterSpec(model="m", draft="local", drafter="mtp").drafter == "mtp"


def test_tier_kv_format_reaches_each_worker(monkeypatch, tmp_path):
    """``up --tier-kv-format int8`` (and ``node``): every worker talks to its tier in that format; unset, the
    flag is not passed; a bad value is refused by the worker config."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.launcher import Cluster

    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--tier-kv-format", "int8", "--cache-tier-dir",
                                                            str(tmp_path)]), print)
    assert spec.tier_kv_format == "int8" and cli_node.node_spec(node_args(tier_kv_format="fp8")).tier_kv_format == "fp8"
    spawned = []
    monkeypatch.setattr(Cluster, "_spawn", lambda self, name, module, argv, *rest: spawned.append(argv))
    Cluster(spec).spawn_worker("decode", 0)
    at = spawned[0].index("--tier-kv-format")
    assert load_config(WorkerConfig, spawned[0][at:at + 2]).tier_kv_format == "int8"
    plain = cli_up.spec_from_args(build_parser().parse_args(["up", "--cache-tier-dir", str(tmp_path)]), print)
    Cluster(plain).spawn_worker("decode", 0)
    assert "--tier-kv-format" not in spawned[1]
    with pytest.raises(ValueError, match="tier_kv_format"):
        WorkerConfig(tier_kv_format="fp4")


def test_preempt_offer_mib_reaches_each_worker_with_a_tier(monkeypatch, tmp_path):
    """``up --preempt-offer-mib 64``: every worker with a cache tier offers preempted KV to it; unset (0), the flag
    is not passed and workers recompute; a negative value is refused by the worker config."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.launcher import Cluster

    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--preempt-offer-mib", "64", "--cache-tier-dir",
                                                            str(tmp_path)]), print)
    spawned = []
    monkeypatch.setattr(Cluster, "_spawn", lambda self, name, module, argv, *rest: spawned.append(argv))
    Cluster(spec).spawn_worker("decode", 0)
    at = spawned[0].index("--preempt-offer-mib")
    assert load_config(WorkerConfig, spawned[0][at:at + 2]).preempt_offer_mib == 64
    plain = cli_up.spec_from_args(build_parser().parse_args(["up", "--cache-tier-dir", str(tmp_path)]), print)
    Cluster(plain).spawn_worker("decode", 0)
    assert "--preempt-offer-mib" not in spawned[1] and WorkerConfig().preempt_offer_mib == 0
    with pytest.raises(ValueError, match="preempt_offer_mib"):
        WorkerConfig(preempt_offer_mib=-1)


def test_scheduling_policy_reaches_each_worker(monkeypatch):
    """``up --scheduling-policy priority`` (and ``node``): every worker's engine schedules by priority; a bad
    value is refused by the flag and by the engine config."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.launcher import Cluster

    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--scheduling-policy", "priority"]), print)
    assert spec.scheduling_policy == "priority"
    assert cli_node.node_spec(node_args(scheduling_policy="priority")).scheduling_policy == "priority"
    spawned = []
    monkeypatch.setattr(Cluster, "_spawn", lambda self, name, module, argv, *rest: spawned.append(argv))
    Cluster(spec).spawn_worker("prefill", 0)
    at = spawned[0].index("--scheduling-policy")
    assert load_config(WorkerConfig, spawned[0][at:at + 2]).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--scheduling-policy", "edf"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        WorkerConfig(scheduling_policy="edf")


def test_rope_scaling_reaches_each_worker_and_a_bad_one_is_refused_at_start(monkeypatch, tmp_path):
    """``up --rope-scaling JSON`` (and ``node``): every worker is started with it; a worker refuses what is not a
    JSON object before loading anything; the model-side meaning is tests/model/test_architectures_vs_transformers."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.launcher import Cluster

    yarn = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}'
    spec = cli_up.spec_from_args(build_parser().parse_args(["up", "--rope-scaling", yarn, "--cache-tier-dir",
                                                            str(tmp_path)]), print)
    assert spec.rope_scaling == yarn and cli_node.node_spec(node_args(rope_scaling=yarn)).rope_scaling == yarn
    spawned = []
    monkeypatch.setattr(Cluster, "_spawn", lambda self, name, module, argv, *rest: spawned.append(argv))
    Cluster(spec).spawn_worker("decode", 0)
    config = load_config(WorkerConfig, spawned[0][spawned[0].index("--rope-scaling"):][:2])
    assert config.rope_scaling_dict() == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    spawned.clear()
    Cluster(cli_up.spec_from_args(build_parser().parse_args(["up", "--cache-tier-dir", str(tmp_path)]), print)
            ).spawn_worker("decode", 0)
    assert "--rope-scaling" not in spawned[0] and WorkerConfig().rope_scaling_dict() is None
    for bad in ("yarn", "[4]"):
        with pytest.raises(ValueError, match="rope_scaling"):
            WorkerConfig(rope_scaling=bad)


def test_with_rope_scaling_extends_the_context_and_refuses_what_it_cannot_mean():
    from shared.model.config import LatentAttention, with_rope_scaling
    from tests.model_factory import random_model_config

    base = random_model_config(arch="qwen2", max_position_embeddings=32768)
    yarn = with_rope_scaling(base, {"rope_type": "yarn", "factor": 4})
    assert yarn.max_position_embeddings == 131072
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert with_rope_scaling(base, {"type": "linear", "factor": 2, "original_max_position_embeddings": 16384}
                             ).max_position_embeddings == 32768
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert with_rope_scaling(base, llama3).max_position_embeddings == 32768  # rescales within the context
    for bad in ({"rope_type": "longrope", "factor": 4}, {"rope_type": "yarn", "factor": 0.5}, "yarn"):
        with pytest.raises(ValueError, match="rope"):
            with_rope_scaling(base, bad)
    mla = dataclasses.replace(base, mla=LatentAttention(None, 32, 16, 8, 16))
    with pytest.raises(ValueError, match="DeepSeek"):
        with_rope_scaling(mla, {"rope_type": "yarn", "factor": 4})
