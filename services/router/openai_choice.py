"""One choice of an OpenAI answer, built from its token stream: the text (an echoed prompt first), the logprobs in
the API's shape, streamed piece by piece or whole.

Invariant: the pieces ``piece(chunk)`` returns, joined, are exactly ``text``/``logprobs`` of the whole answer (a
streamed and a non-streamed request show the same choice). With ``ApiCall.prompt_only`` the generated tokens are
dropped (text, logprobs and ``completion_tokens``): the prompt alone was scored.
"""
from __future__ import annotations

from services.router import openai_logprobs
from services.router.openai_api import ApiCall
from services.router.openai_logprobs import LogprobRows
from shared import protocol


class Choice:
    def __init__(self, call: ApiCall, prompt_ids: list[int] | None, tokenizer) -> None:
        """``prompt_ids``: the prompt's token ids (needed with ``echo``: its text and logprob rows)."""
        self.call, self.tokenizer = call, tokenizer
        self.prompt_ids = prompt_ids or []
        self.parts: list[str] = []
        self.rows = LogprobRows()
        self._echoed = not call.echo
        self._offset = 0          # completions' text_offset of the next streamed piece
        self.completion_tokens = 0  # the generated tokens this choice shows so far

    def piece(self, chunk: protocol.TokenChunk) -> tuple[str, dict | None]:
        """The text and logprobs (API shape; None when not asked) ``chunk`` adds."""
        text, rows = "", LogprobRows()
        if not self._echoed:
            self._echoed = True
            text = self.echo_text()
            if self.call.logprobs:
                rows.add_prompt(self.prompt_ids, chunk.prompt_logprobs)
        elif chunk.prompt_logprobs is not None and not self.call.chat and self.call.logprobs:
            rows.add_prompt(self.prompt_ids, chunk.prompt_logprobs)    # prompt_logprobs without echo
        if not self.call.prompt_only:
            text += chunk.text
            self.completion_tokens += len(chunk.token_ids)
            if self.call.logprobs and chunk.logprobs is not None:
                rows.add(chunk.token_ids, chunk.logprobs)
        self.parts.append(text)
        for name in ("token_ids", "logprobs", "top"):
            getattr(self.rows, name).extend(getattr(rows, name))
        if not self.call.logprobs:
            return text, None
        if self.call.chat:
            return text, openai_logprobs.chat(rows, self.tokenizer)
        shaped = openai_logprobs.completion(rows, self.tokenizer, self._offset)
        self._offset += openai_logprobs.text_length(rows, self.tokenizer)
        return text, shaped

    def echo_text(self) -> str:
        prompt = self.call.request.prompt
        return prompt if prompt is not None else self.tokenizer.decode(self.prompt_ids, skip_special_tokens=False)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def logprobs(self) -> dict | None:
        """The whole choice's logprobs in the API's shape (None when not asked)."""
        if not self.call.logprobs:
            return None
        if self.call.chat:
            return openai_logprobs.chat(self.rows, self.tokenizer)
        return openai_logprobs.completion(self.rows, self.tokenizer)

    def usage(self, usage: dict | None) -> dict | None:
        """The final chunk's usage as the client sees it (``prompt_only``: no completion tokens)."""
        if usage is None or not self.call.prompt_only:
            return usage
        return {**usage, "completion_tokens": 0}
