"""One entry point for loading a model from disk, whatever its format.

``load_model_files(path)`` returns ``(ModelConfig, weights, Tokenizer)``:
- a ``*.gguf`` file -> ``gguf_loader.load_gguf`` (``gguf_deepseek.load`` for llama.cpp's ``deepseek2``) +
  ``Tokenizer.from_gguf`` (the header is parsed once);
- a directory -> ``hf_loader.load_hf_folder`` + ``Tokenizer.from_file(dir/tokenizer.json)``;
- ``None`` -> ``locate.default_model_path()`` ($DEEPINFER_MODEL, else the bundled SmolLM2 GGUF);
- a packaged model name (``gemma3-270m``, ``smollm2-135m``) -> its GGUF, via ``locate.resolve_model``.
Invariant: the tokenizer's EOS ids include every EOS id of the model config (GGUF eos/eot/eom ids, HF
``config.json`` and ``generation_config.json``), so generation stops where the reference implementations stop.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from shared.errors import DeepinferError, ErrorCode
from shared.model.config import ModelConfig
from shared.model.deepseek import DeepseekV3Model
from shared.model.deepseek_v4 import DeepseekV4Model
from shared.model import gguf_deepseek
from shared.model.gguf_loader import load_gguf, metadata, open_gguf
from shared.model.hf_loader import load_hf_folder
from shared.model.llama import LlamaModel
from shared.model.locate import resolve_model
from shared.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """The decoder for ``config``'s architecture: ``DeepseekV3Model`` for MLA configs, ``DeepseekV4Model`` for
    V4's, else ``LlamaModel``."""
    if config.mla is not None:
        return DeepseekV3Model(config, weights, dtype, device)
    if config.v4 is not None:
        return DeepseekV4Model(config, weights, dtype, device)
    return LlamaModel(config, weights, dtype, device)


def load_model_files(path: str | Path | None = None, progress: Callable[[int, int], None] | None = None,
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Load config, float32 weights and tokenizer from a GGUF file, a Hugging Face folder or a packaged name."""
    path = resolve_model(path)
    if path.is_dir():
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"{path} has no tokenizer.json")
        config, weights = load_hf_folder(path, progress=progress)
        tokenizer = Tokenizer.from_file(tokenizer_file)
        if tokenizer.bos_token_id is None:
            tokenizer.bos_token_id = config.bos_token_id
    elif path.suffix.lower() == ".gguf":
        reader = open_gguf(path)
        if metadata(reader, "general.architecture") == gguf_deepseek.ARCH:
            config, weights = gguf_deepseek.load(path, reader, progress)
        else:
            config, weights = load_gguf(path, progress=progress, reader=reader)
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        raise DeepinferError(ErrorCode.MODEL_CORRUPT,
                             f"{path} is neither a .gguf file nor a Hugging Face model folder")
    tokenizer.add_eos_token_ids(config.eos_token_ids)
    if tokenizer.vocab_size > config.vocab_size:
        raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"{path}: tokenizer has {tokenizer.vocab_size} tokens but "
                                                      f"the model's embedding has only {config.vocab_size} rows")
    log.info("model %s: %d layers, hidden %d, vocab %d, eos %s", config.model_id, config.num_layers,
             config.hidden_size, config.vocab_size, tokenizer.eos_token_ids)
    return config, weights, tokenizer
