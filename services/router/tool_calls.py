"""Tool calling on the chat API: ``tools`` / ``tool_choice`` to a prompt and a constraint, the model's text back
to OpenAI ``tool_calls``.

- ``tool_choice: "none"``: plain text (the tools are not shown to the template).
- ``"auto"`` (the default with tools): the template renders the tools; the model's text is parsed by the
  deployment's ``--tool-call-parser``: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``, as Qwen2.5
  and Hermes models write) or ``llama3_json`` (``{"name", "parameters"}`` objects, ``;``-separated, optionally
  after ``<|python_tag|>``, as Llama 3.x writes). Text before the first call stays ``content``; without a parser
  the text is returned as it is.
- ``"required"``: the output is constrained (``shared/structured.py``) to a JSON array of one or more
  ``{"name", "parameters"}`` objects, each a declared tool with arguments valid for its schema (one call when
  ``parallel_tool_calls`` is false); a named function ``{"type": "function", "function": {"name"}}``: the output
  is constrained to that function's arguments. Either way the answer is ``tool_calls``, ``content: null``.

Invariants: a ``tool_choice`` naming an undeclared tool, a malformed tool and an unknown parser are 400s before
anything is placed; ``finish_reason`` is ``tool_calls`` whenever calls are returned; ids are ``call_<24 hex>``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shared.errors import invalid
from shared.protocol import MAX_TOOLS

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
START_MARKERS = {"hermes": "<tool_call>", "llama3_json": "{"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools mean: the tools the template sees, the output constraint, how to read it."""
    tools: list[dict] | None          # for the chat template (None: no tools)
    structured: dict | None           # the constraint of "required" / a named function
    mode: str                         # "none" | "auto" | "required" | "named"
    function: str = ""                # the named function


def _function_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def plan(body: dict) -> ToolPlan:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat body (``invalid_request`` naming the problem)."""
    tools = body.get("tools") or body.get("functions")
    choice = body.get("tool_choice", body.get("function_call"))
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("parameter 'tool_choice' needs 'tools'")
        return ToolPlan(None, None, "none")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"parameter 'tools' must be a list of at most {MAX_TOOLS} tools")
    tools = [t if "function" in t else {"type": "function", "function": t} for t in tools if isinstance(t, dict)]
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"] or not isinstance(fn.get("parameters", {}), dict):
            raise invalid(f"parameter 'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                          "\"parameters\": {...}}}}")
        names.append(fn["name"])
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan(None, None, "none")
    if choice == "auto":
        return ToolPlan(tools, None, "auto")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": _function_schema(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        array = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if body.get("parallel_tool_calls") is False:
            array["maxItems"] = 1
        return ToolPlan(tools, {"type": "json_schema", "schema": array}, "required")
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise invalid("parameter 'tool_choice' must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise invalid(f"parameter 'tool_choice': function {name!r} is not among the tools ({', '.join(names)})")
    tool = tools[names.index(name)]
    return ToolPlan(tools, {"type": "json_schema", "schema": _function_schema(tool)}, "named", name)


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def read(plan_: ToolPlan, parser: str, text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished choice's text."""
    if plan_.mode == "named":
        return None, [_call(plan_.function, text)]
    if plan_.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []           # cut by max_tokens: the text as it is
        return None, [_call(c["name"], c.get("parameters", {})) for c in calls]
    if plan_.mode != "auto" or not parser:
        return text, []
    return parse(parser, text)


def parse(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """A model's free text -> ``(content before the calls or None, calls)``; text that holds no well-formed call
    is all content."""
    calls = []
    if parser == "hermes":
        for raw in _HERMES.findall(text):
            try:
                obj = json.loads(raw)
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            except (ValueError, KeyError, TypeError):
                continue
        start = text.find("<tool_call>")
    else:
        body = text.strip().removeprefix("<|python_tag|>").lstrip()
        start = (text.find("<|python_tag|>") if "<|python_tag|>" in text else text.find("{")) \
            if body.startswith("{") else -1
        if start >= 0:
            decoder, pos = json.JSONDecoder(), 0
            try:
                while pos < len(body):
                    obj, end = decoder.raw_decode(body, pos)
                    calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
                    pos = end
                    while pos < len(body) and body[pos] in " \n\t;":
                        pos += 1
            except (ValueError, KeyError, TypeError):
                calls = []
    if not calls:
        return text, []
    content = text[:start].strip() if start > 0 else ""
    return content or None, calls
