"""``--reasoning-parser``: a reasoning model's thinking, ``<think>…</think>``, returned as the chat message's
``reasoning_content`` and the rest as ``content`` (vLLM's field names).

- ``deepseek_r1``: the chat template opens the thinking (DeepSeek-R1 and V3.1 in thinking mode): the output is
  reasoning until ``</think>``; an opening ``<think>`` the model writes anyway is dropped.
- ``qwen3``: thinking only when the output starts with ``<think>``; otherwise everything is content.

Invariant: ``feed`` may be called with any split of the text (a tag straddling two chunks is held back until it
is whole), and the pieces it returns, joined, equal ``split`` of the whole text.
"""
from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplit:
    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        self.parser = parser
        self.state = "start"          # start -> reasoning -> content (qwen3 may go start -> content)
        self.buffer = ""
        self.thought = False          # the output had a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` that ``text`` completes."""
        self.buffer += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer, self.state, self.thought = stripped[len(OPEN):], "reasoning", True
                    continue
                if OPEN.startswith(stripped) and stripped:   # maybe an opening tag still arriving
                    return reasoning, content
                if not stripped and self.buffer:
                    return reasoning, content
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
                self.thought = self.state == "reasoning"
                continue
            if self.state == "reasoning":
                at = self.buffer.find(CLOSE)
                if at >= 0:
                    reasoning += self.buffer[:at]
                    self.buffer, self.state = self.buffer[at + len(CLOSE):], "content"
                    continue
                keep = next((k for k in range(min(len(CLOSE) - 1, len(self.buffer)), 0, -1)
                             if self.buffer.endswith(CLOSE[:k])), 0)
                reasoning += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return reasoning, content
            content += self.buffer
            self.buffer = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end (a partial tag is text after all)."""
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split(parser: str, text: str) -> tuple[str | None, str]:
    """A whole text's ``(reasoning or None, content)``."""
    s = ReasoningSplit(parser)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2
