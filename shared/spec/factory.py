"""Building a drafter from its spec string (worker and draft-service config, ``deepinfer up --drafter``).

- ``prompt_lookup``: n-gram matches in the sequence itself (no weights; ``shared/spec/prompt_lookup.py``).
- ``self:N``: the target's first N layers drafting for it (``shared/spec/draft_model.self_speculative``).
- a GGUF file or HF folder: a smaller model with the target's vocabulary (``draft_model.load_drafter``).
- ``mtp``: a DeepSeek V3 checkpoint's own next-n prediction module fed the target's hidden states
  (``shared/spec/mtp_drafter.py``); in-process only (``local``), since it reads the engine's hidden states.
Model drafters see an anchored window of the last ``window`` to ``window + stride`` tokens and keep its KV
across steps (``shared/spec/draft_state.py``): rebuilt only without state (a new sequence, a hand-off) or when
the anchor moves.
"""
from __future__ import annotations

from pathlib import Path

from shared.errors import invalid
from shared.model.llama import LlamaModel
from shared.spec.types import Drafter

PROMPT_LOOKUP = "prompt_lookup"
MTP = "mtp"
DEFAULT_DRAFTER = PROMPT_LOOKUP  # every drafter flag and config field defaults to it (no weights to load)


def make_drafter(spec: str, target: LlamaModel, window: int = 128, local: bool = True) -> Drafter:
    """The drafter ``spec`` names for ``target``; ``local`` False: for the draft service (no ``mtp`` there).
    Raises ``DeepinferError(INVALID_REQUEST)`` for a spec the target cannot draft with."""
    if spec == PROMPT_LOOKUP:
        from shared.spec.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter()
    if spec == MTP:
        from shared.model.deepseek import DeepseekV3Model
        from shared.spec.mtp_drafter import MtpDrafter

        if not local:
            raise invalid("the mtp drafter reads the target's hidden states: it drafts inside the decode worker "
                          "(--draft local), not in a draft service")
        if not isinstance(target, DeepseekV3Model):
            raise invalid(f"--drafter mtp needs a DeepSeek V3 checkpoint with next-n prediction layers; "
                          f"{target.config.model_id} is a {target.config.architecture} model")
        return MtpDrafter(target, window=window)
    from shared.spec.draft_model import load_drafter

    return load_drafter(spec, target, window=window)


def shipped_head(spec: str) -> str | None:
    """The confidence head shipped for a drafter (``shared/spec/heads/<drafter>.json``), if there is one."""
    path = Path(__file__).parent / "heads" / f"{spec}.json"
    return str(path) if path.is_file() else None
