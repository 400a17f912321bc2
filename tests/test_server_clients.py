"""Third-party clients against a live server on the tiny model (127.0.0.1): LangChain's ChatOpenAI.

Nothing may reach the internet: LangSmith tracing is switched off and
tiktoken (which downloads its tables on first use) is made to fail, so a
code path that counts tokens client-side would show up as an error here.
"""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from rapidspec import Rapid
from rapidspec.retrieval import RetrievalConfig
from tests.server_harness import running_server
from tests.specs import spec_of

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage  # noqa: E402

QUESTION = [SystemMessage("You keep a garden log."), HumanMessage("How many tulips were there on day 17?")]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def server(tiny_model, other_tiny_model):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")), target=tiny_model, drafter=other_tiny_model)
    with running_server(engine) as url:
        yield url


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No LangSmith tracing, no tiktoken download (tests that need neither prove they need neither)."""
    import tiktoken

    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY",
                 "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_ORG_ID"):
        monkeypatch.delenv(name, raising=False)

    def no_download(*args, **kwargs):
        raise AssertionError("tiktoken was asked for an encoding (it would download it)")

    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    monkeypatch.setattr(tiktoken, "encoding_for_model", no_download)


@pytest.fixture
def llm(server):
    return langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="tiny", max_tokens=8,
                                       temperature=0, max_retries=0, timeout=60)


def test_invoke_returns_an_ai_message(llm):
    message = llm.invoke("hi")
    assert isinstance(message, AIMessage) and isinstance(message.content, str) and message.content
    assert message.response_metadata["model_name"] == "tiny"
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    usage = message.usage_metadata
    assert 0 < usage["output_tokens"] <= 8 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_stream_joins_to_the_greedy_invoke(llm):
    whole = llm.invoke(QUESTION).content
    assert whole
    chunks = list(llm.stream(QUESTION))
    assert chunks and all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    assert "".join(chunk.content for chunk in chunks) == whole
    merged = sum(chunks[1:], chunks[0])
    assert merged.content == whole and merged.response_metadata.get("finish_reason") in ("stop", "length")


def test_stream_with_usage(server):
    llm = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="tiny", max_tokens=5,
                                      temperature=0, max_retries=0, stream_usage=True,
                                      extra_body={"ignore_eos": True})
    merged = None
    for chunk in llm.stream("hi"):
        merged = chunk if merged is None else merged + chunk
    assert merged.usage_metadata["output_tokens"] == 5


def test_rapid_options_pass_through_extra_body(server):
    llm = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="tiny", max_tokens=6,
                                      temperature=0, max_retries=0,
                                      extra_body={"mode": "rapid", "gamma": 3, "ignore_eos": True,
                                                  "documents": ["Day 17: the garden had 17 tulips."]})
    message = llm.invoke(QUESTION)
    assert message.usage_metadata["output_tokens"] == 6


def test_bind_tools_on_a_template_without_tools_gets_the_servers_clear_400(llm):
    with pytest.raises(openai.BadRequestError) as err:
        llm.bind_tools([add]).invoke("What is 2 + 3?")
    assert err.value.status_code == 400
    assert "chat template has no tools" in str(err.value)
    assert err.value.body["param"] == "tools"


class Reading(BaseModel):
    """A garden reading."""

    flower: Literal["tulip", "rose"]
    count: int = Field(ge=0, le=999)
    sunny: bool


@pytest.mark.parametrize("stream", [False, True])
def test_with_structured_output_parses_into_the_model(server, stream):
    """LangChain's json_schema method sends response_format; the tiny model's answer is valid under it (about 50
    one-byte tokens)."""
    llm = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="tiny", max_tokens=100,
                                      temperature=0, max_retries=0, timeout=60, streaming=stream)
    reading = llm.with_structured_output(Reading, method="json_schema", strict=True).invoke(QUESTION)
    assert isinstance(reading, Reading)


def test_a_wrong_model_name_is_a_not_found_error(server):
    llm = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="gpt-4o", max_tokens=4,
                                      max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        llm.invoke("hi")
