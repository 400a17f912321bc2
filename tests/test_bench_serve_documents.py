"""``rapidspec bench serve --documents``, llama-server's own speculation as peers, and benchmarks/documents_file.py."""

from __future__ import annotations

import json

import pytest

from benchmarks.documents_file import FOLLOW_UPS, cut, file_records
from rapidspec import Rapid
from rapidspec.bench.serve.dataset import documents_requests
from rapidspec.bench.serve.peer import PeerConfig, parse_speculations
from rapidspec.cli import main
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from tests.server_harness import running_server
from tests.specs import spec_of

SMALL = ["--max-tokens", "4", "--ignore-eos", "--timeout", "60"]
DOCUMENTS = [" ".join(f"Note {i}.{j}: the {'red' if i else 'blue'} shelf holds {j} jars." for j in range(24))
             for i in range(2)]


@pytest.fixture(autouse=True)
def no_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAPIDSPEC_API_KEY", raising=False)


@pytest.fixture
def documents_file(tmp_path):
    path = tmp_path / "documents.jsonl"
    lines = [json.dumps({"document": d, "questions": [f"How many jars on shelf {i}.{q}?" for q in range(3)]})
             for i, d in enumerate(DOCUMENTS)]
    path.write_text("\n".join(lines) + "\n\n")  # a blank line is allowed
    return path


def test_each_documents_questions_come_in_turn(documents_file):
    requests = documents_requests(documents_file)
    assert [(r.documents[0], r.messages[-1]["content"]) for r in requests] == [
        (d, f"How many jars on shelf {i}.{q}?") for i, d in enumerate(DOCUMENTS) for q in range(3)]


@pytest.mark.parametrize("line, message", [
    ("{", "documents.jsonl:1: not a JSON object"),
    ('{"document": "d", "question": "q"}', "exactly the keys document and questions, got ['document', 'question']"),
    ('["d"]', "exactly the keys document and questions, got list"),
    ('{"document": " ", "questions": ["q"]}', "document must be a non-empty string"),
    ('{"document": "d", "questions": []}', "questions must be a non-empty list"),
    ('{"document": "d", "questions": ["q", 3]}', "questions must be a non-empty list"),
])
def test_a_wrong_line_is_named(tmp_path, line, message):
    path = tmp_path / "documents.jsonl"
    path.write_text(json.dumps({"document": "d", "questions": ["q"]}) + "\n" + line + "\n")
    if "documents.jsonl:1" in message:
        path.write_text(line + "\n")
    with pytest.raises(RapidspecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        documents_requests(path)


def test_an_empty_or_missing_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(RapidspecError, match="no documents"):
        documents_requests(tmp_path / "empty.jsonl")
    with pytest.raises(RapidspecError, match="cannot read the documents file"):
        documents_requests(tmp_path / "missing.jsonl")


def test_a_live_run_asks_every_question_and_follow_ups_find_the_document_cached(tiny_model, other_tiny_model,
                                                                              documents_file, capsys):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96)),
                   target=tiny_model, drafter=other_tiny_model)
    with running_server(engine) as url:
        code = main(["bench", "serve", "--base-url", url, "--documents", str(documents_file), "--max-concurrency",
                     "1", *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    s = json.loads(captured.out.strip().splitlines()[-1])
    assert s["num_prompts"] == 6 and s["completed"] == 6 and s["dataset"] == str(documents_file)
    # the test request caches document 0: the 5 timed requests after a document's first reuse all of it
    assert s["cached_input_tokens"] >= 5 * min(len(d) for d in DOCUMENTS)  # one token a byte


def test_documents_replaces_the_dataset_options(documents_file, capsys):
    for extra in (["--dataset", str(documents_file)], ["--document-tokens", "256"]):
        code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--documents", str(documents_file),
                     *extra, *SMALL])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and "--documents replaces --dataset and --document-tokens" in err


def test_llama_servers_speculation_arguments(tmp_path):
    gguf, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    gguf.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    base = dict(binary=tmp_path / "llama-server", gguf=gguf, threads=2, parallel=1, slot_context=1024)
    assert "--spec-type" not in PeerConfig(**base).args() and PeerConfig(**base).name == "llama.cpp"
    ngram = PeerConfig(**base, speculation="ngram")
    assert ngram.args()[ngram.args().index("--spec-type") + 1] == "ngram-mod" and ngram.name == "llama.cpp-ngram"
    drafted = PeerConfig(**base, speculation="draft", draft_gguf=draft).args()
    assert drafted[drafted.index("--spec-type") + 1] == "draft-simple" and drafted[drafted.index("-md") + 1] == str(draft)
    with pytest.raises(RapidspecError, match="needs --peer-draft-gguf FILE"):
        PeerConfig(**base, speculation="draft")
    with pytest.raises(RapidspecError, match="needs --peer-draft-gguf FILE, and only it takes one"):
        PeerConfig(**base, speculation="ngram", draft_gguf=draft)
    with pytest.raises(RapidspecError, match="unknown llama-server speculation 'eagle'"):
        PeerConfig(**base, speculation="eagle")
    assert parse_speculations("none, ngram,draft") == ("none", "ngram", "draft")
    for wrong in ("", "ngram,ngram", "rapid"):
        with pytest.raises(RapidspecError, match="takes distinct names among none, ngram, draft"):
            parse_speculations(wrong)


@pytest.mark.parametrize("options, message", [
    (["--peer-speculation", "ngram"], "--peer-speculation applies to --peer llama.cpp and --peer vllm"),
    (["--peer", "llama.cpp", "--peer-speculation", "draft"], "--peer-speculation draft needs --peer-draft-gguf FILE"),
    (["--peer", "llama.cpp", "--peer-draft-gguf", "d.gguf"], "--peer-draft-gguf is the draft model of"),
    (["--peer-draft-gguf", "d.gguf"], "--peer-draft-gguf applies to --peer llama.cpp"),
])
def test_peer_speculation_mistakes_are_one_line(options, message, capsys):
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--document-tokens", "256", *options, *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and message in err


# ------------------------------------------------------------ benchmarks/documents_file.py
def test_documents_are_cut_to_their_tokens_at_a_line_break_and_short_ones_left_out(byte_tokenizer):
    text = "".join(f"line {i:03d} of the text\n" for i in range(40))  # 21 bytes a line: one token a byte
    # 405 tokens end inside the 20th line; the 19th line's break (byte 398) is within the last 10%
    assert cut(byte_tokenizer, text, 405) == text[:398] == cut(byte_tokenizer, text, 399)
    assert cut(byte_tokenizer, "no break " * 60, 300) == ("no break " * 60)[:300]
    assert cut(byte_tokenizer, text, len(text) + 1) is None


def test_a_file_rapidspec_eval_reads_becomes_documents_with_their_questions(byte_tokenizer, tmp_path):
    leval = tmp_path / "leval.jsonl"
    docs = ["A long text about ships. " * 40, "Short.", "Another long text about trains. " * 40]
    leval.write_text("".join(json.dumps({"input": d, "instructions": [f"Q{i}a?", f"Q{i}b?"], "outputs": ["x", "y"],
                                         "evaluation": "LLM"}) + "\n" for i, d in enumerate(docs)))
    records = file_records(byte_tokenizer, str(leval), 300, None)
    assert [len(r["document"]) <= 300 for r in records] == [True, True]
    assert [r["document"][:10] for r in records] == [docs[0][:10], docs[2][:10]]  # "Short." has too few tokens
    assert [r["questions"] for r in records] == [["Q0a?", "Q0b?"], ["Q2a?", "Q2b?"]]
    assert len(file_records(byte_tokenizer, str(leval), 300, 1)) == 1


@pytest.mark.slow  # reads the default model's tokenizer
def test_the_script_writes_the_built_in_document_with_follow_ups(tmp_path, capsys):
    from benchmarks.documents_file import main as write

    out = tmp_path / "demo.jsonl"
    assert write(["builtin", "--tokens", "512", "--follow-ups", "2", "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["questions"][-2:] == list(FOLLOW_UPS[:2]) and len(record["questions"]) == 10
    assert documents_requests(out)[0].documents == (record["document"],)
    assert write(["builtin", "--tokens", "512", "--follow-ups", "9", "--out", str(out)]) == 2
    assert "--follow-ups must be between 0 and 7" in capsys.readouterr().err
