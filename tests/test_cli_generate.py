"""`rapidspec generate` and `rapidspec demo`: error codes (fast) and end-to-end runs (slow)."""

from __future__ import annotations

import json

import pytest

from rapidspec.cli import main


@pytest.fixture()
def document(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The lighthouse keeper's cat is called Biscuit.\n\n" * 20, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--eta", "-1"], "eta"),
        (["--gamma", "0"], "gamma"),
        (["--draft-confidence", "1.5"], "draft_confidence"),
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "1e-40"], "temperature"),
        (["--seed", str(2**64)], "seed"),
        (["--seed", "-1"], "seed"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--mode", "sd", "--eta", "3"], "eta"),
        (["--mode", "magicdec", "--streaming-tokens", "8"], "streaming_tokens"),
        (["--target", "/nonexistent/model-dir"], "model"),
        (["--json-schema", "/nonexistent/schema.json"], "cannot read the JSON schema"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(document, capsys, extra, message):
    code = main(["generate", "--document", str(document), "--question", "Cat?", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err


def test_missing_empty_and_binary_documents(tmp_path, capsys):
    assert main(["generate", "--document", str(tmp_path / "missing.txt"), "--question", "Q?"]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n", encoding="utf-8")
    assert main(["generate", "--document", str(empty), "--question", "Q?"]) == 2
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    assert main(["generate", "--document", str(binary), "--question", "Q?"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("rapidspec generate: error:") for line in errors)


@pytest.mark.slow
def test_generate_json_end_to_end(document, capsys):
    code = main([
        "generate", "--document", str(document), "--question", "What is the cat called?",
        "--mode", "rapid", "--max-new-tokens", "12", "--retrieval", "bm25", "--json",
    ])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(out[-1])
    assert result["mode"] == "rapid" and result["text"]
    assert result["stats"]["new_tokens"] >= 1 and result["stats"]["time_to_first_token"] > 0
    assert "drafter_joined_at" in result["stats"]  # None: 12 tokens did not pay for the drafter's prefill
    assert result["retrieval"]["chunks"]  # bm25 costs a query: it ran after the first token
    # the step costs the join read, with when and beside what load they were measured (rapidspec calibrate)
    assert result["calibration"] and all({"key", "measured_at", "load", "busy"} <= set(e) for e in result["calibration"])


CAT_SCHEMA = {"type": "object", "properties": {"cat": {"type": "string", "maxLength": 24}}, "required": ["cat"],
              "additionalProperties": False}


def test_generate_with_a_json_schema_file(document, tiny_model_dir, tmp_path, capsys):
    schema = tmp_path / "cat.json"
    schema.write_text(json.dumps(CAT_SCHEMA), encoding="utf-8")
    code = main(["generate", "--document", str(document), "--question", "Cat?", "--target", str(tiny_model_dir),
                 "--retrieval", "bm25", "--json-schema", str(schema), "--max-new-tokens", "160", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and set(json.loads(result["text"])) == {"cat"}


def test_a_bad_json_schema_file_is_one_line(document, tiny_model_dir, tmp_path, capsys):
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "nonsense"}', encoding="utf-8")
    code = main(["generate", "--document", str(document), "--question", "Cat?", "--target", str(tiny_model_dir),
                 "--json-schema", str(schema)])
    assert code == 2 and "invalid json schema" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_generate_json_schema_on_the_builtin_model(document, tmp_path, capsys):
    """The built-in model fills a schema from the document, drafts and verification constrained alike."""
    schema = tmp_path / "cat.json"
    schema.write_text(json.dumps(CAT_SCHEMA), encoding="utf-8")
    code = main(["generate", "--document", str(document), "--question", "What is the cat called? Answer in JSON.",
                 "--retrieval", "bm25", "--json-schema", str(schema), "--max-new-tokens", "40", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and "Biscuit" in json.loads(result["text"])["cat"]


@pytest.mark.slow
def test_demo_end_to_end(capsys):
    """The default model answers the planted fact, then a follow-up; rapid and lc answer both."""
    code = main(["demo", "--document-tokens", "1500", "--max-new-tokens", "16", "--retrieval", "bm25", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and 1500 <= result["prompt_tokens"] <= 1800
    first, follow_up = result["questions"]
    assert first["expected_answer"] == "4:30 pm" and "4:30" in first["outputs"]["lc"]["text"]
    assert follow_up["expected_answer"] is None and "code block" in follow_up["question"]
    for entry in result["questions"]:
        assert set(entry["outputs"]) == {"lc", "rapid"}
        assert entry["decode_speedup"] > 0 and entry["end_to_end_speedup"] > 0
        stats = entry["outputs"]["rapid"]["stats"]
        assert stats["time_to_first_token"] > 0
        # short answers: the drafter joins only where its prefill pays, and then drafts
        assert (stats["drafter_joined_at"] is None) == (stats["drafted_tokens"] == 0)
    assert follow_up["outputs"]["lc"]["stats"]["target_prefill_reused_tokens"] > 1000  # the document was read once


@pytest.mark.slow  # resolves the default model's files (installed by the set-up)
@pytest.mark.parametrize(
    ("target_quantize", "drafter_quantize", "expected"),
    [
        ("none", "none", None),  # the target's own weights draft
        ("none", "int4", "copy int4"),  # a quantised copy of the float target
        ("int8", "none", None),  # the int8 target drafts itself
        ("int8", "int8", None),
        ("int8", "int4", "load int4"),  # the float weights are gone: the target is loaded again
    ],
)
def test_self_drafter_follows_drafter_quantize(monkeypatch, tiny_model, target_quantize, drafter_quantize, expected):
    from dataclasses import replace

    import rapidspec.models as models
    from rapidspec.cli import build_parser
    from rapidspec.cli.options import load_models

    loads = []

    def fake_load(name, dtype="auto", device="auto", quantize="none", runtime="auto"):
        loads.append(quantize)
        return replace(tiny_model, quantization=quantize)

    monkeypatch.setattr(models, "load_model", fake_load)
    args = build_parser().parse_args(["generate", "--document", "-", "--question", "q", "--quantize", target_quantize,
                                      "--drafter-quantize", drafter_quantize])
    target, drafter = load_models(args)  # the options' ModelSpec, loaded
    assert target.quantization == target_quantize
    if expected is None:
        assert drafter is None and loads == [target_quantize]
    else:
        how, method = expected.split()
        assert drafter.name == "self" and drafter.quantization == method
        assert loads == ([target_quantize] if how == "copy" else [target_quantize, method])


def test_max_new_tokens_beyond_the_window_is_one_line(document, tiny_model_dir, capsys):
    code = main(["generate", "--document", str(document), "--question", "Cat?", "--target", str(tiny_model_dir),
                 "--retrieval", "bm25", "--max-new-tokens", "100000"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert code == 2 and last.startswith("rapidspec generate: error: max_new_tokens=100000 leaves no room")


def test_generate_magicdec_on_a_saved_model(document, tiny_model_dir, capsys):
    code = main(["generate", "--document", str(document), "--question", "Cat?", "--target", str(tiny_model_dir),
                 "--mode", "magicdec", "--sink-tokens", "4", "--streaming-tokens", "64", "--max-new-tokens", "6", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["mode"] == "magicdec"
    assert result["stats"]["prompt_tokens_drafter"] == 64 < result["stats"]["prompt_tokens_target"]


def test_a_reader_that_leaves_early_gets_no_traceback(tiny_model_dir, document):
    """`rapidspec generate ... | head`: the pipe closes before the answer is written."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "rapidspec", "generate", "--document", str(document), "--question", "Cat?",
               "--target", str(tiny_model_dir), "--max-new-tokens", "8", "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the first byte
    _, err = process.communicate(timeout=300)
    assert process.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err
