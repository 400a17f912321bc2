"""Chat messages -> target and drafter prompts; chat through the engine keeps the invariants."""

from __future__ import annotations

import copy

import pytest

from rapidspec import Rapid
from rapidspec.prompting.conversation import (
    Message,
    _split_pasted,
    chat_prompts,
    fit_messages,
    parse_documents,
    parse_messages,
    render,
)
from rapidspec.errors import ContextLengthError, RapidspecError
from rapidspec.retrieval import RetrievalConfig, Retriever
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
FILLER = [f"Day {i}: we talked about the weather, the garden and tea number {i}." for i in range(30)]
NEEDLE = "My sister Ada moved to Lisbon in May and adopted a grey cat named Pixel."
QUESTION = "What is the name of Ada's cat?"


def history() -> list[dict]:
    turns = []
    for i, text in enumerate(FILLER[:12] + [NEEDLE] + FILLER[12:]):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    if turns[-1]["role"] == "user":
        turns.append({"role": "assistant", "content": "I see."})
    return [{"role": "system", "content": "You are a friendly assistant."}, *turns, {"role": "user", "content": QUESTION}]


def prompts(tokenizer, messages, documents=(), mode="rapid", window=4000, **options):
    return chat_prompts(
        tokenizer, Retriever(RETRIEVAL, tokenizer=tokenizer), parse_messages(messages), parse_documents(documents),
        mode=mode, target_window=window, drafter_window=window, **options,
    )


def text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids))


@pytest.mark.parametrize(
    "raw, message",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text content parts"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "last message"),
        ([{"role": "user", "content": "   "}], "empty"),
        (["hello"], "object"),
    ],
)
def test_bad_messages_are_refused_with_the_field(raw, message):
    with pytest.raises(RapidspecError, match=message) as err:
        parse_messages(raw)
    assert err.value.param.startswith("messages")


def test_messages_accept_text_parts_and_documents_accept_titles():
    messages = parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert messages == (Message("user", "ab"),)
    assert parse_documents(["x", {"title": "T", "text": "y"}, {"text": "z"}]) == ("x", "T\ny", "z")
    assert parse_documents(None) == ()
    for bad in ("text", [""], [{"title": "T"}], [{"text": "x", "title": 5}]):
        with pytest.raises(RapidspecError, match="documents"):
            parse_documents(bad)


def test_split_pasted():
    assert _split_pasted("A long text.\n\nMore.\n\nWho wrote it?\n") == ("A long text.\n\nMore.", "\n\n", "Who wrote it?\n")
    assert _split_pasted("line one\nQuestion?") == ("line one", "\n", "Question?")
    assert _split_pasted("just a question") == ("", "", "just a question")


def test_documents_target_reads_all_drafter_reads_retrieved(byte_tokenizer):
    documents = [{"title": "Notes", "text": "\n\n".join(FILLER)}, NEEDLE]
    pair = prompts(byte_tokenizer, [{"role": "user", "content": QUESTION}], documents)
    target, drafter = text(byte_tokenizer, pair.target_ids), text(byte_tokenizer, pair.drafter_ids)
    assert FILLER[0] in target and NEEDLE in target and "Notes" in target
    assert NEEDLE in drafter and len(pair.drafter_ids) < len(pair.target_ids) / 2
    tail = f"User: {QUESTION}\n\nAssistant:"
    assert target.endswith(tail) and drafter.endswith(tail)
    assert pair.retrieval.num_tokens <= RETRIEVAL.budget_tokens


def test_history_is_the_corpus_with_recent_turns_verbatim(byte_tokenizer):
    messages = history()
    pair = prompts(byte_tokenizer, messages, recent_messages=2)
    target, drafter = text(byte_tokenizer, pair.target_ids), text(byte_tokenizer, pair.drafter_ids)
    assert all(m["content"] in target for m in messages)
    needle_index = next(i for i, m in enumerate(messages) if m["content"] == NEEDLE)
    assert needle_index in pair.retrieved_turns
    assert f"{messages[needle_index]['role'].capitalize()}: {NEEDLE}" in drafter  # speaker kept
    assert drafter.startswith("System: You are a friendly assistant.")
    for recent in messages[-3:]:
        assert recent["content"] in drafter
    assert len(pair.drafter_ids) < len(pair.target_ids)
    assert list(pair.retrieved_turns) == sorted(pair.retrieved_turns)  # original order


@pytest.mark.parametrize("mode, has_drafter, target_short", [("lc", False, False), ("rag", False, True), ("sd", True, False)])
def test_what_each_mode_reads(byte_tokenizer, mode, has_drafter, target_short):
    full = prompts(byte_tokenizer, history(), mode="lc")
    pair = prompts(byte_tokenizer, history(), mode=mode)
    assert (pair.drafter_ids is not None) == has_drafter
    assert (len(pair.target_ids) < len(full.target_ids)) == target_short
    if mode == "sd":
        assert pair.drafter_ids == pair.target_ids


def test_pasted_document_splits_corpus_and_final_paragraph(byte_tokenizer):
    pasted = "\n\n".join(FILLER[:10] + [NEEDLE] + FILLER[10:]) + "\n\n" + QUESTION
    pair = prompts(byte_tokenizer, [{"role": "user", "content": pasted}])
    drafter = text(byte_tokenizer, pair.drafter_ids)
    assert NEEDLE in drafter and drafter.endswith(f"{QUESTION}\n\nAssistant:")
    assert len(pair.drafter_ids) < len(pair.target_ids) / 2
    other = pasted.replace(QUESTION, "Summarise the notes.")
    explicit = prompts(byte_tokenizer, [{"role": "user", "content": other}], query="Lisbon grey cat Pixel")
    assert NEEDLE in text(byte_tokenizer, explicit.drafter_ids)


def test_raw_rendering_has_no_labels(byte_tokenizer):
    ids = render(byte_tokenizer, [Message("system", "Context."), Message("user", "Once upon")], raw=True)
    assert text(byte_tokenizer, ids) == "Context.\n\nOnce upon"


def test_chat_template_is_used_when_the_tokenizer_has_one(byte_tokenizer):
    tokenizer = copy.deepcopy(byte_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    pair = prompts(tokenizer, history())
    assert text(tokenizer, pair.target_ids).endswith(f"<user>{QUESTION}</user><assistant>")
    assert text(tokenizer, pair.drafter_ids).endswith(f"<user>{QUESTION}</user><assistant>")


def test_too_long_is_refused_or_cut_oldest_turns_first(byte_tokenizer):
    messages = parse_messages(history())
    full = len(render(byte_tokenizer, messages))
    with pytest.raises(ContextLengthError) as err:
        fit_messages(byte_tokenizer, messages, full - 1, "error")
    assert err.value.code == "context_length_exceeded"
    ids, removed = fit_messages(byte_tokenizer, messages, full // 2, "middle")
    cut = text(byte_tokenizer, ids)
    assert len(ids) <= full // 2 and removed == full - len(ids)
    assert cut.startswith("System: You are a friendly assistant.\n\nUser:")  # still starts with a user turn
    assert FILLER[0] not in cut and QUESTION in cut
    huge = parse_messages([{"role": "user", "content": "word " * 3000 + "\n\nWhat?"}])
    ids, removed = fit_messages(byte_tokenizer, huge, 1000, "middle")
    assert len(ids) <= 1000 and text(byte_tokenizer, ids).endswith("What?\n\nAssistant:")


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_documents_are_cut_before_turns_are_dropped_and_later_turns_keep_the_start(byte_tokenizer):
    documents = ["\n\n".join(FILLER * 4)]
    conversation = history()
    pair = prompts(byte_tokenizer, conversation, documents, mode="lc", window=3000)
    cut = text(byte_tokenizer, pair.target_ids)
    assert pair.truncated_tokens > 0 and len(pair.target_ids) <= 3000
    assert NEEDLE in cut and FILLER[0] in cut  # every turn kept: the documents gave way
    assert cut.count(FILLER[5]) < 5  # (the documents held it four times, the turns once)
    # The next exchange adds fewer tokens than a cut step: the same cut, so all of the earlier prompt is a prefix.
    later = [*conversation[:-1], {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Pixel."},
             {"role": "user", "content": "And where does Ada live?"}]
    next_pair = prompts(byte_tokenizer, later, documents, mode="lc", window=3000)
    question_at = len(pair.target_ids) - len(byte_tokenizer(f"{QUESTION}\n\nAssistant:")["input_ids"]) - 8
    assert common_prefix(pair.target_ids, next_pair.target_ids) >= question_at


def test_dropped_turns_go_in_steps_with_few_renders(byte_tokenizer, monkeypatch):
    import rapidspec.prompting.conversation as conversation

    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "talk " * 20} for i in range(400)]
    messages = parse_messages([*turns, {"role": "user", "content": QUESTION}])
    renders = []
    real_render = conversation.render
    monkeypatch.setattr(conversation, "render", lambda *a, **k: renders.append(1) or real_render(*a, **k))
    ids, removed = fit_messages(byte_tokenizer, messages, 4000, "middle")
    assert len(ids) <= 4000 and removed > 0 and len(renders) <= 4  # about 300 turns dropped
    first_kept = text(byte_tokenizer, ids)
    assert first_kept.startswith("User: Turn ")  # still starts with a user turn
    # One more short exchange: the same turns are dropped, the prompt starts the same.
    more = parse_messages([*turns, {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Pixel."},
                           {"role": "user", "content": "Thanks."}])
    again, _ = fit_messages(byte_tokenizer, more, 4000, "middle")
    assert common_prefix(ids, again) >= len(ids) - 40


def engine(model, drafter=None, **options) -> Rapid:
    return Rapid(spec_of(retrieval=RETRIEVAL, **options), target=model, drafter=drafter)


@pytest.mark.usefixtures("drafter_from_the_first_round")  # the drafter in every round, so it drafts here
@pytest.mark.parametrize("mode", ["ragsd", "rapid"])
def test_chat_greedy_eta_zero_equals_lc(tiny_model, other_tiny_model, mode):
    """Invariant 1 through the chat path, for a history and for documents."""
    for kwargs in ({"messages": history()}, {"messages": [{"role": "user", "content": QUESTION}], "documents": FILLER}):
        lc = engine(tiny_model).chat(**kwargs, mode="lc", max_new_tokens=24)
        out = engine(tiny_model, other_tiny_model).chat(**kwargs, mode=mode, eta=0.0, gamma=4, max_new_tokens=24)
        assert out.token_ids == lc.token_ids
        assert out.stats.retrieved_chunks > 0 and out.stats.drafted_tokens > 0


def test_next_turn_reuses_the_history_and_matches_a_fresh_engine(tiny_model):
    rapid = engine(tiny_model)
    messages = history()
    first = rapid.chat(messages, mode="rapid", max_new_tokens=12)
    assert first.stats.target_prefill_reused_tokens == 0
    # The random model's answer is random bytes that do not survive a decode/encode round trip,
    # so the history carries a fixed answer: the first turn's whole prompt comes from the cache.
    messages += [{"role": "assistant", "content": "Pixel."}, {"role": "user", "content": "And where does Ada live?"}]
    second = rapid.chat(messages, mode="rapid", max_new_tokens=12)
    assert second.stats.target_prefill_reused_tokens >= first.stats.prompt_tokens_target
    assert second.stats.prompt_tokens_target - second.stats.target_prefill_reused_tokens < 60
    fresh = engine(tiny_model, kv_cache_gib=0).chat(messages, mode="rapid", max_new_tokens=12)  # nothing from disk
    assert fresh.stats.target_prefill_reused_tokens == 0
    assert fresh.token_ids == second.token_ids


def test_closing_a_stream_early_keeps_the_cache_for_reuse(tiny_model):
    rapid = engine(tiny_model)
    stream = rapid.stream_chat(history(), mode="lc", max_new_tokens=30, ignore_eos=True)
    next(stream)
    stream.close()
    assert len(rapid.prefix_cache) == 1
    again = rapid.chat(history(), mode="lc", max_new_tokens=4)
    assert again.stats.target_prefill_reused_tokens == again.stats.prompt_tokens_target - 1
