"""NATS users and permissions (shared/nats_auth.py): who may publish and subscribe what, generated from
shared/subjects.py; the rendered configs (and the checked-in compose/nats.conf) are what nats-server accepts."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from shared import nats_auth, subjects
from shared.nats_auth import LAUNCHER, MONITOR, ROLES, NatsUser, Permissions, permissions
from shared.nats_server import find_nats_server

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("router", "prefill", "decode", "draft", "cache-tier")
TENANTS = ["acme", "b-2"]
ALL_USERS = [*nats_auth.user_names(TENANTS), LAUNCHER]


def publishers(pattern: str) -> set[str]:
    return {u for u in ALL_USERS if pattern in permissions(u, TENANTS).publish}


def subscribers(pattern: str) -> set[str]:
    return {u for u in ALL_USERS if pattern in permissions(u, TENANTS).subscribe}


def test_clients_publish_only_the_client_api_and_hear_only_their_inbox():
    assert permissions("client") == Permissions(publish=(subjects.GENERATE, subjects.CANCEL, subjects.HELD),
                                                subscribe=("_INBOX.client.>",))
    assert permissions("client-acme") == Permissions(
        publish=(subjects.generate_as("acme"), subjects.cancel_as("acme"), subjects.held_as("acme")),
        subscribe=("_INBOX.client-acme.>",))
    assert permissions(MONITOR) == Permissions(publish=("di.v1.ctl.*.stats",),
                                               subscribe=(subjects.LOAD_ALL, "_INBOX.monitor.>"), allow_responses=True)
    # `deepinfer up` answers the planner's scale asks and the operator's client asks as the launcher: those
    # subjects, its inbox, nothing else; the operator (admin) may only ask
    assert permissions(LAUNCHER) == Permissions(publish=("_INBOX.launcher.>",),
                                                subscribe=(subjects.launcher_scale(), subjects.launcher_clients(),
                                                           "_INBOX.launcher.>"),
                                                allow_responses=True)
    assert permissions(nats_auth.ADMIN) == Permissions(publish=(subjects.launcher_clients(),),
                                                       subscribe=("_INBOX.admin.>",))


def test_only_the_owning_roles_publish_control_traffic():
    for user in SERVICES:  # heartbeats: each role under its own role only
        assert publishers(subjects.load_role(nats_auth.HEARTBEAT_ROLE[user])) == {user}
    assert publishers(subjects.LOAD_ALL) == set()
    assert publishers(subjects.KV_EVENTS) == {"prefill", "decode", "cache-tier"}
    assert publishers(subjects.PREFILL_ALL) == {"router"}
    assert publishers(subjects.DECODE_ALL) == {"router", "prefill", "decode"}  # dispatch; hand-off; migration
    assert publishers(subjects.DRAFT_ALL) == {"decode"}
    assert publishers(subjects.KV_PULL_ALL) == {"prefill", "decode", "cache-tier"}
    assert publishers(subjects.cache_all("put")) == publishers(subjects.cache_all("get")) == {"prefill", "decode"}
    assert publishers(subjects.CANCEL) == {"client"}            # clients ask the router ...
    assert publishers(subjects.WORK_CANCEL) == {"router"}       # ... which alone tells workers
    assert publishers(subjects.GENERATE) == {"client"}
    assert publishers(subjects.ctl_all("probe")) == publishers(subjects.ctl_all("kv_snapshot")) == {"router"}
    assert publishers(subjects.ctl_all("migrate")) == {"router"}    # orders to move a stream
    assert publishers(subjects.ctl_all("stats")) == {MONITOR}
    assert publishers(subjects.REGISTRY_KV) == set(SERVICES)
    for api in subjects.REGISTRY_API:
        assert publishers(api) == set(SERVICES)
    # token chunks: the workers write to the router's inboxes (PrefillRequest.reply_to), the router to clients'
    assert publishers(subjects.inbox_all("router")) == {"router", "prefill", "decode"}
    for client in ("client", "client-acme", "client-b-2"):
        assert publishers(subjects.inbox_all(client)) == {"router"}


def test_subscriptions_follow_the_services():
    assert subscribers(subjects.GENERATE) == subscribers(subjects.GENERATE_TENANTS) == {"router"}
    assert subscribers(subjects.CANCEL_TENANTS) == {"router"}
    assert subscribers(subjects.CANCEL) == {"router"}
    assert subscribers(subjects.WORK_CANCEL) == {"prefill", "decode"}
    assert subscribers(subjects.KV_EVENTS) == {"router"}
    assert subscribers(subjects.LOAD_ALL) == {"router", "prefill", "decode", MONITOR}  # workers follow their tier
    assert subscribers(subjects.PREFILL_ALL) == {"prefill"}
    assert subscribers(subjects.DECODE_ALL) == {"decode"}
    assert subscribers(subjects.DRAFT_ALL) == {"draft"}
    for op in subjects.CACHE_OPS:
        assert subscribers(subjects.cache_all(op)) == {"cache-tier"}
    assert subscribers(subjects.ctl_all("stats")) == set(SERVICES)
    assert {u for u in ALL_USERS if permissions(u, TENANTS).allow_responses} == {*SERVICES, MONITOR, LAUNCHER}
    assert subscribers(subjects.launcher_scale()) == {LAUNCHER}     # no monitor credential can answer the planner
    assert {u for u in ALL_USERS if subjects.launcher_scale() in permissions(u, TENANTS).publish} == {"router"}


def test_every_user_hears_no_inbox_but_its_own_and_no_full_wildcard():
    for user in ALL_USERS:
        perms = permissions(user, TENANTS)
        inboxes = [s for s in perms.subscribe if s.startswith(subjects.INBOX_ROOT)]
        assert inboxes == [f"_INBOX.{user}.>"], user
        for pattern in perms.publish + perms.subscribe:  # no "di.v1.>" or ">": only inboxes and the registry
            if pattern.endswith(">"):
                assert pattern.startswith("_INBOX.") or pattern == subjects.REGISTRY_KV, (user, pattern)


def test_router_streams_only_to_the_configured_clients():
    inboxes = [s for s in permissions("router", TENANTS).publish if s.startswith("_INBOX.client")]
    assert inboxes == ["_INBOX.client.>", "_INBOX.client-acme.>", "_INBOX.client-b-2.>"]
    assert [s for s in permissions("router").publish if s.startswith("_INBOX.client")] == ["_INBOX.client.>"]


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "x*", 'q"', "ü", "a>"])
def test_bad_tenant_names_are_refused(bad):
    with pytest.raises(ValueError):
        nats_auth.tenant_user(bad)
    with pytest.raises(ValueError):
        permissions("client-" + bad)


def test_unknown_user_is_refused():
    with pytest.raises(ValueError, match="unknown NATS user"):
        permissions("root")


def test_passwords_are_fresh_and_config_safe():
    a, b = nats_auth.generate_passwords(TENANTS), nats_auth.generate_passwords(TENANTS)
    assert list(a) == [*ROLES, MONITOR, "client-acme", "client-b-2"]
    assert set(a.values()).isdisjoint(b.values()) and len(set(a.values())) == len(a)
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{32}", pw) for pw in a.values())
    assert list(nats_auth.generate_passwords(monitor=False)) == list(ROLES)


def test_tenant_of_user():
    assert nats_auth.tenant_of_user("client-acme") == "acme"
    assert nats_auth.tenant_of_user("client") is None and nats_auth.tenant_of_user("client-") is None
    assert nats_auth.tenant_of_user("router") is None


def test_render_refuses_unsafe_passwords_and_duplicates():
    with pytest.raises(ValueError, match="password"):
        nats_auth.render_server_config(listen="127.0.0.1:1", users=[NatsUser("client", 'x"y')])
    with pytest.raises(ValueError, match="password"):
        nats_auth.render_server_config(listen="127.0.0.1:1", users=[NatsUser("client", "")])
    with pytest.raises(ValueError, match="duplicate"):
        nats_auth.render_server_config(listen="127.0.0.1:1", users=[NatsUser("client", "a"), NatsUser("client", "b")])
    assert "authorization" not in nats_auth.render_server_config(listen="127.0.0.1:1")


def test_checked_in_compose_conf_is_the_generated_one():
    """compose/nats.conf never drifts from subjects.py: regenerate with
    `python -m shared.nats_auth compose --monitor > compose/nats.conf` (compose runs the monitor user for
    `deepinfer status`); its header names that command."""
    text = (ROOT / "compose" / "nats.conf").read_text()
    assert text == nats_auth.render_compose_config(monitor=True)
    assert text.startswith("# Generated by `python -m shared.nats_auth compose --monitor` ")


def test_cli_prints_the_compose_config(capsys):
    assert nats_auth.main(["compose"]) == 0
    assert capsys.readouterr().out == nats_auth.render_compose_config()
    assert nats_auth.main(["compose", "--monitor", "--tenants", "acme,b-2"]) == 0
    out = capsys.readouterr().out
    assert out == nats_auth.render_compose_config(TENANTS, monitor=True)
    assert out.startswith("# Generated by `python -m shared.nats_auth compose --monitor --tenants acme,b-2` ")
    assert nats_auth.main(["env", "--tenants", "acme"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("=")[0] for line in lines] == [*(nats_auth.password_env(r) for r in ROLES),
                                                      "NATS_PASSWORD_CLIENT_ACME"]


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([find_nats_server(), "-t", "-c", str(path)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=30)


def test_nats_server_accepts_the_compose_config(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_auth.render_compose_config(TENANTS, monitor=True))
    env = {nats_auth.password_env(u): "pw" for u in ALL_USERS}
    proc = check_config(conf, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unset = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if not k.startswith("NATS_PASSWORD_")},
                           timeout=30)
    assert unset.returncode != 0 and "NATS_PASSWORD_ROUTER" in unset.stdout + unset.stderr


def test_nats_server_accepts_a_generated_config(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_auth.render_server_config(
        listen="127.0.0.1:4222", store_dir=str(tmp_path / "js"),
        users=nats_auth.users(nats_auth.generate_passwords(TENANTS), TENANTS)))
    proc = check_config(conf, {})
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- launcher and CLI ---------------------------------------------------------------------------------
def test_cluster_spec_refuses_auth_it_cannot_provide():
    from cli.launcher import ClusterSpec

    with pytest.raises(ValueError, match="embedded"):
        ClusterSpec(auth=True, nats_url="nats://127.0.0.1:4222", cache_tier=0)
    with pytest.raises(ValueError, match="auth"):
        ClusterSpec(tenants=["a"], cache_tier=0)
    with pytest.raises(ValueError):
        ClusterSpec(auth=True, tenants=["a.b"], cache_tier=0)


def test_children_get_their_instance_credentials_in_the_environment_only(monkeypatch, tmp_path):
    import shutil

    from cli import launcher

    spawned = {}

    class FakePopen:
        def __init__(self, argv, env, **kwargs):
            spawned[argv[2]] = (argv, env)
            self.pid = 1
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    cluster = launcher.Cluster(launcher.ClusterSpec(auth=True, tenants=["acme"], cache_tier=0, metrics=False))
    try:
        cluster.nats_url = "nats://127.0.0.1:4222"
        cluster.spawn_worker("prefill", 0)
        cluster.spawn_worker("decode", 0)
        cluster.spawn_tier(0)
        cluster.spawn_draft(0)
        cluster.respawn_router()
    finally:
        shutil.rmtree(cluster.log_dir, ignore_errors=True)
    roles = {"services.prefill": "prefill", "services.decode": "decode", "services.cache_tier": "cache-tier",
             "services.draft": "draft", "services.router": "router"}
    assert set(spawned) == set(roles)
    for module, (argv, env) in spawned.items():   # each its own instance user <role>.<service id>
        user = nats_auth.instance_user(roles[module], argv[argv.index("--worker-id") + 1])
        assert (env["DEEPINFER_NATS_USER"], env["DEEPINFER_NATS_PASSWORD"]) == cluster.credentials(user)
        assert not any(pw in " ".join(argv) for pw in cluster.passwords.values())
    user, password = cluster.client_credentials
    assert user == "client" and cluster.client_url() == f"nats://client:{password}@127.0.0.1:4222"
    assert cluster.client_url(tenant="acme") == f"nats://client-acme:{cluster.passwords['client-acme']}@127.0.0.1:4222"
    with pytest.raises(KeyError):
        cluster.credentials("client-other")


def test_no_auth_cluster_has_no_credentials():
    import shutil

    from cli.launcher import Cluster, ClusterSpec

    cluster = Cluster(ClusterSpec(cache_tier=0, metrics=False))
    shutil.rmtree(cluster.log_dir, ignore_errors=True)
    cluster.nats_url = "nats://127.0.0.1:4222"
    assert cluster.client_credentials == ("", "") and cluster.client_url() == cluster.nats_url


def test_cli_auth_flags(monkeypatch, tmp_path):
    from cli.main import build_parser
    from cli.up import run as run_up

    args = build_parser().parse_args(["up"])
    assert not args.no_auth and args.tenants == ""
    assert build_parser().parse_args(["up", "--no-auth"]).no_auth
    assert run_up(build_parser().parse_args(["up", "--no-auth", "--tenants", "a"])) == 2  # before starting anything
    assert run_up(build_parser().parse_args(["up", "--tenants", "a.b"])) == 2
    # an existing server: its passwords, or an explicit --no-auth (never silently without authentication)
    assert run_up(build_parser().parse_args(["up", "--nats", "nats://127.0.0.1:1"])) == 2
    from cli.up import spec_from_args
    assert not spec_from_args(build_parser().parse_args(["up", "--nats", "nats://127.0.0.1:1", "--no-auth"])).auth
    env = tmp_path / "cluster.env"
    env.write_text("".join(f"{nats_auth.password_env(u)}={p}\n" for u, p in nats_auth.generate_passwords().items()))
    spec = spec_from_args(build_parser().parse_args(["up", "--nats", "nats://127.0.0.1:1", "--passwords-file", str(env)]))
    assert spec.auth and spec.passwords["router"] and spec.nats_url == "nats://127.0.0.1:1"
    planner = ["up", "--nats", "nats://127.0.0.1:1", "--passwords-file", str(env), "--planner",
               "--planner-max-prefill", "2"]
    with pytest.raises(ValueError, match="launcher"):   # scale requests need the launcher user on that server
        spec_from_args(build_parser().parse_args(planner))
    env.write_text(env.read_text() + f"{nats_auth.password_env(LAUNCHER)}={nats_auth.new_password()}\n")
    assert LAUNCHER in spec_from_args(build_parser().parse_args(planner)).passwords
    monkeypatch.setenv("DEEPINFER_NATS_USER", "client")
    monkeypatch.setenv("DEEPINFER_NATS_PASSWORD", "pw")
    for argv in (["generate", "hi", "--url", "nats://h:1"], ["status", "--url", "nats://h:1"]):
        args = build_parser().parse_args(argv)
        assert (args.user, args.password) == ("client", "pw")
    args = build_parser().parse_args(["status", "--url", "nats://h:1", "--user", "monitor", "--password", "x"])
    assert (args.user, args.password) == ("monitor", "x")


def test_generated_passwords_start_with_a_letter_so_nats_reads_them_as_strings(tmp_path):
    """nats-server parses a substituted $VAR as a config value: a password starting with a digit or '-' was read
    as a number ("1-W", "-W", "12-3W": a digit or "-" then a "-") and the server refused its config."""
    import subprocess
    from shared.nats_server import find_nats_server
    passwords = [nats_auth.new_password() for _ in range(500)]
    assert all(p[0].isascii() and p[0].isalpha() and len(p) == 33 for p in passwords)
    conf = tmp_path / "n.conf"
    conf.write_text("authorization { users = [ { user: a, password: $PW } ] }\n")
    for pw in ("1-W", passwords[0]):
        proc = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True,
                              timeout=30, env={"PATH": "/usr/bin:/bin", "PW": pw})
        assert (proc.returncode == 0) == (pw != "1-W"), proc.stderr
