"""`rapidspec retrieve`: JSON and table output, exit codes for user mistakes."""

from __future__ import annotations

import io
import json
import sys

import pytest

from rapidspec.cli import main

NEEDLE = "The lighthouse keeper hid the brass key under the third stair."


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level tokenizer saved as a local HF tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([NEEDLE, "filler text about the sea and ships"], trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False))
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return str(path)


@pytest.fixture
def document(tmp_path):
    paragraphs = [f"Paragraph {i}: filler text about the sea and ships, number {i}." for i in range(200)]
    paragraphs[137] += " " + NEEDLE
    path = tmp_path / "doc.txt"
    path.write_bytes("\r\n\r\n".join(paragraphs).encode("utf-8"))
    return path


def run(capsys, *args):
    code = main(["retrieve", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output(capsys, document, tokenizer_dir):
    code, out, err = run(capsys, "--document", str(document), "--question", "Where is the brass key?",
                         "--method", "bm25", "--budget-tokens", "40", "--chunk-tokens", "20",
                         "--tokenizer", tokenizer_dir, "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["method"] == "bm25" and result["budget_tokens"] == 40
    assert 0 < result["num_tokens"] <= 40
    text = document.read_bytes().decode("utf-8")
    assert any("brass key" in c["text"] for c in result["chunks"])
    for c in result["chunks"]:
        assert text[c["char_start"] : c["char_end"]] == c["text"]
        assert {"score", "rank", "num_tokens"} <= set(c)


def test_table_output_from_stdin(capsys, monkeypatch, document, tokenizer_dir):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(document.read_bytes()), encoding="utf-8"))
    code, out, err = run(capsys, "--document", "-", "--question", "brass key", "--method", "bm25",
                         "--chunk-tokens", "20", "--budget-tokens", "20", "--tokenizer", tokenizer_dir)
    assert code == 0, err
    assert "bm25" in out and "rank" in out and "span" in out


@pytest.mark.parametrize("extra, message", [
    (["--chunk-tokens", "0"], "chunk_tokens"),
    (["--overlap-tokens", "20", "--chunk-tokens", "20"], "overlap_tokens"),
    (["--budget-tokens", "1", "--chunk-tokens", "20"], "budget"),
])
def test_bad_settings_exit_2(capsys, document, tokenizer_dir, extra, message):
    code, out, err = run(capsys, "--document", str(document), "--question", "key", "--method", "bm25",
                         "--tokenizer", tokenizer_dir, *extra)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content, message", [
    (b"", "document is empty"),
    (b" \r\n\t ", "document is empty"),
    (b"caf\xe9 latin-1 text", "not valid UTF-8"),
])
def test_bad_documents_exit_2(capsys, tmp_path, tokenizer_dir, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    code, _, err = run(capsys, "--document", str(path), "--question", "key", "--method", "bm25", "--tokenizer", tokenizer_dir)
    assert code == 2 and message in err


def test_missing_file_and_empty_question_exit_2(capsys, tmp_path, document, tokenizer_dir):
    code, _, err = run(capsys, "--document", str(tmp_path / "nope.txt"), "--question", "key", "--tokenizer", tokenizer_dir)
    assert code == 2 and "no such file" in err
    code, _, err = run(capsys, "--document", str(document), "--question", " ", "--method", "bm25", "--tokenizer", tokenizer_dir)
    assert code == 2 and "query is empty" in err


def test_unknown_tokenizer_and_embedder_exit_2(capsys, tmp_path, document, tokenizer_dir):
    code, _, err = run(capsys, "--document", str(document), "--question", "key", "--tokenizer", str(tmp_path / "none"))
    assert code == 2 and "tokenizer" in err and "not found locally" in err
    code, _, err = run(capsys, "--document", str(document), "--question", "key", "--method", "dense",
                       "--embedding-model", str(tmp_path / "no-model"), "--tokenizer", tokenizer_dir)
    assert code == 2 and "not available offline" in err
    assert len(err.strip().splitlines()[-1]) > 0


@pytest.mark.slow
def test_builtin_tokenizer_and_hybrid(capsys, document):
    code, out, err = run(capsys, "--document", str(document), "--question", "Where did the keeper hide the brass key?",
                         "--budget-tokens", "256", "--chunk-tokens", "128", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["method"] == "hybrid" and result["num_tokens"] <= 256
    assert any("brass key" in c["text"] for c in result["chunks"])
