"""Tool calling (``services/router/tool_calls.py``): tool_choice to a prompt and a constraint; the hermes and
llama3_json parsers; history messages with tool calls and tool results through the chat template."""
import json

import jsonschema
import pytest

from services.router import tool_calls
from services.router.openai_api import parse_call
from shared.errors import DeepinferError
from shared.model.chat_template import render_chat_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}}}}}


def body(**kw):
    return {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": [WEATHER, SEARCH], **kw}


def test_tool_choice_decides_template_tools_and_the_constraint():
    assert tool_calls.plan(body(tool_choice="none")) == tool_calls.ToolPlan(None, None, "none")
    auto = tool_calls.plan(body())
    assert auto.mode == "auto" and auto.tools == [WEATHER, SEARCH] and auto.structured is None
    named = tool_calls.plan(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.structured == {"type": "json_schema", "schema": WEATHER["function"]["parameters"]}
    required = tool_calls.plan(body(tool_choice="required", parallel_tool_calls=False))
    schema = required.structured["schema"]
    jsonschema.validate([{"name": "search", "parameters": {"q": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "nope", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):   # parallel_tool_calls false: one call
        jsonschema.validate([{"name": "search", "parameters": {}}] * 2, schema)
    call = parse_call(body(tool_choice="required"), chat=True)
    assert call.request.tools == [WEATHER, SEARCH] and call.request.sampling().structured["type"] == "json_schema"
    with pytest.raises(DeepinferError, match="give one of them"):
        parse_call(body(tool_choice="required", response_format={"type": "json_object"}), chat=True)


def test_parsers_read_the_formats_models_write():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>'
    content, calls = tool_calls.parse("hermes", text)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")
    content, calls = tool_calls.parse("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "a"}}; '
                                                     '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"q": "a"},
                                                                                          {"city": "Oslo"}]
    assert tool_calls.parse("hermes", "no calls here <tool_call>{broken</tool_call>") == (
        "no calls here <tool_call>{broken</tool_call>", [])
    assert tool_calls.parse("llama3_json", "{not json") == ("{not json", [])
    plan = tool_calls.plan(body(tool_choice={"type": "function", "function": {"name": "search"}}))
    assert tool_calls.read(plan, "", '{"q": "x"}')[1][0]["function"] == {"name": "search", "arguments": '{"q": "x"}'}
    plan = tool_calls.plan(body(tool_choice="required"))
    _, calls = tool_calls.read(plan, "", '[{"name": "search", "parameters": {"q": "y"}}]')
    assert calls[0]["function"]["arguments"] == '{"q": "y"}'


def test_history_with_tool_calls_and_results_reaches_the_template():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    call = parse_call({"messages": history, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}},
                      chat=True)
    messages = call.request.messages
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}   # parsed, as templates want
    assert messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert call.request.chat_template_kwargs == {"enable_thinking": False}
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments | tojson }})]"
                "{% endfor %}\n{% endfor %}{% if tools %}tools={{ tools | map(attribute='function.name') | list }}"
                "{% endif %}{{ 'think' if enable_thinking else 'plain' }}")
    text = render_chat_template(template, messages, tools=call.request.tools, **call.request.chat_template_kwargs)
    assert 'assistant:[get_weather({"city": "Paris"})]' in text and "tool:18 C, sunny" in text
    assert text.endswith("tools=['get_weather']plain")
