"""The llama.cpp drafter backend keeps every invariant, on a tiny GGUF the tests write.

The target is the tiny torch model of conftest; the drafter is llama.cpp over
a GGUF of the same weights (self-speculation) or of other weights.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rapidspec import DecodeConfig, Rapid
from rapidspec.errors import RapidspecError
from rapidspec.models.backend import choose_backend
from rapidspec.outputs import last_output
from rapidspec.prompting.prompts import PromptPair
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.cache import common_prefix_length
from rapidspec.runtime.lean import LeanModel
from rapidspec.runtime.llama_cpp import KEPT_IDLE_CONTEXTS, LlamaCppModel, llama_cpp_available
from tests.tiny_gguf import write_tiny_gguf
from tests.specs import spec_of

# the rounds' math from the first round (drafter_start="first"; the default join: test_drafter_join.py)
pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

if not llama_cpp_available() and torch.cuda.is_available():  # CUDA machines skip the llama.cpp build
    pytest.skip("llama-cpp-python is not built on CUDA machines", allow_module_level=True)

DOCUMENT = "\n\n".join(f"Paragraph {i}: the river town kept {i} boats and a lighthouse painted shade {i % 7}." for i in range(40))
QUESTION = "How many boats did the river town keep in paragraph 17?"
RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=300)


@pytest.fixture(scope="module")
def ggufs(tiny_model, other_tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {"self": str(write_tiny_gguf(tiny_model, folder / "self.gguf")),
            "random": str(write_tiny_gguf(other_tiny_model, folder / "other.gguf"))}


def llama_engine(target, gguf: str, **options) -> Rapid:
    return Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp", **options), target=target, drafter=gguf)


def test_the_drafter_runs_on_llama_cpp(tiny_model, ggufs):
    engine = llama_engine(tiny_model, ggufs["self"])
    assert engine.drafter_backend == "llama.cpp"
    assert "llama.cpp" in engine.drafter_label
    out = engine.generate(DOCUMENT, QUESTION, mode="ragsd", gamma=4, max_new_tokens=12)
    assert "llama.cpp" in out.stats.drafter and out.stats.drafted_tokens > 0


@pytest.mark.parametrize("mode", ["sd", "ragsd", "rapid", "magicdec"])
@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_greedy_eta_zero_equals_lc(tiny_model, ggufs, mode, drafter_kind):
    """Invariant 1 with q from llama.cpp: eta = 0 greedy reproduces target-only greedy."""
    lc = Rapid(spec_of(retrieval=RETRIEVAL),
               target=tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=40)
    out = llama_engine(tiny_model, ggufs[drafter_kind]).generate(
        DOCUMENT, QUESTION, mode=mode, eta=0.0, gamma=4, max_new_tokens=40
    )
    assert out.token_ids == lc.token_ids and out.text == lc.text
    assert out.stats.drafted_tokens > 0
    if drafter_kind == "self" and mode == "sd":
        assert out.stats.acceptance_rate > 0.9  # the same weights in float32: rounding may flip a near tie
    if drafter_kind == "random":
        assert out.stats.acceptance_rate < 0.5


def augmented(p: np.ndarray, q: np.ndarray, eta: float, alpha: float) -> np.ndarray:
    """p^ = softmax(log p + eta * 1[q >= alpha max q] * (q - p)), written independently of the library."""
    logits = np.log(p) + eta * np.where(q >= alpha * q.max(), q - p, 0.0)
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.parametrize("eta", [0.0, 2.0])
def test_first_tokens_follow_the_target_with_llama_cpp_q(tiny_model, ggufs, eta):
    """Invariants 2 and 3 with q from llama.cpp: the first token follows p (eta = 0) or p^ (eta > 0).

    4000 answers of 2 tokens, one draft per round (acceptance and the exact
    residual both occur: the drafter has other weights). At T = 0.05 the tiny
    models' logits give peaked, different p and q. Chi-square over the tokens
    whose expected count is at least 5 plus one bin for the rest; with a
    correct engine each case fails with probability 1e-4.
    """
    temperature, alpha, n = 0.05, 0.1, 4000
    # the target on the lean runtime (logits equal to transformers', test_lean_runtime.py): a quarter less per answer
    lean = replace(tiny_model, lean=LeanModel(tiny_model.model))
    engine = llama_engine(lean, ggufs["random"], reuse_document_cache=False)
    prompt = tuple(tiny_model.tokenizer("The lighthouse keeper wrote:")["input_ids"])
    prompts = PromptPair(prompt, prompt)
    config = DecodeConfig(mode="rapid" if eta else "ragsd", eta=eta, gamma=1, temperature=temperature,
                          max_new_tokens=2, draft_gate=alpha, ignore_eos=True)
    with torch.inference_mode():
        p = (tiny_model.model(torch.tensor([prompt])).logits[0, -1].float() / temperature).softmax(-1).double().numpy()
    context = LlamaCppModel(ggufs["random"]).new_context(64)
    q = (context.prefill(list(prompt))[0] / temperature).softmax(-1).double().numpy()
    expected = augmented(p, q, eta, alpha) * n
    generator = torch.Generator().manual_seed(5)
    counts = np.zeros_like(expected)
    rejected = 0
    for _ in range(n):
        out = last_output(engine.decode(prompts, config, generator=generator))
        counts[out.token_ids[0]] += 1
        rejected += out.stats.accepted_tokens < out.stats.drafted_tokens
    assert rejected > 100  # the residual was exercised
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    assert chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-4


def test_both_caches_hold_exactly_the_committed_tokens(tiny_model, ggufs):
    """Invariant 5: after every round the llama.cpp context's next logits equal a fresh context's."""
    fresh_model = LlamaCppModel(ggufs["random"])
    checked = []

    def observer(target_cache, target_seq, drafter_cache, drafter_seq):
        assert target_cache.token_ids == target_seq[: target_cache.length]
        assert drafter_cache.token_ids == drafter_seq[: drafter_cache.length]
        assert 1 <= len(drafter_seq) - drafter_cache.length <= 2
        held = drafter_cache.length
        live = drafter_cache.forward(drafter_seq[held:])[0]
        drafter_cache.crop(held)  # put it back as it was
        fresh = fresh_model.new_context(len(drafter_seq) + 8).prefill(drafter_seq)[0]
        torch.testing.assert_close(live, fresh, atol=1e-4, rtol=1e-4)
        checked.append(len(target_seq))

    out = llama_engine(tiny_model, ggufs["random"]).generate(
        DOCUMENT, QUESTION, mode="rapid", eta=2.0, gamma=3, temperature=1.0, seed=3, max_new_tokens=30,
        observer=observer, gamma_schedule="constant",  # every round drafts: the drafter lags 1-2 tokens
    )
    assert len(checked) == out.stats.rounds >= 5


def test_a_freed_context_is_kept_cleared_for_the_next_one_of_its_size(ggufs):
    """A freed context serves the model's next one of its size: it holds no token of before and its logits equal,
    exactly, those of a model that never kept one; the model keeps at most KEPT_IDLE_CONTEXTS, the newest."""
    model, never_kept = LlamaCppModel(ggufs["random"]), LlamaCppModel(ggufs["random"])
    first = model.new_context(64)
    first.prefill([t % 200 for t in range(40, 300)])
    handle = first._ctx
    del first
    again = model.new_context(64)
    assert again._ctx == handle and again.length == 0 and again.token_ids == []
    prompt = list(range(7, 90))  # ids inside the tiny vocabulary
    torch.testing.assert_close(again.prefill(prompt), never_kept.new_context(64).prefill(prompt), rtol=0, atol=0)
    assert model.new_context(64)._ctx != handle  # a context in use is not handed out twice
    many = [model.new_context(64) for _ in range(KEPT_IDLE_CONTEXTS + 2)]
    newest = [context._ctx for context in many[-KEPT_IDLE_CONTEXTS:]]
    while many:  # freed in the order they were made
        del many[0]
    assert [ctx for _, _, ctx in model._idle] == newest


def test_the_drafter_cache_is_kept_across_questions(tiny_model, ggufs):
    """A second question about the same document prefills only what its drafter prompt does not share."""
    engine = llama_engine(tiny_model, ggufs["self"])
    first = engine.generate(DOCUMENT, QUESTION, mode="sd", gamma=4, max_new_tokens=8)
    again = engine.generate(DOCUMENT, "What shade was the lighthouse of paragraph 3?", mode="sd", gamma=4, max_new_tokens=8)
    assert first.stats.drafter_prefill_reused_tokens == 0
    assert again.stats.drafter_prefill_reused_tokens > 1000  # the whole document is shared
    fresh = llama_engine(tiny_model, ggufs["self"]).generate(
        DOCUMENT, "What shade was the lighthouse of paragraph 3?", mode="sd", gamma=4, max_new_tokens=8
    )
    assert again.token_ids == fresh.token_ids


def test_a_different_vocabulary_is_refused_in_one_line(tiny_model, tmp_path):
    tokens = tiny_model.tokenizer.convert_ids_to_tokens(list(range(len(tiny_model.tokenizer))))
    tokens[10], tokens[11] = tokens[11], tokens[10]
    path = write_tiny_gguf(tiny_model, tmp_path / "swapped.gguf", tokens=tokens)
    with pytest.raises(RapidspecError, match="vocabulary differs from the target's at token 10"):
        llama_engine(tiny_model, str(path))


def test_auto_picks_llama_cpp_for_a_gguf_drafter_on_cpu(tiny_model, ggufs):
    assert choose_backend("auto", tiny_model, ggufs["self"]) == "llama.cpp"
    assert choose_backend("auto", tiny_model, None) == "torch"  # the tiny target has no GGUF file
    assert choose_backend("torch", tiny_model, ggufs["self"]) == "torch"
    with pytest.raises(RapidspecError, match="reads GGUF files"):
        choose_backend("llama.cpp", tiny_model, None)
    with pytest.raises(RapidspecError, match="drafter_backend must be one of"):
        choose_backend("vllm", tiny_model, None)


def test_a_request_may_ask_for_the_other_backend(tiny_model, other_tiny_model, ggufs):
    """A drafter loaded by torch from a GGUF file: llama.cpp reads the same file; each request may pick."""
    drafter = replace(other_tiny_model, source=ggufs["random"])
    engine = Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model, drafter=drafter)  # auto
    assert engine.drafter_backend == "llama.cpp"
    on_llama = engine.generate(DOCUMENT, QUESTION, mode="ragsd", gamma=4, max_new_tokens=16)
    on_torch = engine.generate(DOCUMENT, QUESTION, mode="ragsd", gamma=4, max_new_tokens=16, drafter_backend="torch")
    assert "llama.cpp" in on_llama.stats.drafter and "llama.cpp" not in on_torch.stats.drafter
    assert on_llama.token_ids == on_torch.token_ids  # greedy, eta = 0: both equal lc
    assert on_llama.stats.accepted_per_position == on_torch.stats.accepted_per_position  # same weights, same drafts


def test_bench_runs_the_llama_cpp_peer_and_lookup(tiny_model, ggufs):
    """`rapidspec bench --modes ...,llama.cpp,lookup`: plain decoding of the target's GGUF beside the engine's modes."""
    from rapidspec.bench import speed

    target = replace(tiny_model, source=ggufs["self"])  # the target "was read" from this GGUF file
    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=True), target=target)
    items = [speed.BenchItem(DOCUMENT, QUESTION)]
    config = DecodeConfig(max_new_tokens=12, ignore_eos=True)
    report = speed.run_benchmark(engine, items, ("lc", "rapid", "lookup", "llama.cpp"), config, repeats=2,
                                 share_prefill=True)
    rows = {r.label: r for r in report.results}
    assert set(rows) == {"lc", "rapid", "lookup", "llama.cpp"}
    peer = rows["llama.cpp"]
    assert peer.new_tokens == 12 and peer.decode_tokens_per_second > 0 and peer.target_prefill_seconds > 0
    assert peer.prompt_tokens_target == rows["lc"].prompt_tokens_target  # the same prompt tokens as lc
    assert "llama.cpp" in report.drafter
    assert report.to_dict()["results"][-1]["mode"] == "llama.cpp"


def test_the_peer_needs_a_gguf_target(tiny_model):
    from rapidspec.bench import speed

    engine = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=tiny_model)
    with pytest.raises(RapidspecError, match="runs the target's GGUF file"):
        speed.run_benchmark(engine, [speed.BenchItem(DOCUMENT, QUESTION)], ("lc", "llama.cpp"),
                            DecodeConfig(max_new_tokens=4), repeats=1)


def test_cli_refuses_llama_cpp_without_a_gguf_in_one_line(tiny_model_dir, tmp_path, capsys):
    from rapidspec.cli import main

    document = tmp_path / "doc.txt"
    document.write_text(DOCUMENT)
    code = main(["generate", "--document", str(document), "--question", QUESTION, "--target", str(tiny_model_dir),
                 "--drafter-backend", "llama.cpp", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "reads GGUF files" in err and "Traceback" not in err


def test_a_question_reuses_the_drafter_cache_of_an_earlier_one_not_only_the_last(tiny_model, ggufs):
    """Questions retrieving different chunks in turn: each comes back to the cache whose retrieved text it shares."""
    one_chunk = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=96)
    engine = Rapid(spec_of(retrieval=one_chunk, drafter_backend="llama.cpp"), target=tiny_model, drafter=ggufs["self"])
    other = "What shade was the lighthouse of paragraph 3?"
    config = DecodeConfig(mode="rapid", eta=1.0, gamma=4, max_new_tokens=8, drafter_start="first")
    first = engine.generate(DOCUMENT, QUESTION, config=config)
    engine.generate(DOCUMENT, other, config=config)
    again = engine.generate(DOCUMENT, QUESTION, config=config)
    prompt = engine.document_prompts(DOCUMENT, QUESTION, config).drafter_ids
    assert common_prefix_length(prompt, engine.document_prompts(DOCUMENT, other, config).drafter_ids) < len(prompt) / 2
    assert again.stats.drafter_prefill_reused_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids
    assert engine.drafting.pool("llama.cpp").kept == 2


@pytest.mark.parametrize("mode", ["ragsd", "rapid"])
def test_a_drafter_prefilling_beside_the_target_gives_the_same_answer(tiny_model, ggufs, mode):
    """drafter_prefill="beside": the llama.cpp drafter prefills on its own thread meanwhile; same tokens, both caches
    exact, and the drafter's cache is kept for the next question as after a prefill that waits."""
    after = llama_engine(tiny_model, ggufs["self"], drafter_prefill="after")
    beside = llama_engine(tiny_model, ggufs["self"], drafter_prefill="beside")
    config = DecodeConfig(mode=mode, eta=2.0 if mode == "rapid" else 0.0, gamma=4, max_new_tokens=24)
    expected = after.generate(DOCUMENT, QUESTION, config=config)
    got = beside.generate(DOCUMENT, QUESTION, config=config)
    assert got.token_ids == expected.token_ids and got.stats.drafter_prefill_beside
    assert not expected.stats.drafter_prefill_beside and got.stats.drafter_prefill_own_seconds > 0
    again = beside.generate(DOCUMENT, "What shade was the lighthouse of paragraph 3?", config=config)
    assert again.stats.drafter_prefill_reused_tokens > 0
    assert beside.drafting._beside.submit(torch.get_num_threads).result(timeout=30) == 1  # no torch team of its own


def test_auto_prefills_beside_only_with_cores_to_spare(tiny_model, ggufs, monkeypatch):
    import rapidspec.drafting.factory as factory

    engine = llama_engine(tiny_model, ggufs["self"], drafter_threads=2)
    rapid, lc = DecodeConfig(mode="rapid"), DecodeConfig(mode="lc")
    monkeypatch.setattr(factory, "spare_cores", lambda: 1)
    assert not engine.drafting.prefills_beside(rapid)
    monkeypatch.setattr(factory, "spare_cores", lambda: 2)
    assert engine.drafting.prefills_beside(rapid) and not engine.drafting.prefills_beside(lc)
    assert not engine.drafting.prefills_beside(DecodeConfig(mode="rapid", drafter_backend="torch"))
    assert not llama_engine(tiny_model, ggufs["self"], drafter_prefill="after").drafting.prefills_beside(rapid)
    with pytest.raises(RapidspecError, match="drafter_prefill must be one of auto, beside, after"):
        llama_engine(tiny_model, ggufs["self"], drafter_prefill="sometimes")


def test_a_stopped_prefill_gives_the_drafter_started_beside_back(tiny_model, ggufs):
    """A client leaving during the target's prefill: the drafter started beside it is waited for and kept."""
    engine = llama_engine(tiny_model, ggufs["self"], drafter_prefill="beside")
    config = DecodeConfig(mode="ragsd", gamma=4, max_new_tokens=8)
    prompts = engine.document_prompts(DOCUMENT, QUESTION, config)
    stream = engine.decode(prompts, config, yield_prefill_chunks=True)
    next(stream)  # the first prefill chunk
    stream.close()
    out = engine.generate(DOCUMENT, QUESTION, config=config)
    assert out.stats.drafter_prefill_reused_tokens > 0  # the drafter's cache came back to the pool
