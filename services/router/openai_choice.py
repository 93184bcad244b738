"""One choice of an OpenAI answer, built from its token stream: the text (an echoed prompt first), the logprobs in
the API's shape, streamed piece by piece or whole.

Invariant: the pieces ``piece(chunk)`` returns, joined, are exactly ``text``/``logprobs`` of the whole answer (a
streamed and a non-streamed request show the same choice). With ``ApiCall.prompt_only`` the generated tokens are
dropped (text, logprobs and ``completion_tokens``): the prompt alone was scored.
"""
from __future__ import annotations

from services.router import openai_logprobs, tool_calls
from services.router.openai_api import ApiCall
from services.router.openai_logprobs import LogprobRows
from services.router.reasoning import ReasoningSplit
from shared import protocol


class Choice:
    def __init__(self, call: ApiCall, prompt_ids: list[int] | None, tokenizer, tool_parser: str = "",
                 reasoning_parser: str = "") -> None:
        """``prompt_ids``: the prompt's token ids (needed with ``echo``: its text and logprob rows);
        ``tool_parser`` / ``reasoning_parser``: the deployment's ``--tool-call-parser`` / ``--reasoning-parser``
        (chat only; the reasoning goes to ``reasoning``, tool calls are read from the content after it)."""
        self.call, self.tokenizer, self.tool_parser = call, tokenizer, tool_parser
        self.thinking = ReasoningSplit(reasoning_parser) if reasoning_parser and call.chat else None
        self.reasoning_parts: list[str] = []
        self.last_reasoning = ""  # the reasoning the last piece added (streamed as reasoning_content)
        self._streamed = 0        # characters of the text already streamed (tools may hold the rest back)
        self.prompt_ids = prompt_ids or []
        self.parts: list[str] = []
        self.rows = LogprobRows()
        self._echoed = not call.echo
        self._offset = 0          # completions' text_offset of the next streamed piece
        self.completion_tokens = 0  # the generated tokens this choice shows so far
        self.token_ids: list[int] = []  # and their ids (return_token_ids)
        self.prompt_entries = None  # the prompt's Logprobs (first chunk), when asked

    def vllm_prompt_logprobs(self) -> list | None:
        """vLLM's ``prompt_logprobs`` of this choice's prompt (``openai_logprobs.vllm_prompt``)."""
        return openai_logprobs.vllm_prompt(self.prompt_ids, self.prompt_entries, self.tokenizer)

    def piece(self, chunk: protocol.TokenChunk) -> tuple[str, dict | None]:
        """The text and logprobs (API shape; None when not asked) ``chunk`` adds."""
        text, rows = "", LogprobRows()
        if not self._echoed:
            self._echoed = True
            text = self.echo_text()
            if self.call.logprobs:
                rows.add_prompt(self.prompt_ids, chunk.prompt_logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_entries = chunk.prompt_logprobs   # vLLM's prompt_logprobs (``vllm_prompt_logprobs``)
        if not self.call.prompt_only:
            piece = chunk.text
            if self.thinking is not None:
                reasoning, piece = self.thinking.feed(piece)
                if chunk.final:
                    more_reasoning, more = self.thinking.finish()
                    reasoning, piece = reasoning + more_reasoning, piece + more
                self.reasoning_parts.append(reasoning)
                self.last_reasoning = reasoning
            text += piece
            self.completion_tokens += len(chunk.token_ids)
            self.token_ids += chunk.token_ids
            if self.call.logprobs and chunk.logprobs is not None:
                rows.add(chunk.token_ids, chunk.logprobs)
        self.parts.append(text)
        text = self._streamable(text)
        for name in ("token_ids", "logprobs", "top"):
            getattr(self.rows, name).extend(getattr(rows, name))
        if not self.call.logprobs:
            return text, None
        if self.call.chat:
            return text, openai_logprobs.chat(rows, self.tokenizer)
        shaped = openai_logprobs.completion(rows, self.tokenizer, self._offset)
        self._offset += openai_logprobs.text_length(rows, self.tokenizer)
        return text, shaped

    def _streamable(self, text: str) -> str:
        """What of the text so far may stream now: all of it without tools; with ``required`` or a named function
        nothing (it is the calls' JSON); with ``auto`` and a parser, what comes before a call could begin."""
        plan = self.call.tools
        if plan.mode == "none" or (plan.mode == "auto" and not self.tool_parser):
            self._streamed += len(text)
            return text
        if plan.mode != "auto":
            return ""
        full = self.text
        marker = tool_calls.START_MARKERS[self.tool_parser]
        if self.tool_parser == "llama3_json":
            stripped = full.lstrip()
            safe = 0 if not stripped or stripped[0] in "{<" else len(full)
        else:
            at = full.find(marker)
            safe = at if at >= 0 else len(full)
            for keep in range(min(len(marker) - 1, len(full)), 0, -1):   # a marker's start at the very end
                if at < 0 and full.endswith(marker[:keep]):
                    safe = len(full) - keep
                    break
        out, self._streamed = full[self._streamed:max(safe, self._streamed)], max(safe, self._streamed)
        return out

    def message(self) -> tuple[str | None, list[dict]]:
        """The finished choice's ``(content, tool_calls)``."""
        return tool_calls.read(self.call.tools, self.tool_parser, self.text)

    @property
    def reasoning(self) -> str | None:
        """The finished choice's reasoning (None without a reasoning parser or when the model did not think)."""
        return "".join(self.reasoning_parts) if self.thinking is not None and self.thinking.thought else None

    def rest(self) -> tuple[str, list[dict]]:
        """At the end of a stream: the content not streamed yet, and the tool calls."""
        content, calls = self.message()
        if not calls:
            return self.text[self._streamed:], []
        return (content or "")[self._streamed:], calls

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
