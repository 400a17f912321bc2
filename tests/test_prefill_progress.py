"""A wait that says how long: the prefill's progress in the server's stream, and a stopped prefill keeps what it
read (tiny models, 64-token prefill chunks so a prompt takes many)."""

from __future__ import annotations

import re

import pytest
import torch

from rapidspec import DecodeConfig, Rapid
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.errors import PrefillStopped
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of

DOCUMENT = " ".join(f"Row {i}: the ferry carried {i * 11} passengers across the bay." for i in range(40))
LINE = re.compile(r"^: prefill (\d+)/(\d+) tokens(?:, (\d+) tokens/s, (\d+) s left)?$")


def engine(model, **options) -> Rapid:
    return Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), prefill_chunk_tokens=64, **options), target=model)


def test_the_stream_says_how_far_the_prefill_got_and_clients_ignore_it(tiny_model):
    from openai import OpenAI

    body = {"model": "tiny", "messages": [{"role": "user", "content": "How many passengers on row 9?"}],
            "documents": [DOCUMENT], "max_tokens": 6, "temperature": 0, "mode": "lc", "stream": True}
    with running_server(engine(tiny_model, kv_cache_gib=0)) as url:
        with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        progress = [LINE.match(line) for line in lines if line.startswith(":")]
        assert len(progress) > 10 and all(progress), lines[:5]
        done = [int(m.group(1)) for m in progress]
        total = int(progress[-1].group(2))
        assert done == sorted(done) and done[-1] == total and done[0] < total
        assert any(m.group(3) for m in progress[1:])  # a rate and the time left from the second line on
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {") and '"content"' in line
                          and '"role"' not in line)
        assert max(i for i, line in enumerate(lines) if line.startswith(":")) < first_data  # all before the answer
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=body["messages"], max_tokens=6, temperature=0, stream=True,
            extra_body={"documents": [DOCUMENT], "mode": "lc"}))
        assert chunks and chunks[-1].choices[0].finish_reason is not None


@pytest.mark.parametrize("how", ["stopped", "closed"])
def test_a_prefill_cut_short_keeps_what_it_read(tiny_model, tmp_path, how):
    rapid = engine(tiny_model, kv_cache_dir=str(tmp_path))
    config = DecodeConfig(mode="lc", max_new_tokens=4)
    prompts = rapid.document_prompts(DOCUMENT, "How many passengers on row 9?", config)
    chunks = {"n": 0}

    def should_stop() -> bool:
        chunks["n"] += 1
        return chunks["n"] > 20  # asked before each chunk after the first: the 21st ask stops, 21 chunks read

    with torch.inference_mode():
        if how == "stopped":
            with pytest.raises(PrefillStopped):
                for _ in rapid.decode(prompts, config, should_stop=should_stop):
                    pass
        else:
            stream = rapid.decode(prompts, config, yield_prefill_chunks=True)
            for _ in range(21):
                chunk = next(stream)
            assert chunk.prefill == (21 * 64, len(prompts.target_ids) - 1)
            stream.close()
    rapid.disk_store.flush()
    again = rapid.decode(prompts, config)
    *_, last = again
    assert last.output.stats.target_prefill_reused_tokens == 21 * 64  # from the prefix cache in memory
    other = engine(tiny_model, kv_cache_dir=str(tmp_path))  # another process: from disk, whole blocks and the rest
    *_, last = other.decode(prompts, config)
    assert last.output.stats.target_prefill_disk_tokens >= 21 * 64


def _progress(url: str, body: dict) -> list[int]:
    """The prefill's progress (tokens done, line after line) of a streamed request."""
    with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    return [int(m.group(1)) for m in (LINE.match(line) for line in lines if line.startswith(":")) if m]


def test_a_prefill_beside_other_requests_yields_every_shared_tokens(tiny_model):
    """Alone, a prefill steps in pieces that start at ``shared_prefill_tokens`` (32) and at most double, up to a
    whole chunk (1024 tokens; the tiny model's pieces are far shorter than a second); while another request runs,
    at most 32 tokens, so the other's rounds come between its chunks; with 0, whole chunks always."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "How many passengers on row 9?"}],
            "documents": [DOCUMENT], "max_tokens": 2, "temperature": 0, "mode": "lc"}
    long_answer = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 4000,
                   "ignore_eos": True, "mode": "lc", "stream": True}
    rapid = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), prefill_chunk_tokens=1024, kv_cache_gib=0),
                  target=tiny_model)
    for shared, steps_beside in ((32, {32}), (0, {1024})):
        with running_server(rapid, shared_prefill_tokens=shared, max_num_seqs=2) as url:
            alone = _progress(url, body | {"documents": [DOCUMENT.replace("ferry", f"barge {shared}")]})
            pieces = [b - a for a, b in zip(alone, alone[1:-1])]  # from the second on (the first line follows the
            # first piece, or a prefix the cache held); the last one is what was left
            if shared:
                assert pieces[0] == 2 * shared and max(pieces) <= 1024, pieces
                assert all(b <= 2 * a for a, b in zip(pieces, pieces[1:])), pieces
            else:
                assert set(pieces) == {1024}
            with HTTP.stream("POST", f"{url}/v1/chat/completions", json=long_answer, timeout=120) as running:
                lines = running.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))  # it runs
                beside = _progress(url, body | {"documents": [DOCUMENT.replace("ferry", f"boat {shared}")]})
                # then the long answer's stream is closed: that ends it
            assert len(beside) > (20 if shared else 2)
            assert {b - a for a, b in zip(beside, beside[1:-1])} == steps_beside
