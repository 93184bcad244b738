"""``langchain-openai`` against the served path (real nats-server, router with HTTP and the ChatML-with-tools
template, a prefill and a decode worker, a tiny random model): ``bind_tools`` gets a tool call LangChain parses
(forced by ``tool_choice``: arguments constrained to the tool's schema), the ``ToolMessage`` round trip is
answered, and ``with_structured_output`` returns the pydantic object (json_schema and function_calling
methods, strict), each validated; a tool call cut by ``max_tokens`` reports ``finish_reason: length``."""
from typing import Literal

import pydantic
import pytest

from tests.integration.services_harness import InProcessCluster
from tests.integration.test_tool_calling import TEMPLATE
from tests.model_factory import write_tiny_hf_folder

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402


class Person(pydantic.BaseModel):
    """A person."""
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=150)


class WeatherArgs(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    unit: Literal["c", "f"]


@tool(args_schema=WeatherArgs)
def get_weather(city: str, unit: str) -> str:
    """The weather in a city."""
    return f"18 {unit} in {city}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=2048)


async def test_bind_tools_and_structured_output(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, kv_cache_mb=16, router_kw={
            "http_port": 0, "chat_template": str(TEMPLATE), "tool_call_parser": "hermes"}) as cluster:
        llm = langchain_openai.ChatOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http.port}/v1",
                                          api_key="none", model="default", temperature=0, max_tokens=80,
                                          max_retries=0, timeout=60)
        bound = llm.bind_tools([get_weather], tool_choice="get_weather")
        question = HumanMessage("What is the weather in Paris?")
        call_msg = await bound.ainvoke([question])
        [call] = call_msg.tool_calls
        assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
        WeatherArgs.model_validate(call["args"])
        result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
        answer = await llm.bind_tools([get_weather], tool_choice="none").ainvoke([question, call_msg, result],
                                                                                  max_tokens=8)
        assert answer.content and not answer.tool_calls
        cut = await bound.ainvoke([question], max_tokens=3)    # the call cannot finish in 3 tokens
        assert cut.response_metadata["finish_reason"] == "length"
        for method in ("json_schema", "function_calling"):
            # strict: no properties beyond the model's (else the grammar rightly allows any, unbounded)
            person = await llm.with_structured_output(Person, method=method, strict=True).ainvoke("Who is it?")
            assert isinstance(person, Person), (method, person)
