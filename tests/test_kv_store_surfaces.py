"""The key/value cache on disk as users meet it: two `rapidspec generate` processes, a restarted server, and
`rapidspec cache ls|rm` (tiny models; the real model's figures: benchmarks/document_once.py)."""

from __future__ import annotations

import json

from rapidspec import Rapid
from rapidspec.cli import main
from rapidspec.retrieval import RetrievalConfig
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of

DOCUMENT = " ".join(f"Entry {i}: the harbour master counted {i * 7} sails before noon." for i in range(40))


def generate(document, folder, question, capsys, *extra) -> dict:
    code = main(["generate", "--document", str(document), "--question", question, "--json", "--mode", "lc",
                 "--temperature", "0", "--max-new-tokens", "8", "--kv-cache-dir", str(folder), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def test_a_second_generate_reads_the_document_from_disk_and_answers_the_same(tiny_model_dir, tmp_path, capsys):
    document = tmp_path / "harbour.txt"
    document.write_text(DOCUMENT, encoding="utf-8")
    target = ["--target", str(tiny_model_dir), "--dtype", "float32"]
    first = generate(document, tmp_path / "kv", "How many sails at entry 12?", capsys, *target)
    again = generate(document, tmp_path / "kv", "How many sails at entry 12?", capsys, *target)
    assert first["stats"]["target_prefill_disk_tokens"] == 0
    assert again["stats"]["target_prefill_disk_tokens"] == again["stats"]["prompt_tokens_target"] - 1
    assert again["text"] == first["text"]
    other = generate(document, tmp_path / "kv", "And at entry 30?", capsys, *target)
    assert 0 < other["stats"]["target_prefill_disk_tokens"] < other["stats"]["prompt_tokens_target"] - 1
    off = generate(document, tmp_path / "kv", "And at entry 30?", capsys, *target, "--kv-cache-gib", "0")
    assert off["stats"]["target_prefill_disk_tokens"] == 0

    assert main(["cache", "ls", "--json", "--kv-cache-dir", str(tmp_path / "kv")]) == 0
    listed = json.loads(capsys.readouterr().out)
    (model,) = listed["models"]
    assert model["model"]["name"] == str(tiny_model_dir) and model["model"]["dtype"] == "torch.float32"
    assert model["tokens"] >= other["stats"]["prompt_tokens_target"] and model["bytes"] > 0
    assert main(["cache", "ls", "--kv-cache-dir", str(tmp_path / "kv")]) == 0
    assert model["key"][:12] in capsys.readouterr().out
    assert main(["cache", "rm", "no-such-key", "--kv-cache-dir", str(tmp_path / "kv")]) == 2
    assert "no model" in capsys.readouterr().err
    assert main(["cache", "rm", model["key"][:8], "--kv-cache-dir", str(tmp_path / "kv")]) == 0
    assert "removed the blocks of 1 model" in capsys.readouterr().out
    assert main(["cache", "ls", "--json", "--kv-cache-dir", str(tmp_path / "kv")]) == 0
    assert json.loads(capsys.readouterr().out)["models"] == []


def test_a_negative_bound_is_one_line(tmp_path, capsys):
    document = tmp_path / "d.txt"
    document.write_text("text", encoding="utf-8")
    code = main(["generate", "--document", str(document), "--question", "Q?", "--kv-cache-gib", "-1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "kv_cache_gib" in err


def ask(url: str) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "How many sails at entry 12?"}],
            "documents": [DOCUMENT], "max_tokens": 8, "temperature": 0, "mode": "lc"}
    response = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_restarted_server_answers_from_the_blocks_the_first_one_wrote(tiny_model, tmp_path):
    answers, metrics = [], []
    for _ in range(2):  # two servers one after the other, each with a new engine: a restart
        engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_dir=str(tmp_path)), target=tiny_model)
        with running_server(engine) as url:
            answers.append(ask(url))
            engine.disk_store.flush()
            metrics.append(HTTP.get(f"{url}/metrics", timeout=10).text)
    first, second = answers
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached == second["usage"]["prompt_tokens"] - 1
    assert 'rapidspec:kv_disk_cache_hits_total{model_name="tiny"} 0.0' in metrics[0]
    assert f'rapidspec:kv_disk_cache_hits_total{{model_name="tiny"}} {float(cached)}' in metrics[1]
