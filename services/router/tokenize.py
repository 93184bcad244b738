"""Turning a ``GenerateRequest`` into prompt token ids (text, chat messages or ids as given)."""
from __future__ import annotations

from pathlib import Path

from shared import protocol
from shared.errors import invalid
from shared.model.locate import default_model_path
from shared.model.tokenizer import Tokenizer


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of a GGUF file or HF folder (no weights are loaded)."""
    model = Path(path) if path else default_model_path()
    if model.is_dir():
        return Tokenizer.from_file(model / "tokenizer.json")
    return Tokenizer.from_gguf(model)


def prompt_token_ids(tokenizer: Tokenizer, req: protocol.GenerateRequest) -> list[int]:
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.messages is not None:
        for m in req.messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise invalid("each chat message needs string 'role' and 'content'")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(req.chat_template_kwargs)
        if reserved:
            raise invalid(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        extra = dict(req.chat_template_kwargs)
        if req.tools:
            extra["tools"] = req.tools
        text = tokenizer.apply_chat_template(req.messages, **extra)
    else:
        text = req.prompt
    ids = tokenizer.encode(text)
    if not ids:
        raise invalid("prompt is empty")
    return ids
