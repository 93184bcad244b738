"""The CLIs' default trace resolves beside the checkout (no machine's absolute path); a missing trace is one
clear ``deepinfer: error: ...`` line naming the path and ``--trace`` (exit 2), not a traceback."""
from __future__ import annotations

from pathlib import Path

import pytest

import services
from cli import traces
from cli.main import main

REPO = Path(services.__file__).resolve().parent.parent


def test_default_trace_is_beside_the_checkout():
    assert traces.REPO_ROOT == REPO
    assert traces.DEFAULT_TRACE == REPO.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
    if not (REPO.parent / "shared" / "traces").is_dir():
        pytest.skip(f"no ../shared/traces beside the checkout {REPO}")
    resolved = traces.resolve_trace(None)
    assert Path(resolved).is_file() and resolved == str(traces.DEFAULT_TRACE)
    with open(resolved) as f:
        assert '"hash_ids"' in f.readline()


def test_explicit_trace_wins(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("")
    assert traces.resolve_trace(str(path)) == str(path)


def test_no_absolute_machine_path_in_the_clis():
    for name in ("bench.py", "simulate.py", "traces.py"):
        assert "/work/" not in (REPO / "cli" / name).read_text()


def _assert_clear_error(capsys, rc: int, path: Path) -> None:
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("deepinfer: error: invalid_request: ") and err.count("\n") == 1, err
    assert str(path) in err and "--trace" in err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("command", [["simulate"], ["bench", "--url", "nats://127.0.0.1:9"]])
def test_missing_explicit_trace_is_a_clear_error(tmp_path, capsys, command):
    missing = tmp_path / "nope.jsonl"
    _assert_clear_error(capsys, main([*command, "--trace", str(missing)]), missing)


@pytest.mark.parametrize("command", [["simulate"], ["bench", "--url", "nats://127.0.0.1:9"]])
def test_missing_default_trace_is_a_clear_error(tmp_path, capsys, monkeypatch, command):
    missing = tmp_path / "shared" / "traces" / "mooncake_synthetic.jsonl"
    monkeypatch.setattr(traces, "DEFAULT_TRACE", missing)
    rc = main(command)
    _assert_clear_error(capsys, rc, missing)
