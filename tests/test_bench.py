"""``rapidspec bench``: the speed harness on tiny models, option parsing, CLI error paths."""

from __future__ import annotations

import json

import pytest

from rapidspec.cli import main
from rapidspec.config import DecodeConfig
from rapidspec.engine import Rapid
from rapidspec.errors import RapidspecError
from rapidspec.bench import speed
from rapidspec.retrieval import RetrievalConfig
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)
DOCUMENT = " ".join(f"Paragraph {i}: the quick brown fox number {i} jumps over the lazy dog." for i in range(6))
QUESTION = "What does the fox do?"


@pytest.fixture(scope="module")
def report(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=tiny_model)
    items = [speed.BenchItem(DOCUMENT, QUESTION, 0), speed.BenchItem(DOCUMENT[:250], QUESTION, 0)]
    # eta = 0: rapid is then plain speculative decoding and must equal lc.
    return speed.run_benchmark(
        engine, items, speed.DEFAULT_MODES, DecodeConfig(max_new_tokens=12, eta=0.0, drafter_start="first"), repeats=2,
        profile=True,
    )


def test_every_mode_reported_per_input(report):
    labels = [(r.item_index, r.label) for r in report.results]
    assert labels == [(i, m) for i in (0, 1) for m in ("lc", "sd", "ragsd", "rapid", "hf-assisted")]
    for r in report.results:
        assert r.repeats == 2
        assert r.new_tokens == 12  # the random model never emits EOS within 12 tokens here
        assert r.decode_tokens_per_second > 0 and r.total_seconds > 0
        assert r.prompt_tokens_target == report.results[r.item_index * 5].prompt_tokens_target


def test_speedups_are_against_lc_of_the_same_input(report):
    lc = {r.item_index: r for r in report.results if r.mode == "lc"}
    for r in report.results:
        ref = lc[r.item_index]
        assert r.decode_speedup == pytest.approx(r.decode_tokens_per_second / ref.decode_tokens_per_second)
        assert r.end_to_end_speedup == pytest.approx(ref.total_seconds / r.total_seconds)
    assert all(r.decode_speedup == 1.0 for r in lc.values())


def test_greedy_outputs_equal_lc(report):
    assert all(r.equals_lc for r in report.results)
    for r in report.results:
        if r.mode in ("sd", "ragsd", "rapid"):
            assert r.drafter_prefill_seconds is not None and 0 <= r.acceptance_rate <= 1
            assert set(r.profile) >= {"draft_ms_per_round", "verify_seconds", "bookkeeping_seconds"}
        else:
            assert r.acceptance_rate is None and r.profile is None
    # sd drafts with the target's own weights on the same context: everything is accepted.
    assert all(r.acceptance_rate == 1.0 for r in report.results if r.mode == "sd")


def test_report_is_json(report):
    data = json.loads(json.dumps(report.to_dict()))
    assert data["repeats"] == 2 and len(data["results"]) == 10 and "token_ids" not in data["results"][0]


def test_equality_flag_detects_different_answers(report):
    results = [speed.Result(**{**r.__dict__}) for r in report.results[:2]]
    results[1].token_ids = (*results[1].token_ids[:-1], results[1].token_ids[-1] + 1)
    speed.compare_with_lc(results)
    assert results[0].equals_lc is True and results[1].equals_lc is False


def test_sweep_runs_rapid_per_value(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=tiny_model)
    sweep = speed.parse_sweep("gamma=1,3")
    report = speed.run_benchmark(
        engine, [speed.BenchItem(DOCUMENT, QUESTION)], base=DecodeConfig(max_new_tokens=6, eta=0.0), repeats=1,
        sweep=sweep, warmup=False,
    )
    assert [(r.label, r.gamma, r.sweep_value) for r in report.results] == [
        ("lc", None, None), ("rapid gamma=1", 1, 1), ("rapid gamma=3", 3, 3)
    ]
    assert all(r.equals_lc for r in report.results)


def test_plot_writes_png(report, tmp_path):
    from rapidspec.bench.plot import plot_report

    path = plot_report(report, tmp_path / "sub" / "bench.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_parse_sweep():
    assert speed.parse_sweep("eta=0,1,2.5") == speed.Sweep("eta", (0.0, 1.0, 2.5))
    assert speed.parse_sweep("gamma=2,4") == speed.Sweep("gamma", (2, 4))
    assert speed.parse_sweep("draft_confidence=0,0.3") == speed.Sweep("draft_confidence", (0.0, 0.3))
    for bad in ("eta", "eta=", "temperature=1", "gamma=2.5", "gamma=0", "eta=-1", "eta=a", "draft_confidence=1"):
        with pytest.raises(RapidspecError):
            speed.parse_sweep(bad)


def test_parse_modes_and_lengths():
    assert speed.parse_modes("rapid,lc,sd,rapid") == ("lc", "rapid", "sd")
    assert speed.parse_modes("hf-assisted") == ("lc", "hf-assisted")
    with pytest.raises(RapidspecError, match="unknown mode"):
        speed.parse_modes("lc,fast")
    assert speed.parse_lengths("1024, 512,1024", 8192) == (1024, 512)
    for bad in ("255", "9000", "1k", ""):
        with pytest.raises(RapidspecError):
            speed.parse_lengths(bad, 8192)


def test_load_items(tmp_path):
    records = [{"document": "a long text", "question": "q?"}, {"document": "b", "question": "r?"}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records))
    listed = tmp_path / "d.json"
    listed.write_text(json.dumps(records))
    assert speed.load_items(jsonl) == speed.load_items(listed) == [speed.BenchItem("a long text", "q?"), speed.BenchItem("b", "r?")]
    listed.write_text(json.dumps([{"document": "x"}]))
    with pytest.raises(RapidspecError, match="question"):
        speed.load_items(listed)


def test_engine_must_not_reuse_document_cache(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model)
    with pytest.raises(RapidspecError, match="reuse_document_cache"):
        speed.run_benchmark(engine, [speed.BenchItem(DOCUMENT, QUESTION)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "lc,turbo"], "unknown mode"),
        (["--lengths", "100"], "below the minimum"),
        (["--sweep", "eta:1,2"], "sweep must look like"),
        (["--data", "/nonexistent/records.jsonl"], "data file not found"),
        (["--repeats", "0"], "repeats"),
        (["--repetition-penalty", "1.1"], "hf-assisted would run without them"),
    ],
)
def test_cli_errors_exit_2_before_loading_a_model(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_end_to_end_builtin(capsys, tmp_path):
    code = main(["bench", "--target", "builtin:smollm2-135m", "--lengths", "512", "--repeats", "2", "--max-new-tokens", "8",
                 "--modes", "lc,rapid,hf-assisted",
                 "--share-prefill", "--drafter-quantize", "int8", "--plot", str(tmp_path / "b.png")])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    assert [r["label"] for r in data["results"]] == ["lc", "rapid", "hf-assisted"]
    assert data["results"][2]["equals_lc"] is True
    assert data["drafter"] == "self int8"
    assert data["shared_prefill"] and data["ignore_eos"] and all(r["new_tokens"] == 8 for r in data["results"])
    assert data["results"][1]["target_prefill_seconds"] == data["results"][0]["target_prefill_seconds"]
    assert all(r["peak_rss_gib"] > 0.1 for r in data["results"])
    assert (tmp_path / "b.png").exists()


def test_peak_memory_is_reported_per_result(report):
    for r in report.results:
        assert r.peak_rss_gib > 0.01 and r.peak_cuda_gib is None  # CPU-only run: resident set of this process
    assert "peak_rss_gib" in report.to_dict()["results"][0]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_gives_every_mode_the_full_length(tiny_model, ignore_eos):
    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=tiny_model)
    plain = engine.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=12).token_ids
    stop_token = plain[3]  # make a token of the answer the end-of-sequence token
    engine.eos_token_ids = frozenset({stop_token})
    base = DecodeConfig(max_new_tokens=12, eta=0.0, ignore_eos=ignore_eos)
    report = speed.run_benchmark(
        engine, [speed.BenchItem(DOCUMENT, QUESTION)], ("lc", "ragsd", "rapid", "hf-assisted"), base,
        repeats=1, warmup=False,
    )
    expected = 12 if ignore_eos else plain.index(stop_token)
    assert report.ignore_eos is ignore_eos
    for r in report.results:
        assert r.new_tokens == expected, r.label
        assert r.equals_lc, r.label


def test_shared_prefill_is_measured_once_and_credited_to_every_run(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=True), target=tiny_model)
    base = DecodeConfig(max_new_tokens=8, eta=0.0)
    report = speed.run_benchmark(
        engine, [speed.BenchItem(DOCUMENT, QUESTION)], ("lc", "rag", "ragsd", "rapid"), base, repeats=2,
        warmup=False, share_prefill=True,
    )
    assert report.shared_prefill and report.to_dict()["shared_prefill"]
    by_label = {r.label: r for r in report.results}
    full = by_label["lc"].target_prefill_seconds
    for label in ("ragsd", "rapid"):
        assert by_label[label].target_prefill_seconds == full
        assert by_label[label].equals_lc
    assert by_label["rag"].target_prefill_seconds != full  # the target reads the retrieved text: its own prefill


def test_engine_and_share_prefill_must_agree(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=tiny_model)
    with pytest.raises(RapidspecError, match="reuse_document_cache=True"):
        speed.run_benchmark(engine, [speed.BenchItem(DOCUMENT, QUESTION)], ("lc",), repeats=1, share_prefill=True)


def test_positive_ints_takes_a_comma_list_and_refuses_the_rest():
    import argparse

    from rapidspec.bench.inputs import positive_ints

    assert positive_ints("1,2, 4,8") == [1, 2, 4, 8]
    for bad in ("", "0,1", "-2", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            positive_ints(bad)
    with pytest.raises(ValueError):  # argparse reports it as an invalid value
        positive_ints("two")
