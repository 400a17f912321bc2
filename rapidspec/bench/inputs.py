"""What ``rapidspec bench`` runs: modes, lengths, sweeps and the input documents.

Parsing and validation of the benchmark's inputs (user mistakes raise
:class:`RapidspecError`), kept apart from the timing harness in
:mod:`rapidspec.bench.speed`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rapidspec.config import MODES, DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.evaluation.variants import Sweep, Variant, run_matrix
from rapidspec.evaluation.variants import parse_modes as parse_mode_list
from rapidspec.evaluation.variants import parse_sweep as parse_knob_sweep
from rapidspec.prompting.prompts import PromptTemplate, prompt_ids

HF_ASSISTED = "hf-assisted"
LLAMA_CPP = "llama.cpp"  # plain decoding of the target's GGUF on llama.cpp (rapidspec.bench.llama_peer)
PEER_MODES = (HF_ASSISTED, LLAMA_CPP)  # run outside the engine, no DecodeConfig
BENCH_MODES: tuple[str, ...] = (*MODES, *PEER_MODES)
DEFAULT_MODES: tuple[str, ...] = ("lc", "sd", "ragsd", "rapid", HF_ASSISTED)
MIN_LENGTH = 256
#: Knobs ``bench --sweep`` takes (``rapid`` runs once per value).
SWEEP_PARAMS = {"eta": float, "gamma": int, "draft_confidence": float}
# Characters of the first document used for the warm-up generations.
WARMUP_CHARS = 1500

@dataclass(frozen=True)
class BenchItem:
    """One input: a document and a question; ``length`` is the requested prompt length (0 = as given)."""

    document: str
    question: str
    length: int = 0


def positive_ints(text: str) -> list[int]:
    """An ``argparse`` type: positive integers separated by commas (``1,2,4,8``), as the benchmarks take them."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_lengths(text: str | Sequence[int], max_context: int) -> tuple[int, ...]:
    """``"1024,2048"`` -> (1024, 2048), each in [MIN_LENGTH, max_context]."""
    try:
        values = [int(v) for v in (text.split(",") if isinstance(text, str) else text) if str(v).strip()]
    except ValueError:
        raise RapidspecError(f"lengths must be comma-separated integers, got {text!r}") from None
    if not values:
        raise RapidspecError("no lengths given")
    for value in values:
        if value < MIN_LENGTH:
            raise RapidspecError(f"length {value} is below the minimum of {MIN_LENGTH} tokens")
        if value > max_context:
            raise RapidspecError(f"length {value} is above the model's window of {max_context} tokens")
    return tuple(dict.fromkeys(values))


def load_items(path: str | Path) -> list[BenchItem]:
    """Records ``{"document": ..., "question": ...}`` from a JSON list or a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise RapidspecError(f"data file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        stripped = text.lstrip()
        if stripped.startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise RapidspecError(f"{path}: not JSON or JSONL ({err})") from None
    items = []
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict) or not record.get("document") or not record.get("question"):
            raise RapidspecError(f"{path}: record {number} needs non-empty 'document' and 'question'")
        items.append(BenchItem(str(record["document"]), str(record["question"])))
    if not items:
        raise RapidspecError(f"{path}: no records")
    return items


def demo_items(tokenizer, lengths: Sequence[int], max_context: int, max_new_tokens: int) -> list[BenchItem]:
    """The demo document family at each length, sized so the target prompt is about ``length`` tokens.

    The prompt must leave room for the answer, so a length near the window is
    capped at ``max_context - max_new_tokens`` (the table shows real counts).
    """
    from rapidspec.prompting.demo_document import demo_document

    probe = demo_document(target_tokens=256, tokenizer=tokenizer)
    overhead = len(prompt_ids(tokenizer, PromptTemplate(), "", probe.question, retrieved=False))
    items = []
    for length in lengths:
        # 16 tokens of slack: fit_document keeps a margin of 8 and token counts shift at seams.
        prompt_budget = min(length, max_context - max_new_tokens - 16)
        document_tokens = prompt_budget - overhead
        if document_tokens < 200:
            raise RapidspecError(
                f"length {length} leaves {document_tokens} document tokens after the prompt and "
                f"{max_new_tokens} new tokens; use a longer length or fewer --max-new-tokens"
            )
        item = demo_document(target_tokens=document_tokens, tokenizer=tokenizer)
        items.append(BenchItem(item.document, item.question, length))
    return items


def variants(modes: Sequence[str], base: DecodeConfig, sweep: Sweep | None = None) -> list[Variant]:
    """The columns to run: ``modes`` (``lc`` first), or ``lc`` plus ``rapid`` at each sweep value (evaluation's run matrix)."""
    return run_matrix(("lc", "rapid") if sweep is not None else modes, base, sweep, peer_modes=PEER_MODES)


def parse_modes(text: str | Sequence[str], allowed: Sequence[str] = BENCH_MODES, lc_first: bool = True) -> tuple[str, ...]:
    """``"lc,sd,rapid"`` -> ("lc", "rapid", "sd") for ``bench`` (:func:`rapidspec.evaluation.variants.parse_modes`)."""
    return parse_mode_list(text, allowed, lc_first)


def parse_sweep(text: str, params: dict[str, type] = SWEEP_PARAMS) -> Sweep:
    """``"eta=0,1,2"`` -> a :class:`Sweep` over one of bench's knobs (:data:`SWEEP_PARAMS`)."""
    return parse_knob_sweep(text, params)


# ------------------------------------------------------------------ results
