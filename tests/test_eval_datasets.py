"""Loaders of `rapidspec eval` on fixtures written in each benchmark's official format."""

from __future__ import annotations

import json

import pytest

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import detect_format, load_items, locomo_document
from rapidspec.evaluation.synthetic import NEEDLE, TASKS, needle_item, synthetic_items

LONG_TEXT = "The harbour master keeps the ledger in the blue cabinet. " * 20


def write_longbench2(path, n=2):
    records = [
        {
            "_id": f"lb{i}", "domain": "Single-Document QA", "sub_domain": "Academic", "difficulty": "easy",
            "length": "short", "question": f"Where is ledger {i} kept?", "choice_A": "In the blue cabinet",
            "choice_B": "Under the bed", "choice_C": "At sea", "choice_D": "Nowhere", "answer": "A",
            "context": LONG_TEXT,
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def write_leval(path):
    lines = [
        {
            "input": LONG_TEXT,
            "instructions": [
                "Where is the ledger kept?\n\n (A) In the blue cabinet.\n (B) Under the bed.\n (C) At sea.\n (D) Nowhere.",
                "Who keeps the ledger?\n\n (A) The cook.\n (B) The harbour master.\n (C) A sailor.\n (D) Nobody.",
            ],
            "outputs": ["(A) In the blue cabinet.", "(B) The harbour master."],
            "source": "quality_raw", "evaluation": "exam",
        },
        {
            "input": "Lecture text. " * 30,
            "instructions": ["Question 1. Which apply?\nA. one\nB. two\nC. three\nD. four"],
            "outputs": ["AD"], "source": "coursera", "evaluation": "exam",
        },
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    return path


def write_locomo(path):
    samples = [{
        "sample_id": "conv-1",
        "conversation": {
            "speaker_a": "Ann", "speaker_b": "Bob",
            "session_1_date_time": "1:00 pm on 8 May, 2023",
            "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat named Biscuit."},
                          {"speaker": "Bob", "dia_id": "D1:2", "text": "Lovely!"}],
            "session_2_date_time": "2:00 pm on 9 May, 2023",
            "session_2": [{"speaker": "Bob", "dia_id": "D2:1", "text": "I went sailing."}],
        },
        "qa": [
            {"question": "What is Ann's cat called?", "answer": "Biscuit", "evidence": ["D1:1"], "category": 4},
            {"question": "When did Bob go sailing?", "answer": "9 May 2023", "evidence": ["D2:1"], "category": 2},
            {"question": "What is Bob's dog called?", "adversarial_answer": "Rex", "evidence": [], "category": 5},
            {"question": "How many sessions?", "answer": 2, "evidence": [], "category": 1},
        ],
        "observation": {}, "session_summary": {}, "event_summary": {},
    }]
    path.write_text(json.dumps(samples), encoding="utf-8")
    return path


def test_longbench2_loader_prompt_and_query(tmp_path):
    items = load_items(write_longbench2(tmp_path / "lb.json"))
    assert [i.id for i in items] == ["lb0", "lb1"]
    item = items[0]
    assert item.task_type == "mc" and item.answers == ("A",) and len(item.choices) == 4
    assert item.question.startswith("Where is ledger 0 kept?\nChoices:\n(A) In the blue cabinet\n(B)")
    assert "(D) Nowhere" in item.query and "What is the correct answer" not in item.query
    text = item.template.text(item.document, item.question, retrieved=False)
    assert text.startswith("Please read the following text and answer the question below.\n\n<text>\n")
    assert text.endswith('Format your response as follows: "The correct answer is (insert answer here)".')
    assert "following retrieved text chunks" in item.template.text("x", item.question, retrieved=True)


def test_leval_loader_multiple_choice_and_multi_answer(tmp_path):
    items = load_items(write_leval(tmp_path / "quality.jsonl"))
    assert [i.id for i in items] == ["quality-0-0", "quality-0-1", "quality-1-0"]
    assert [i.answers for i in items] == [("A",), ("B",), ("AD",)]
    assert all(i.task_type == "mc" for i in items) and items[0].group == "leval/quality"
    assert items[0].document == items[1].document  # several questions per document, in order
    text = items[0].template.text(items[0].document, items[0].question, retrieved=False)
    assert text.startswith("Document is as follows. ") and text.endswith("\nAnswer:")
    assert items[0].choices[0] == "In the blue cabinet."


def test_leval_open_and_topic_tasks(tmp_path):
    line = {"input": LONG_TEXT, "instructions": ["Summarize the text."], "outputs": ["A ledger is kept."],
            "source": "x", "evaluation": "LLM"}
    (tmp_path / "news_summ.jsonl").write_text(json.dumps(line) + "\n", encoding="utf-8")
    summary = load_items(tmp_path / "news_summ.jsonl")[0]
    assert summary.task_type == "summary" and "with 4 words" in summary.template.body
    line = {"input": "USER: hi\nASSISTANT: hello", "instructions": ["What is the first topic we discussed?"],
            "outputs": ["greetings"], "source": "topic_retrieval", "evaluation": "exam"}
    (tmp_path / "topic_retrieval_longchat.jsonl").write_text(json.dumps(line) + "\n", encoding="utf-8")
    topic = load_items(tmp_path / "topic_retrieval_longchat.jsonl")[0]
    assert topic.task_type == "qa" and topic.template.body == "{document}\n\n{question}"


def test_locomo_loader_skips_adversarial_and_renders_sessions(tmp_path):
    path = write_locomo(tmp_path / "locomo.json")
    items = load_items(path)
    assert [i.answers for i in items] == [("Biscuit",), ("9 May 2023",), ("2",)]
    assert items[1].question.endswith("approximate date.") and items[1].query == "When did Bob go sailing?"
    document = items[0].document
    assert "DATE: 1:00 pm on 8 May, 2023\nCONVERSATION:\nAnn: I adopted a cat named Biscuit.\nBob: Lovely!" in document
    assert document.index("DATE: 2:00 pm") > document.index("Lovely!")  # sessions in order
    with_adversarial = load_items(path, include_adversarial=True)
    assert len(with_adversarial) == 4 and with_adversarial[2].answers == ("Rex",)
    assert locomo_document({"speaker_a": "A", "speaker_b": "B"}).startswith("Below is a conversation")


def test_format_detection_and_errors(tmp_path):
    assert detect_format(json.loads(write_longbench2(tmp_path / "a.json").read_text())) == "longbench2"
    assert detect_format(json.loads(write_locomo(tmp_path / "b.json").read_text())) == "locomo"
    leval = write_leval(tmp_path / "c.jsonl")
    with pytest.raises(RapidspecError, match="lacks"):
        load_items(leval, "longbench2")
    with pytest.raises(RapidspecError, match="no such data file"):
        load_items(tmp_path / "missing.json")
    with pytest.raises(RapidspecError, match="unknown format"):
        load_items(leval, "squad")
    (tmp_path / "other.json").write_text(json.dumps([{"text": "x"}]), encoding="utf-8")
    with pytest.raises(RapidspecError, match="cannot detect"):
        load_items(tmp_path / "other.json")
    (tmp_path / "garbage.json").write_text("{not json\n", encoding="utf-8")
    with pytest.raises(RapidspecError, match="neither JSON"):
        load_items(tmp_path / "garbage.json")


# ------------------------------------------------------------------ synthetic needles
@pytest.mark.parametrize("task", TASKS)
def test_synthetic_needles_present_and_answerable(task, byte_tokenizer):
    item = needle_item(task, 2048, index=1, seed=5, tokenizer=byte_tokenizer)
    assert item.task_type == "needle" and item.group == f"synthetic/{task}@2048"
    needles = item.meta["needles"]
    assert len(needles) == (1 if task == "niah_single" else 4)
    for needle in needles:
        assert needle in item.document
    for answer in item.answers:
        assert NEEDLE.format(key=item.question.split(" for ")[1].split(" mentioned")[0], value=answer) in item.document
    assert len(item.answers) == (4 if task == "niah_multivalue" else 1)


def test_needle_answers_open_with_rulers_prefix_and_get_128_tokens(byte_tokenizer, tiny_model):
    from rapidspec.evaluation.run_config import DEFAULT_MAX_NEW_TOKENS
    from rapidspec.prompting.prompts import prompt_ids

    single = needle_item("niah_single", 1024, tokenizer=byte_tokenizer)
    every = needle_item("niah_multivalue", 1024, tokenizer=byte_tokenizer)
    key = every.question.split(" for ")[1].split(" mentioned")[0]
    assert every.template.answer_prefix == f"The special magic numbers for {key} mentioned in the provided text are"
    assert single.template.answer_prefix.startswith("The special magic number for ")
    assert single.template.answer_prefix.endswith(" is")
    tokenizer = tiny_model.tokenizer
    prefix = tokenizer(every.template.answer_prefix, add_special_tokens=False)["input_ids"]
    for retrieved in (False, True):  # both views end with the prefix: the answer continues it
        ids = prompt_ids(tokenizer, every.template, every.document, every.question, retrieved)
        assert ids[-len(prefix):] == prefix
    assert DEFAULT_MAX_NEW_TOKENS["needle"] == 128


def test_synthetic_length_respected(byte_tokenizer):
    for length in (1024, 4096):
        item = needle_item("niah_multikey", length, seed=0, tokenizer=byte_tokenizer, reserve_tokens=256)
        tokens = len(byte_tokenizer(item.document, add_special_tokens=False)["input_ids"])
        assert length - 256 - 0.05 * length <= tokens <= length - 256, tokens


def test_synthetic_deterministic_by_seed(byte_tokenizer):
    a = synthetic_items([1024], per_task=2, seed=1, tokenizer=byte_tokenizer)
    b = synthetic_items([1024], per_task=2, seed=1, tokenizer=byte_tokenizer)
    c = synthetic_items([1024], per_task=2, seed=2, tokenizer=byte_tokenizer)
    assert [(i.id, i.document, i.answers) for i in a] == [(i.id, i.document, i.answers) for i in b]
    assert [i.document for i in a] != [i.document for i in c]
    assert [i.id for i in a][:3] == ["niah_single@1024-0", "niah_multikey@1024-0", "niah_multivalue@1024-0"]
    with pytest.raises(RapidspecError):
        needle_item("niah_unknown", 1024)


def test_locomo_chat_form_asks_the_question_as_the_next_user_turn(tmp_path):
    items = load_items(write_locomo(tmp_path / "locomo.json"), "locomo-chat")
    assert [i.group for i in items] == ["locomo-chat/cat4", "locomo-chat/cat2", "locomo-chat/cat1"]
    first = items[0]
    roles = [m["role"] for m in first.messages]
    assert roles == ["user", "assistant", "assistant", "user"]  # Ann speaks as the user, Bob as the assistant
    assert first.messages[0]["content"] == "[DATE: 1:00 pm on 8 May, 2023] Ann: I adopted a cat named Biscuit."
    assert first.messages[-1]["content"].startswith("What is Ann's cat called? Answer in the form of a short phrase")
    assert "Use DATE of CONVERSATION" in items[1].messages[-1]["content"]  # category 2 asks for a date
    assert first.messages[:-1] == items[1].messages[:-1]  # one history per conversation
    assert first.query == "What is Ann's cat called?" and first.answers == ("Biscuit",)
    assert all(not i.messages for i in load_items(tmp_path / "locomo.json"))  # the document form is unchanged
