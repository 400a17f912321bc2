"""`rapidspec report`: Markdown tables, paper numbers and figures from eval results files."""

from __future__ import annotations

import json

from rapidspec.cli import main
from rapidspec.evaluation.breakdown import group_length, speedups
from rapidspec.evaluation.report import load_records


def write_results(path, items: int = 6, model: str = "tiny", method: str = "bm25"):
    config = {"model": model, "drafter": None, "data": "synthetic", "temperature": 0.0, "seed": 0,
              "max_new_tokens": {"needle": 128, "qa": 32},  # per-task limits, as eval writes them
              "retrieval": {"method": method, "budget_tokens": None}}
    lines = []
    for index in range(items):
        length = 1024 if index % 2 else 2048
        group = f"synthetic/niah_single@{length}"
        runs = [("lc", 0.0, None, None, index % 3 == 0, 10.0), ("rag", 0.0, None, None, index % 2 == 0, 20.0)]
        runs += [("rapid", eta, 6, f"eta={eta:g}", eta >= 5 or index % 3 == 0, 10.0 + eta) for eta in (0.0, 10.0, 5.0)]
        runs += [("rapid", 2.0, 6, f"budget_tokens={b}", index % 2 == 0, 12.0) for b in (256, 512)]
        for mode, eta, gamma, sweep, right, speed in runs:
            lines.append(json.dumps({
                "id": f"i{index}", "group": group, "mode": mode, "eta": eta, "gamma": gamma, "sweep": sweep,
                "task_type": "needle", "score": float(right), "metrics": {"score": float(right), "em": float(right)},
                "stats": {"decode_tokens_per_second": speed, "acceptance_rate": 0.8 if gamma else None,
                          "mean_accepted_length": 3.0 if gamma else None, "target_prefill_seconds": 1.0,
                          "prompt_tokens_target": length},
                "config": config,
            }))
    path.write_text("\n".join(lines) + "\n" + '{"id": "half', encoding="utf-8")  # a partial last line is ignored
    return path


def test_report_tables_paper_numbers_and_figures(tmp_path, capsys):
    results = write_results(tmp_path / "study.jsonl")
    out = tmp_path / "report" / "study.md"
    preamble = tmp_path / "preamble.md"
    preamble.write_text("Made on a test machine.", encoding="utf-8")
    assert main(["report", str(results), "--out", str(out), "--per-group", "--preamble", str(preamble)]) == 0
    text = out.read_text(encoding="utf-8")
    for heading in ("Scores and speed", "The quality claim", "η (the paper's Table 3)", "Retrieval length",
                    "Who got it right", "#### synthetic/niah_single@1024", "Made on a test machine."):
        assert heading in text
    assert "| all | lc | 6 | recall | 0.333" in text  # 2 of 6 items right
    assert "+2.8 pt / 1.75x" in text  # the paper's Table 3 row for eta = 5
    assert text.index("| all | 5 | 6 |") < text.index("| all | 10 | 6 |")  # the eta table in order of eta
    assert "rapid eta=10: 1.000" in text and "reaches the better reference" in text
    assert "1.50x" in text  # rapid eta=5 decodes 15 tok/s against lc's 10 on every item
    for suffix in ("eta", "budget", "speedup"):
        assert (tmp_path / "report" / f"study_0_{suffix}.png").stat().st_size > 1000
        assert f"study_0_{suffix}.png" in text
    # several files: the speedup against context length is also drawn over the files of each model pair
    others = [write_results(tmp_path / "again.jsonl"), write_results(tmp_path / "big.jsonl", model="big")]
    assert main(["report", str(results), *map(str, others), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "## tiny ← self, all greedy files" in text and "## big ← self, all greedy files" in text
    for index in (0, 1):
        assert f"study_all_{index}_speedup.png" in text
        assert (tmp_path / "report" / f"study_all_{index}_speedup.png").stat().st_size > 1000
    assert "Retrieval methods" not in text  # no two files differ only in the method


def test_report_compares_retrieval_methods_on_the_same_items(tmp_path):
    files = [write_results(tmp_path / f"{m}.jsonl", method=m) for m in ("bm25", "hybrid")]
    files.append(write_results(tmp_path / "fewer.jsonl", items=4, method="dense"))  # other items: not compared
    out = tmp_path / "r.md"
    assert main(["report", *map(str, files), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text(encoding="utf-8")
    assert "| model | data | n | bm25 | hybrid |" in text
    assert "| tiny | synthetic | 6 | 0.500 [" in text  # rag right on even items


def test_helpers_and_errors(tmp_path, capsys):
    records = load_records(write_results(tmp_path / "r.jsonl", items=2))
    assert len(records) == 2 * 7
    assert speedups(records)[("synthetic/niah_single@2048", "rapid", 10.0, 6, "eta=10")] == 2.0
    assert group_length("synthetic/niah_multikey@8192") == 8192 and group_length("leval/quality") is None
    assert main(["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.md")]) == 2
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    assert main(["report", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "x.md")]) == 2
    assert "holds no records" in capsys.readouterr().err
    results = write_results(tmp_path / "r2.jsonl", items=2)
    assert main(["report", str(results), "--out", str(tmp_path / "x.md"), "--preamble", str(tmp_path / "nope.md")]) == 2


def test_a_file_that_is_not_an_eval_results_file_is_one_line_not_a_traceback(tmp_path, capsys):
    other = tmp_path / "bench.jsonl"  # a benchmark's own records: JSON lines, but no eval record's fields
    other.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n", encoding="utf-8")
    results = write_results(tmp_path / "r.jsonl", items=1)
    assert main(["report", str(results), str(other), "--out", str(tmp_path / "x.md")]) == 2
    err = capsys.readouterr().err
    assert "bench.jsonl is not a results file of `rapidspec eval`: record 1 has no id, mode, metrics, stats, config" \
        in err and "Traceback" not in err and not (tmp_path / "x.md").exists()


def test_the_data_is_named_without_the_machine_s_folders(tmp_path):
    from rapidspec.evaluation.report import data_name

    assert data_name("/home/me/data/leval/quality.jsonl") == "leval/quality.jsonl"
    assert data_name("../shared/data/locomo/locomo_dev.json") == "locomo/locomo_dev.json"
    assert data_name("synthetic") == "synthetic" and data_name(None) == "None"
