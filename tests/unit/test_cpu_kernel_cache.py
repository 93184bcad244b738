"""The CPU attention extension's build cache is per instruction set (kernels/cpu_paged_attention.py).

It is compiled with ``-march=native``: a build made on one CPU must never be loaded on a CPU with other
instruction sets (illegal instruction). Invariants: the ISA key depends on the set of flags only (not their order
or the number of cores), any flag more or less changes it, and ``load()`` imports only the build named with this
host's key. Nothing here compiles.
"""
import platform
from pathlib import Path

import pytest

from kernels import cpu_paged_attention as cpa

AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2"
AVX512 = AVX2 + " avx512f avx512bw avx512vl"


def x86_cpuinfo(*cores: str) -> str:
    """/proc/cpuinfo text with one stanza per core, each with its ``flags`` line."""
    return "".join(f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: Some CPU @ 2.{i}GHz\n"
                   f"flags\t\t: {flags}\nvmx flags\t: vnmi ept\nbugs\t\t: spectre_v{i}\n\n"
                   for i, flags in enumerate(cores))


def test_same_flags_same_key():
    key = cpa.isa_key(x86_cpuinfo(AVX2, AVX2), "x86_64")
    assert len(key) == 12 and int(key, 16) >= 0
    assert cpa.isa_key(x86_cpuinfo(AVX2, AVX2), "x86_64") == key
    # order, repeats and core count do not matter; neither do model name, vmx flags or bugs lines
    assert cpa.isa_key(x86_cpuinfo(" ".join(reversed(AVX2.split())), AVX2, AVX2 + " avx"), "x86_64") == key
    assert cpa.isa_key(x86_cpuinfo(AVX2), "x86_64") == key


def test_different_flags_different_key():
    avx2 = cpa.isa_key(x86_cpuinfo(AVX2), "x86_64")
    assert cpa.isa_key(x86_cpuinfo(AVX512), "x86_64") != avx2
    assert cpa.isa_key(x86_cpuinfo(AVX2.replace(" bmi2", "")), "x86_64") != avx2  # one flag fewer
    assert cpa.isa_key(x86_cpuinfo(AVX2, AVX512), "x86_64") != avx2  # a core with more (hybrid CPUs)
    assert cpa.isa_key(x86_cpuinfo(AVX2), "i686") != avx2


def test_arm_features_and_fallback_without_flags():
    neon = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\nCPU part\t: 0xd0c\n"
    sve = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 sve\nCPU part\t: 0xd0c\n"
    assert cpa.isa_key(neon, "aarch64") != cpa.isa_key(sve, "aarch64")
    # no flags line (or no /proc/cpuinfo): the machine alone names the build
    assert cpa.isa_key("", "arm64 arm") == cpa.isa_key("processor\t: 0\n", "arm64 arm")
    assert cpa.isa_key("", "arm64 arm") != cpa.isa_key("", "x86_64 i386")


def test_host_key_and_module_name():
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        assert cpa.host_isa_key() == cpa.isa_key(cpuinfo.read_text(errors="replace"), platform.machine())
    name = cpa.module_name()
    assert name.isidentifier() and name.endswith(f"_{cpa.host_isa_key()}")
    assert name == f"deepinfer_cpu_attention_{cpa._BUILD_DIGEST}_{cpa.host_isa_key()}"


@pytest.fixture()
def fresh_loader(monkeypatch, tmp_path):
    """``load()`` as in a new process, its cache in ``tmp_path``, importing nothing: returns the paths it
    imported."""
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_DISABLE_CPP_KERNELS", raising=False)
    imported: list[Path] = []

    def fake_import(path: Path):
        imported.append(path)
        return path.stem

    monkeypatch.setattr(cpa, "_import_built", fake_import)

    def reset() -> None:
        monkeypatch.setattr(cpa, "_module", None)
        monkeypatch.setattr(cpa, "_tried", False)

    reset()
    return imported, reset


def test_load_imports_only_this_cpus_build(monkeypatch, fresh_loader):
    imported, reset = fresh_loader
    names = {}
    for key in ("avx512host00", "avx2host0000"):
        monkeypatch.setattr(cpa, "host_isa_key", lambda key=key: key)
        names[key] = cpa.module_name()
        (cpa.build_dir() / f"{names[key]}.so").touch()  # a prebuilt copy for each CPU
    assert names["avx512host00"] != names["avx2host0000"]
    for key in ("avx2host0000", "avx512host00"):
        reset()
        monkeypatch.setattr(cpa, "host_isa_key", lambda key=key: key)
        assert cpa.load() == names[key]
    assert [p.name for p in imported] == [f"{names['avx2host0000']}.so", f"{names['avx512host00']}.so"]


def test_another_cpus_build_is_not_loaded(monkeypatch, fresh_loader):
    """Only another CPU's copy in the cache: ``load()`` builds its own (here: the compiler is missing, so it
    falls back to ``None``) instead of importing the foreign one."""
    imported, reset = fresh_loader
    monkeypatch.setattr(cpa, "host_isa_key", lambda: "avx512host00")
    (cpa.build_dir() / f"{cpa.module_name()}.so").touch()
    monkeypatch.setattr(cpa, "host_isa_key", lambda: "avx2host0000")
    built = []

    def no_compiler(**kwargs):
        built.append(kwargs["name"])
        raise RuntimeError("no g++")

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", no_compiler)
    assert cpa.load() is None
    assert imported == [] and built == [cpa.module_name()]
