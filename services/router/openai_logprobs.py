"""Log-probabilities in OpenAI's two shapes, from the ``Logprobs`` the workers send (``shared/logprobs.py``).

- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``.
- Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, each top
  dict holding the chosen token too (up to ``logprobs + 1`` entries); with ``echo``
  the prompt's tokens come first, the first of them with ``null`` logprob and ``null`` top logprobs (nothing
  predicts it), as vLLM and OpenAI's legacy API answer.

- vLLM's ``prompt_logprobs`` (completions: per choice; chat: on the response): one entry per prompt token,
  ``None`` for the first, then ``{token id: {"logprob", "rank", "decoded_token"}}`` holding the prompt token and
  the top alternatives (ranks 1.. in order).

A token's text is its own decoding (special tokens shown); ``bytes`` are that text's UTF-8 bytes (a token that
is part of a multi-byte character decodes to U+FFFD). ``text_offset`` counts characters from the start of the
choice's text (the echoed prompt included), over the tokens' texts. Pure functions of their inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.logprobs import Logprobs


@dataclass(slots=True)
class LogprobRows:
    """A choice's tokens in order with their log-probabilities (None: the prompt's first token) and top ids."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)

    def add(self, token_ids: list[int], lps: Logprobs) -> None:
        self.token_ids.extend(token_ids)
        self._scored(lps)

    def add_prompt(self, prompt_ids: list[int], lps: Logprobs | None) -> None:
        """The prompt's rows: its first token unscored, then one per entry of ``lps`` (None: all unscored)."""
        self.token_ids.extend(prompt_ids)
        unscored = len(prompt_ids) - (len(lps) if lps is not None else 0)
        self.logprobs.extend([None] * unscored)
        self.top.extend([None] * unscored)
        if lps is not None:
            self._scored(lps)

    def _scored(self, lps: Logprobs) -> None:
        self.logprobs.extend(lps.token_logprobs)
        self.top.extend(list(zip(ids, values)) for ids, values in zip(lps.top_ids, lps.top_logprobs))


def _text(tokenizer, token_id: int, cache: dict[int, str]) -> str:
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def chat(rows: LogprobRows, tokenizer) -> dict:
    cache: dict[int, str] = {}
    content = []
    for token_id, logprob, top in zip(rows.token_ids, rows.logprobs, rows.top):
        text = _text(tokenizer, token_id, cache)
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _text(tokenizer, i, cache)), "logprob": v,
                                          "bytes": list(t.encode())} for i, v in top or ()]})
    return {"content": content}


def completion(rows: LogprobRows, tokenizer, offset: int = 0) -> dict:
    """``offset``: the characters of the choice's text before these rows (a stream's earlier chunks)."""
    cache: dict[int, str] = {}
    tokens, offsets = [], []
    for token_id in rows.token_ids:
        text = _text(tokenizer, token_id, cache)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = []
    for text, logprob, alternatives in zip(tokens, rows.logprobs, rows.top):
        if alternatives is None:
            top.append(None)
            continue
        entry = {text: logprob}   # the chosen token too, as vLLM and OpenAI's legacy API do
        for i, v in alternatives:  # most likely first: tokens that decode alike keep the likelier value
            entry.setdefault(_text(tokenizer, i, cache), v)
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": list(rows.logprobs), "top_logprobs": top, "text_offset": offsets}


def text_length(rows: LogprobRows, tokenizer) -> int:
    """The characters ``completion`` counts over ``rows`` (where a stream's next chunk starts)."""
    cache: dict[int, str] = {}
    return sum(len(_text(tokenizer, t, cache)) for t in rows.token_ids)


def vllm_prompt(prompt_ids: list[int], lps: Logprobs | None, tokenizer) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a prompt whose tokens ``1..`` ``lps`` scores (ranks from the workers)."""
    cache: dict[int, str] = {}
    out: list[dict | None] = [None] * (len(prompt_ids) - (len(lps) if lps is not None else 0))
    if lps is None:
        return out
    ranks = lps.ranks or [None] * len(lps)
    scored = prompt_ids[len(out):]
    for token_id, logprob, rank, ids, values in zip(scored, lps.token_logprobs, ranks, lps.top_ids,
                                                   lps.top_logprobs):
        entry = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": _text(tokenizer, token_id, cache)}}
        for r, (i, v) in enumerate(zip(ids, values), start=1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": _text(tokenizer, i, cache)})
        out.append(entry)
    return out
