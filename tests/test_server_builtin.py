"""A two-turn chat with the built-in model through the server (slow): turn 2 reuses turn 1's prefill."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from rapidspec import Rapid
from rapidspec.prompting.demo_document import demo_document
from rapidspec.retrieval import RetrievalConfig
from tests.server_harness import running_server
from tests.specs import spec_of

pytestmark = pytest.mark.slow


def test_two_turn_chat_reuses_the_history_and_keeps_greedy_equality(smollm2):
    target = smollm2
    item = demo_document(target_tokens=2500, tokenizer=target.tokenizer)
    paragraphs = [p for p in item.document.split("\n\n") if p.strip()]
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": p} for i, p in enumerate(paragraphs)]
    if history[-1]["role"] == "user":
        history.append({"role": "assistant", "content": "Noted."})
    first_turn = history + [{"role": "user", "content": item.question}]
    lc = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_gib=0),
               target=target).chat(  # leaves nothing on disk:
        first_turn, mode="lc", max_new_tokens=24)                                         # the server's first turn reads it all

    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")), target=target)
    with running_server(engine, model_name="builtin") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        first = client.chat.completions.create(model="builtin", messages=first_turn, max_tokens=24,
                                               extra_body={"mode": "rapid", "eta": 0, "truncate": "middle",
                                                           "drafter_start": "first"})  # drafts from the first round
        assert first.choices[0].message.content == lc.text  # greedy, fp32, eta = 0: lc's answer
        stats = first.model_extra["rapidspec"]["stats"]
        assert stats["drafted_tokens"] > 0 and first.model_extra["rapidspec"]["retrieved_turns"]
        second_turn = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                                    {"role": "user", "content": "Say that again in one short sentence."}]
        second = client.chat.completions.create(model="builtin", messages=second_turn, max_tokens=16,
                                                extra_body={"mode": "rapid", "truncate": "middle"})
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 2000
    assert reused >= first.usage.prompt_tokens  # the whole first prompt, and most of its answer
    assert second.usage.prompt_tokens - reused < 80
    second_stats = second.model_extra["rapidspec"]["stats"]
    assert second_stats["target_prefill_seconds"] < stats["target_prefill_seconds"] / 2


class Closing(BaseModel):
    place: str = Field(max_length=40)
    day: str = Field(max_length=12)
    closing_time: str = Field(max_length=12)


def test_structured_output_through_the_openai_client_streaming_and_not(real_model):
    """rapid under a JSON schema on the built-in model: the answer parses into the Pydantic model, whole or streamed."""
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")), target=real_model(dtype="auto"))
    item = demo_document(target_tokens=2500, tokenizer=engine.tokenizer)
    body = dict(model="builtin", max_tokens=160, temperature=0,
                messages=[{"role": "user", "content": item.question + " Answer in JSON."}],
                # repeatable with eta > 0 (with drafter_start auto the second request would find the first one's
                # drafter cache and join earlier: the same answer only with eta = 0)
                extra_body={"documents": [item.document], "gamma_schedule": "constant", "drafter_start": "first"})
    with running_server(engine, model_name="builtin") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        parsed = client.chat.completions.parse(response_format=Closing, **body)
        schema = {"type": "json_schema", "json_schema": {"name": "closing", "schema": Closing.model_json_schema()}}
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            response_format=schema, stream=True, **body) if chunk.choices)
    assert isinstance(parsed.choices[0].message.parsed, Closing)
    assert parsed.model_extra["rapidspec"]["stats"]["drafted_tokens"] > 0
    assert Closing.model_validate_json(streamed) == parsed.choices[0].message.parsed  # greedy: the same answer
