"""RAPID's vLLM proposer without vLLM: its prompt reading, options, step costs, and the calls vLLM makes.

vLLM's own runs are in tests/test_vllm_offline.py (slow; they need `make vllm`).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import Message, render, with_documents
from rapidspec.vllm.costs import DecayedLine, StepClock
from rapidspec.vllm.options import ENV_VARIABLE, ProposerOptions
from rapidspec.vllm.prompt_reading import ChatLayout, read_prompt
from rapidspec.vllm.proposer import RapidProposer

CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a model.<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCUMENT = "\n\n".join(f"Section {i}. The keeper of gate {i} is named Ana{i} and guards {i * 7} sheep."
                       for i in range(40))


@pytest.fixture(scope="module")
def chat_tokenizer(byte_tokenizer):
    tokenizer = copy.deepcopy(byte_tokenizer)
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.mark.parametrize("messages, documents", [
    ([Message("user", "Who keeps gate 3?")], ()),
    ([Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello."),
      Message("user", "Who keeps gate 3?")], ()),
    ([Message("user", "Who keeps gate 3?")], (DOCUMENT,)),
    ([Message("system", "Be brief."), Message("user", "Who keeps gate 3?")], ("One.", "Two.")),
])
def test_a_rendered_chat_reads_back_as_its_messages_and_documents(chat_tokenizer, messages, documents):
    layout = ChatLayout.learn(chat_tokenizer)
    ids = render(chat_tokenizer, with_documents(messages, documents) if documents else messages)
    read = read_prompt(chat_tokenizer, layout, ids)
    assert not read.raw
    if documents:
        assert read.documents == ("\n\n".join(documents),)
        assert render(chat_tokenizer, with_documents(list(read.messages), read.documents)) == ids
    else:
        assert read.documents == ()
        assert render(chat_tokenizer, list(read.messages)) == ids
    assert read.messages[-1] == Message("user", "Who keeps gate 3?")


def test_a_prompt_that_does_not_render_back_is_read_as_raw_text(chat_tokenizer, byte_tokenizer):
    text = "A pasted text.\n\nWho keeps gate 3?"
    layout = ChatLayout.learn(chat_tokenizer)
    read = read_prompt(chat_tokenizer, layout, chat_tokenizer(text)["input_ids"])
    assert read.raw and read.messages == (Message("user", text),)
    assert ChatLayout.learn(byte_tokenizer) is None  # no chat template
    assert read_prompt(byte_tokenizer, None, byte_tokenizer(text)["input_ids"]).raw


def test_options_from_json_are_checked():
    assert ProposerOptions.from_json(None) == ProposerOptions()
    options = ProposerOptions.from_json('{"drafter": "builtin", "retrieval": {"budget_tokens": 512}}')
    assert options.drafter == "builtin" and options.retrieval.budget_tokens == 512
    for text, word in [("{", "not JSON"), ("[]", "JSON object"), ('{"eta": 1}', "'eta'"),
                       ('{"retrieval": {"budget": 1}}', "'budget'"), ('{"schedule": "fast"}', "schedule"),
                       ('{"drafter_threads": 0}', "drafter_threads"), ('{"drafter_backend": "vllm"}', "backend"),
                       ('{"prepare": "later"}', "prepare")]:
        with pytest.raises(RapidspecError, match=word):
            ProposerOptions.from_json(text)


def test_the_step_cost_line_fits_base_and_slope():
    line = DecayedLine()
    for n in (1, 2, 4, 8, 1, 3):
        line.add(n, 0.5 + 0.25 * n)
    base, slope = line.fit()
    assert base == pytest.approx(0.5) and slope == pytest.approx(0.25)
    flat = DecayedLine()
    for _ in range(3):
        flat.add(5, 2.0)
    assert flat.fit() == pytest.approx((2.0, 0.0))  # one x only: no slope
    assert StepClock().costs().draft_step == 0.0  # nothing measured: drafting is free


def test_steps_with_and_without_drafts_are_measured_apart(monkeypatch):
    clock, now = StepClock(), [0.0]
    monkeypatch.setattr("rapidspec.vllm.costs.time.perf_counter", lambda: now[0])
    for drafts, seconds in [(False, 0.1), (True, 0.3), (False, 0.1), (True, 0.3)]:
        clock.step_ended(7 if drafts else 1, drafts)
        now[0] += seconds
        clock.step_started()
    assert clock.plain_step() == pytest.approx(0.1)
    assert clock.costs().verify(7) == pytest.approx(0.3)


class CountingDrafter:
    """A drafter that proposes ``k`` copies of token 1 and counts its calls."""

    def __init__(self) -> None:
        self.calls, self.sequence = 0, [0]

    def commit(self, emitted):
        self.sequence += emitted

    def propose(self, k, config, generator, stop_tokens):
        from rapidspec.drafting.drafter import Proposal

        self.calls += 1
        return Proposal([1] * k, None, k)


@pytest.mark.parametrize("plain_step, drafts", [(0.05, 0), (0.5, 4), (None, 4)])
def test_a_round_is_dropped_where_a_plain_step_gives_more(plain_step, drafts):
    """Acceptance near the prior (0.5), drafting free, a 4-draft round verified in 0.2 s: about 1.9 tokens a
    round, 9.7 a second; a plain step of 0.05 s gives 20 (no drafts), of 0.5 s 2 (draft); unmeasured: draft."""
    from rapidspec.drafting.gamma_schedule import CostSchedule, StepCosts
    from rapidspec.vllm.requests import RequestDrafts

    costs = StepCosts(0.0, 0.2, 0.0)
    drafter = CountingDrafter()
    request = RequestDrafts(np.array([5, 6, 7]), 2, drafter, CostSchedule(4, 4, 0.0, costs))
    request.schedule.rounds = 1  # past the first round, which always drafts
    proposal = request.propose(4, None, None, frozenset(), costs, plain_step)
    assert len(proposal.tokens) == drafts and drafter.calls == (1 if drafts else 0)


def greedy(model, ids: list[int], count: int) -> list[int]:
    """Up to ``count`` greedy tokens after ``ids``, each from a forward over the whole sequence (no cache); none
    after an EOS (nothing follows it)."""
    out = []
    for _ in range(count):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] == model.generation_config.eos_token_id:
            break
    return out


def new_proposer(folder, tokenizer, monkeypatch, prepare: str) -> RapidProposer:
    monkeypatch.setenv(ENV_VARIABLE, json.dumps({"drafter_backend": "torch", "schedule": "constant", "prepare": prepare,
                                                 "retrieval": {"method": "bm25", "chunk_tokens": 128, "budget_tokens": 512}}))
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=4096, model=str(folder), tokenizer=str(folder),
                                     get_vocab_size=lambda: len(tokenizer)),
        device_config=SimpleNamespace(device=torch.device("cpu")))
    return RapidProposer(config)


@pytest.fixture
def proposer(tiny_model_dir, tiny_model, monkeypatch):
    return new_proposer(tiny_model_dir, tiny_model.tokenizer, monkeypatch, "inline")


def one_row(tokens: list[int], sampled: int) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """vLLM's arguments for one running request."""
    return [[sampled]], np.array([len(tokens)]), np.array([tokens], dtype=np.int64)


def test_the_proposer_follows_requests_across_reordered_steps(proposer, tiny_model):
    """Two requests, rows swapped every step, vLLM keeping some drafts and not others: each request's drafts
    are always its drafter's greedy continuation of the drafter's prompt plus the answer vLLM accepted; a
    request whose prompt vLLM still reads gets its drafter and no drafts; a request missing from a step is let
    go."""
    tokenizer = tiny_model.tokenizer
    prompts = [tokenizer(DOCUMENT + f"\n\nWho keeps gate {g}?")["input_ids"] for g in (3, 17)]
    answers = [[65], [66]]  # the first sampled token of each
    rng = np.random.default_rng(0)
    width = max(map(len, prompts)) + 64
    model = proposer.pool.loaded.model
    for step in range(8):
        order = [0, 1] if step % 2 == 0 else [1, 0]
        rows = np.zeros((3, width), dtype=np.int64)
        lengths = np.zeros(3, dtype=np.int64)
        for row, which in enumerate(order):
            tokens = prompts[which] + answers[which]
            rows[row, : len(tokens)], lengths[row] = tokens, len(tokens)
        rows[2, :10], lengths[2] = np.arange(10), 10  # a third request still in its prefill
        sampled = [[answers[which][-1]] for which in order] + [[]]
        drafts = proposer.propose(sampled, lengths, rows)
        assert drafts[2] == [] and len(proposer.requests) == 3  # the third is prepared while vLLM reads its prompt
        for row, which in enumerate(order):
            request = proposer.requests.match(rows[row, : lengths[row]], set())
            assert request.drafter.sequence[-len(answers[which]):] == answers[which]
            assert len(request.drafter.sequence) < len(prompts[which])  # the drafter reads retrieved text
            assert drafts[row] == greedy(model, request.drafter.sequence, 3)
            kept = int(rng.integers(0, 4))  # vLLM keeps some drafts, then samples one more token
            answers[which] += drafts[row][:kept] + [int(rng.integers(60, 90))]
    proposer.propose(*one_row(prompts[1] + answers[1], answers[1][-1]))
    assert len(proposer.requests) == 1 and proposer.totals["finished"] == 2
    assert proposer.totals["drafted"] > 0


def test_a_drafter_prepared_beside_joins_once_ready(tiny_model_dir, tiny_model, monkeypatch):
    """By default a new request's retrieval and drafter prefill run beside vLLM's steps: no drafts until they
    are done, then drafts after the answer so far, as when prepared inline."""
    proposer = new_proposer(tiny_model_dir, tiny_model.tokenizer, monkeypatch, "beside")
    prompt = tiny_model.tokenizer(DOCUMENT + "\n\nWho keeps gate 5?")["input_ids"]
    answer = [65]
    assert proposer.propose(*one_row(prompt + answer, 65)) == [[]]
    request = proposer.requests.match(np.array(prompt + answer), set())
    request.preparing.result(timeout=60)
    answer.append(70)  # vLLM's next token, from a step without drafts
    drafts = proposer.propose(*one_row(prompt + answer, 70))[0]
    assert request.drafter.sequence[-2:] == answer
    assert drafts == greedy(proposer.pool.loaded.model, request.drafter.sequence, 3)


def test_a_missing_vllm_is_one_line(monkeypatch, tmp_path):
    from rapidspec.vllm.environment import require_vllm_python

    monkeypatch.setenv("RAPIDSPEC_VLLM_PYTHON", str(tmp_path / "none"))
    with pytest.raises(RapidspecError, match="make vllm"):
        require_vllm_python()


def test_vllm_processes_get_a_small_kv_cache_and_intel_openmp(monkeypatch, tmp_path):
    from rapidspec.vllm.environment import vllm_env

    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    monkeypatch.setenv("RAPIDSPEC_VLLM_PYTHON", str(tmp_path / "bin" / "python"))
    env = vllm_env({"LD_PRELOAD": "/x/libtcmalloc.so"})
    assert env["LD_PRELOAD"] == f"{tmp_path / 'lib' / 'libiomp5.so'}:/x/libtcmalloc.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # vLLM would keep one core of two for its scheduler
    mine = {"VLLM_CPU_KVCACHE_SPACE": "9", "LD_PRELOAD": "/y/libiomp5.so", "VLLM_CPU_OMP_THREADS_BIND": "0",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert vllm_env(mine) == mine
