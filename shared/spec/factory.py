"""Building a drafter from its spec string (worker and draft-service config, ``deepinfer up --drafter``).

- ``prompt_lookup``: n-gram matches in the sequence itself (no weights; ``shared/spec/prompt_lookup.py``).
- ``self:N``: the target's first N layers drafting for it (``shared/spec/draft_model.self_speculative``).
- a GGUF file or HF folder: a smaller model with the target's vocabulary (``draft_model.load_drafter``).
Model drafters see an anchored window of the last ``window`` to ``window + stride`` tokens and keep its KV
across steps (``shared/spec/draft_state.py``): rebuilt only without state (a new sequence, a hand-off) or when
the anchor moves.
"""
from __future__ import annotations

from pathlib import Path

from shared.model.llama import LlamaModel
from shared.spec.types import Drafter

PROMPT_LOOKUP = "prompt_lookup"
DEFAULT_DRAFTER = PROMPT_LOOKUP  # every drafter flag and config field defaults to it (no weights to load)


def make_drafter(spec: str, target: LlamaModel, window: int = 128) -> Drafter:
    if spec == PROMPT_LOOKUP:
        from shared.spec.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter()
    from shared.spec.draft_model import load_drafter

    return load_drafter(spec, target, window=window)


def shipped_head(spec: str) -> str | None:
    """The confidence head shipped for a drafter (``shared/spec/heads/<drafter>.json``), if there is one."""
    path = Path(__file__).parent / "heads" / f"{spec}.json"
    return str(path) if path.is_file() else None
