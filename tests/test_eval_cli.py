"""`rapidspec eval` end to end on a tiny model (fast), its error paths, and one run on the built-in model (slow)."""

from __future__ import annotations

import json

import pytest

import rapidspec.cli.eval as eval_cli
from rapidspec.cli import main
from rapidspec.drafting.eta_default import DEFAULT_ETA
from tests.test_eval_datasets import write_leval, write_longbench2

SMALL_RETRIEVAL = ["--retrieval", "bm25", "--chunk-tokens", "64", "--budget-tokens", "128"]


@pytest.fixture()
def tiny_cli(monkeypatch, tiny_model):
    monkeypatch.setattr(eval_cli, "load_models", lambda args: (tiny_model, None))


def last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1]), out


def test_eval_end_to_end_and_resume(tiny_cli, tmp_path, capsys):
    data = write_longbench2(tmp_path / "lb.json", n=3)
    results = tmp_path / "out" / "results.jsonl"
    argv = ["eval", "--data", str(data), "--limit", "2", "--max-new-tokens", "4", "--results", str(results),
            *SMALL_RETRIEVAL]
    assert main(argv) == 0
    summary, out = last_json(capsys)
    assert summary["items"] == 2 and summary["new_records"] == 6 and summary["modes"] == ["lc", "rag", "rapid"]
    assert any("mean [95% CI]" in line for line in out)  # the rich table precedes the JSON line
    rows = {row["mode"]: row for row in summary["summary"]}
    assert rows["rapid"]["n"] == 2 and rows["rapid"]["metric"] == "choice_accuracy" and rows["rapid"]["eta"] == DEFAULT_ETA["self"]
    (who,) = summary["breakdown"]  # the Figure 2 split of rapid's answers by lc's and rag's
    assert who["mode"] == "rapid" and who["n"] == 2 and sum(who["items"].values()) == 2
    assert any("only here" in line for line in out)
    assert len(results.read_text().splitlines()) == 6
    assert main([*argv, "--json-only"]) == 0
    again, out = last_json(capsys)
    assert again["new_records"] == 0 and again["resumed_records"] == 6 and len(out) == 1
    # Another token limit on the same file is refused; --overwrite starts afresh.
    assert main([*argv[:-8], "--max-new-tokens", "3", "--results", str(results), "--modes", "lc", *SMALL_RETRIEVAL]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert main([*argv[:-8], "--max-new-tokens", "3", "--results", str(results), "--modes", "lc", "--overwrite",
                 *SMALL_RETRIEVAL]) == 0
    assert len(results.read_text().splitlines()) == 2



def test_eval_builds_its_engine_from_every_drafter_option(tiny_cli, tmp_path, monkeypatch, capsys):
    """The drafter options reach eval's engine (they were accepted and dropped before)."""
    from rapidspec.engine import Rapid

    built, init = [], Rapid.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Rapid, "__init__", spy)
    data = write_longbench2(tmp_path / "lb.json", n=1)
    assert main(["eval", "--data", str(data), "--modes", "rapid", "--max-new-tokens", "2", "--drafter-threads", "1",
                 "--drafter-prefill", "after", "--drafter-gguf", "as-is", "--json-only", *SMALL_RETRIEVAL]) == 0
    (engine,) = built
    options = engine.drafting.options
    assert (engine.drafting.threads, options.drafter_prefill, options.drafter_gguf) == (1, "after", "as-is")
    assert engine.retriever.config.method == "bm25" and engine.retriever.config.budget_tokens == 128

def test_eval_synthetic_and_leval(tiny_cli, tmp_path, capsys):
    assert main(["eval", "--format", "synthetic", "--lengths", "1024", "--per-task", "1", "--modes", "lc,rapid",
                 "--max-new-tokens", "4", *SMALL_RETRIEVAL]) == 0
    summary, _ = last_json(capsys)
    assert summary["items"] == 3 and {r["metric"] for r in summary["summary"]} == {"string_match_all"}
    data = write_leval(tmp_path / "quality.jsonl")
    assert main(["eval", "--data", str(data), "--modes", "lc", "--max-new-tokens", "4", *SMALL_RETRIEVAL]) == 0
    summary, _ = last_json(capsys)
    assert summary["summary"][0]["group"] == "leval/quality" and summary["summary"][0]["n"] == 3


def test_eval_passes_draft_confidence_through(tiny_cli, tmp_path, capsys):
    """The tiny model never reaches 0.999 confidence: every rapid round drafts one token."""
    results = tmp_path / "results.jsonl"
    data = write_leval(tmp_path / "quality.jsonl")
    assert main(["eval", "--data", str(data), "--limit", "1", "--modes", "rapid", "--max-new-tokens", "6",
                 "--draft-confidence", "0.999", "--gamma-schedule", "constant", "--results", str(results),
                 *SMALL_RETRIEVAL]) == 0
    record = json.loads(results.read_text().splitlines()[0])
    assert record["config"]["decode"]["draft_confidence"] == 0.999
    stats = record["stats"]
    # a round with nothing left to draft (the last token) drafts none
    assert stats["drafted_tokens"] >= 2 and stats["drafted_per_position"] == [stats["drafted_tokens"]]


def test_eval_sweep_from_the_command_line(tiny_cli, tmp_path, capsys):
    data = write_leval(tmp_path / "quality.jsonl")
    assert main(["eval", "--data", str(data), "--limit", "1", "--modes", "lc,rapid", "--max-new-tokens", "4",
                 "--sweep", "eta=0,4", "--retrieve-from", "other-item", *SMALL_RETRIEVAL]) == 0
    summary, out = last_json(capsys)
    assert [(row["mode"], row["sweep"]) for row in summary["summary"]] == [("lc", None), ("rapid", "eta=0"), ("rapid", "eta=4")]
    assert any("eta=4" in line for line in out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "{missing}"], "no such data file"),
        (["--data", "{leval}", "--format", "longbench2"], "lacks"),
        (["--data", "{leval}", "--modes", "lc,fast"], "unknown mode"),
        (["--data", "{leval}", "--limit", "0"], "--limit"),
        (["--data", "{leval}", "--gamma", "0"], "gamma"),
        (["--format", "synthetic", "--tasks", "niah_nothing"], "synthetic task"),
        (["--format", "synthetic", "--lengths", "99999"], "window"),
        (["--format", "leval"], "--data is required"),
        (["--data", "{leval}", "--sweep", "temperature=0,1"], "sweep must look like"),
        (["--data", "{leval}", "--sweep", "budget_tokens=0"], "budget_tokens values must be >= 1"),
        (["--data", "{leval}", "--retrieve-from", "{missing}"], "--retrieve-from"),
        (["--data", "{leval}", "--json-object"], "do not apply to eval"),
    ],
)
def test_eval_user_mistakes_exit_2_with_one_line(tiny_cli, tmp_path, capsys, argv, message):
    leval = write_leval(tmp_path / "quality.jsonl")
    argv = [a.format(missing=tmp_path / "missing.json", leval=leval) for a in argv]
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rapidspec eval: error:") and message in err


def test_eval_bad_format_name_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--data", str(tmp_path / "x.json"), "--format", "squad"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_builtin_model_end_to_end(tmp_path, capsys):
    data = write_longbench2(tmp_path / "lb.json", n=3)
    results = tmp_path / "results.jsonl"
    assert main(["eval", "--data", str(data), "--limit", "2", "--max-new-tokens", "8", "--results", str(results),
                 "--retrieval", "bm25"]) == 0
    summary, _ = last_json(capsys)
    assert summary["model"] == "builtin" and summary["new_records"] == 6
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert all(r["stats"]["new_tokens"] >= 1 for r in records)
    rapid = [r for r in records if r["mode"] == "rapid"]
    assert all(r["stats"]["rounds"] >= 1 for r in rapid)
