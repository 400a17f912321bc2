"""Structured output and tool calls on a real model with tools in its template: Qwen2.5-Coder 0.5B (slow).

A live server (127.0.0.1) on ``builtin:qwen2.5-coder-0.5b`` (rapid, its GGUF
drafting on llama.cpp where installed), asked with the ``openai`` client and
LangChain about the built-in long document, whose planted fact is that a
Lisbon library's reading room closes at 4:30 pm on Thursdays.
"""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

from rapidspec import EngineSpec, Rapid
from rapidspec.errors import RapidspecError
from rapidspec.models.loading import builtin_gguf_path
from rapidspec.models.spec import ModelSpec
from rapidspec.prompting.demo_document import demo_document
from tests.server_harness import running_server

pytestmark = pytest.mark.slow
QWEN = "builtin:qwen2.5-coder-0.5b"


class Closing(BaseModel):
    place: str
    day: str
    closing_time: str


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def server():
    try:
        builtin_gguf_path(QWEN.split(":")[1])
    except RapidspecError as err:  # make test installs it; a bare pytest may not have it
        pytest.skip(str(err))
    with running_server(Rapid(EngineSpec(ModelSpec(target=QWEN))), model_name="qwen") as url:
        yield url


@pytest.fixture(scope="module")
def document():
    return demo_document().document


def test_parse_extracts_the_fact_from_the_long_document(server, document):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=600)
    out = client.chat.completions.parse(
        model="qwen", response_format=Closing, max_tokens=60, temperature=0,
        extra_body={"documents": [document], "drafter_start": "first"},  # the drafter in every round, under the schema
        messages=[{"role": "user", "content": "Which reading room closes early, on which day and at what time?"}])
    closing = out.choices[0].message.parsed
    assert isinstance(closing, Closing) and "4:30" in closing.closing_time and "Thursday" in closing.day
    assert out.model_extra["rapidspec"]["stats"]["drafted_tokens"] > 0  # rapid drafted under the schema


def test_langchain_tool_round_trip(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="qwen", max_tokens=60,
                                      temperature=0, max_retries=0, timeout=600)
    question = HumanMessage("What is 17 + 25? Use the add tool.")
    message = llm.bind_tools([add], tool_choice="add").invoke([question])  # named: the call is constrained
    assert len(message.tool_calls) == 1, repr(message.content)
    (call,) = message.tool_calls
    assert call["name"] == "add" and call["args"] == {"a": 17, "b": 25}
    result = ToolMessage("42", tool_call_id=call["id"])
    answer = llm.bind_tools([add], tool_choice="none").invoke([question, message, result])
    assert answer.content and not answer.tool_calls  # the result was read back in Qwen's <tool_response> turn
    # (this 0.5B model then writes the call again rather than "42": a model's limit, not the conversation's)
