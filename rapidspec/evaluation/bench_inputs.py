"""What ``rapidspec bench`` runs: modes, lengths, sweeps and the input documents.

Parsing and validation of the benchmark's inputs (user mistakes raise
:class:`RapidspecError`), kept apart from the timing harness in
:mod:`rapidspec.evaluation.speed`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rapidspec.config import MODES, DecodeConfig
from rapidspec.drafting import USES_DRAFTER
from rapidspec.errors import RapidspecError
from rapidspec.prompts import PromptTemplate, prompt_ids

HF_ASSISTED = "hf-assisted"
LLAMA_CPP = "llama.cpp"  # plain decoding of the target's GGUF on llama.cpp (rapidspec.evaluation.llama_peer)
PEER_MODES = (HF_ASSISTED, LLAMA_CPP)  # run outside the engine, no DecodeConfig
BENCH_MODES: tuple[str, ...] = (*MODES, *PEER_MODES)
DEFAULT_MODES: tuple[str, ...] = ("lc", "sd", "ragsd", "rapid", HF_ASSISTED)
MIN_LENGTH = 256
SWEEP_PARAMS = {"eta": float, "gamma": int, "draft_confidence": float}
# Characters of the first document used for the warm-up generations.
WARMUP_CHARS = 1500

@dataclass(frozen=True)
class BenchItem:
    """One input: a document and a question; ``length`` is the requested prompt length (0 = as given)."""

    document: str
    question: str
    length: int = 0


@dataclass(frozen=True)
class Sweep:
    """``--sweep eta=0,1,2``: run ``rapid`` once per value of ``param``."""

    param: str
    values: tuple[float | int, ...]


@dataclass(frozen=True)
class Variant:
    """One run per input, in ``bench`` (a column) and ``eval`` (a record key): a mode, its decode settings, its sweep point.

    ``config`` is None for the peers run outside the engine (hf-assisted,
    llama.cpp); ``sweep`` names the sweep point in eval records
    (``"eta=5"``); ``budget_tokens`` is the retrieval budget the point uses
    (None: the run's own).
    """

    label: str
    mode: str
    config: DecodeConfig | None = None
    sweep_value: float | int | None = None
    sweep: str | None = None
    budget_tokens: int | None = None

    @property
    def eta(self) -> float:
        """The eta the run uses (0 outside rapid), as recorded in keys."""
        return self.config.effective_eta if self.config is not None else 0.0

    @property
    def gamma(self) -> int | None:
        """The gamma the run drafts with, None for modes that do not draft."""
        return self.config.gamma if self.config is not None and self.mode in USES_DRAFTER else None


def parse_modes(text: str | Sequence[str], allowed: Sequence[str] = BENCH_MODES, lc_first: bool = True) -> tuple[str, ...]:
    """``"lc,sd,rapid"`` -> ("lc", "sd", "rapid"), repeats dropped, each in ``allowed``.

    ``lc_first`` puts ``lc`` first, adding it when missing (``bench``: speedups
    need it); ``eval`` keeps the order given.
    """
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not names:
        raise RapidspecError("no modes given")
    for name in names:
        if name not in allowed:
            raise RapidspecError(f"unknown mode {name!r}; choose from {', '.join(allowed)}")
    ordered = list(dict.fromkeys(names))
    if lc_first:
        ordered = ["lc"] + [m for m in ordered if m != "lc"]
    return tuple(ordered)


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


def parse_sweep(text: str, params: dict[str, type] = SWEEP_PARAMS) -> Sweep:
    """``"eta=0,1,2"`` -> Sweep("eta", (0.0, 1.0, 2.0)) for a name of ``params`` (name -> value type);
    integer values (``gamma``, token counts) are >= 1."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in params:
        raise RapidspecError(f"sweep must look like NAME=v1,v2,... with NAME one of {', '.join(params)}; got {text!r}")
    kind = params[name]
    try:
        parsed = tuple(kind(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise RapidspecError(f"sweep values of {name} must be {kind.__name__}s, got {values!r}") from None
    if not parsed:
        raise RapidspecError(f"sweep {name} has no values")
    if name == "eta" and any(not math.isfinite(v) or v < 0 for v in parsed):
        raise RapidspecError(f"eta values must be finite and >= 0, got {values!r}")
    if name == "draft_gate" and any(not 0 <= v <= 1 for v in parsed):
        raise RapidspecError(f"draft_gate values must be in [0, 1], got {values!r}")
    if name == "draft_confidence" and any(not 0 <= v < 1 for v in parsed):
        raise RapidspecError(f"draft_confidence values must be in [0, 1), got {values!r}")
    if kind is int and any(v < 1 for v in parsed):
        raise RapidspecError(f"{name} values must be >= 1, got {values!r}")
    return Sweep(name, parsed)


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
    from rapidspec.demo_document import demo_document

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
    """The columns to run: ``modes`` (``lc`` first), or ``lc`` plus ``rapid`` at each sweep value."""
    out = [Variant("lc", "lc", base.with_(mode="lc", eta=None))]
    if sweep is not None:
        for value in sweep.values:
            changes = {sweep.param: value}
            if sweep.param == "gamma":
                changes["max_gamma"] = max(base.max_gamma, int(value))
            config = base.with_(mode="rapid", **changes)
            out.append(Variant(f"rapid {sweep.param}={value:g}", "rapid", config, value))
        return out
    for mode in modes:
        if mode == "lc":
            continue
        if mode in PEER_MODES:
            out.append(Variant(mode, mode))
        else:
            out.append(Variant(mode, mode, base.with_(mode=mode, eta=base.eta if mode == "rapid" else None)))
    return out


# ------------------------------------------------------------------ results
