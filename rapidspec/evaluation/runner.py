"""The evaluation loop: every item under every mode, resumable, with a summary.

Contract:

* Order: item by item (items come document by document), and for each item
  mode by mode, so that the target's document cache built by the first mode
  serves the next modes and the next questions on the same document.
* Results file (JSON lines): one record per (item, run), appended and flushed
  as soon as it is scored. A record's key is (item id, mode, eta, gamma,
  sweep point), with eta the effective one (0 outside ``rapid``), gamma
  ``None`` for modes that do not draft (so changing gamma does not rerun
  ``lc``) and the sweep point (``"budget_tokens=512"``, :mod:`.variants`) or
  None. A rerun with the same
  file skips every key already there: nothing is lost or repeated. A partial
  last line (a run killed mid-write) is dropped on resume. Every record holds
  the run's ``config`` (:func:`~rapidspec.evaluation.run_config.run_config`:
  target and drafter with dtype, quantization, runtime and device, the
  drafter backend, data, retrieval and every decode knob); a file written
  under another config is refused with one line naming what differs, unless
  ``overwrite`` (which starts the file afresh).
* Summary: one row per (task group, mode, eta, gamma, sweep point) over the records of the
  current selection: n, the headline metric's mean with a seeded percentile
  bootstrap 95% interval (1000 resamples), secondary metrics, and the mean
  speed statistics of the same runs.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rapidspec.config import MAX_TOP_LOGPROBS, MODES, DecodeConfig
from rapidspec.config import MODE_TABLE
from rapidspec.engine.defaults import resolve
from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import EvalItem
from rapidspec.evaluation.item_runner import DRAFTER_ROW, ItemRunner, RunOptions
from rapidspec.evaluation.judge import JUDGED_TASK_TYPES
from rapidspec.evaluation.metrics import HEADLINE, bootstrap_ci
from rapidspec.evaluation.run_config import separate_drafter
from rapidspec.evaluation.variants import Sweep, Variant, run_matrix

DEFAULT_MODES = ("lc", "rag", "rapid")
SPEED_FIELDS = ("decode_tokens_per_second", "acceptance_rate", "mean_accepted_length", "target_prefill_seconds")


def record_key(item_id: str, mode: str, eta: float, gamma: int | None, sweep: str | None = None) -> tuple:
    return (item_id, mode, round(float(eta), 6), gamma, sweep)


def key_of(record: dict) -> tuple:
    """The key of a stored record (records written before sweeps have no ``sweep``)."""
    return record_key(record["id"], record["mode"], record["eta"], record["gamma"], record.get("sweep"))


def read_records(path: Path) -> tuple[list[dict], int]:
    """The records of a results file and the bytes its complete lines take.

    A last line without its newline (a run killed mid-write) is not read.
    """
    raw = path.read_bytes()
    complete = raw.rfind(b"\n") + 1 if raw and not raw.endswith(b"\n") else len(raw)
    records = []
    for number, line in enumerate(raw[:complete].decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise RapidspecError(f"{path} line {number} is not JSON") from None
    return records, complete


def config_differences(stored: dict, current: dict, prefix: str = "") -> list[str]:
    """``"target.dtype: bfloat16 -> float32"`` for each leaf that differs between two configurations."""
    out = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_differences(old, new, f"{prefix}{key}.")
        elif old != new:
            out.append(f"{prefix}{key}: {json.dumps(old)} -> {json.dumps(new)}")
    return out


class ResultsFile:
    """An append-only JSON-lines file of records, read back on resume."""

    def __init__(self, path: str | Path | None, config: dict, overwrite: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.config = config
        self.records: list[dict] = []
        if self.path is None:
            return
        if self.path.exists() and not overwrite:
            self.records = self._load()
            for record in self.records:
                if record.get("config") != config:
                    changes = "; ".join(config_differences(record.get("config") or {}, config)[:4])
                    raise RapidspecError(
                        f"{self.path} holds results of another configuration ({changes}); "
                        "use another --results file or --overwrite"
                    )
        else:
            if self.path.parent and not self.path.parent.exists():
                self.path.parent.mkdir(parents=True)
            self.path.write_text("", encoding="utf-8")

    def _load(self) -> list[dict]:
        try:
            records, complete = read_records(self.path)
        except RapidspecError as err:
            raise RapidspecError(f"{err}; fix it or use --overwrite") from None
        if complete < self.path.stat().st_size:
            # A run killed mid-write leaves a partial last line: drop it so that appends stay line-aligned.
            with open(self.path, "r+b") as handle:
                handle.truncate(complete)
        return records

    def keys(self) -> set[tuple]:
        return {key_of(r) for r in self.records}

    def append(self, record: dict) -> None:
        self.records.append(record)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


@dataclass
class SummaryRow:
    group: str
    mode: str
    eta: float
    gamma: int | None
    sweep: str | None
    n: int
    metric: str
    mean: float
    ci_low: float
    ci_high: float
    extra: dict = field(default_factory=dict)  # secondary metric means (em, unanswered)
    speed: dict = field(default_factory=dict)  # mean of SPEED_FIELDS over records that have them

    def to_dict(self) -> dict:
        return {
            "group": self.group, "mode": self.mode, "eta": self.eta, "gamma": self.gamma, "sweep": self.sweep, "n": self.n,
            "metric": self.metric, "mean": self.mean, "ci95": [self.ci_low, self.ci_high], **self.extra, **self.speed,
        }


def _mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def summarize(records: Sequence[dict], seed: int = 0, resamples: int = 1000) -> list[SummaryRow]:
    """One row per (group, mode, eta, gamma, sweep point), in first-seen order."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        cells[(record["group"], record["mode"], record["eta"], record["gamma"], record.get("sweep"))].append(record)
    rows = []
    for (group, mode, eta, gamma, sweep), cell in cells.items():
        task_type = cell[0]["task_type"]
        mean, low, high = bootstrap_ci([r["score"] for r in cell], resamples=resamples, seed=seed)
        extra = {}
        if task_type in ("qa", "needle"):
            extra["em"] = _mean([r["metrics"].get("em") for r in cell])
        if task_type == "mc":
            extra["unanswered"] = sum(r["metrics"].get("extracted") is None for r in cell)
        judged = [r["metrics"] for r in cell if "judge" in r["metrics"]]
        if judged:  # a local judge's 1-10 ratings: not comparable with GPT-4's
            extra["judge"] = judged[0]["judge"]
            extra["judge_rating"] = _mean([m.get("judge_rating") for m in judged])
            extra["judge_unrated"] = sum(m.get("judge_rating") is None for m in judged)
        speed = {name: _mean([r["stats"].get(name) for r in cell]) for name in SPEED_FIELDS}
        metric = cell[0]["metrics"].get("metric", HEADLINE[task_type])  # records before scorer names: the key
        rows.append(SummaryRow(group, mode, eta, gamma, sweep, len(cell), metric, mean, low, high, extra, speed))
    return rows


@dataclass
class EvalRun:
    """What :func:`run_eval` did: the records of this selection and their summary."""

    records: list[dict]
    summary: list[SummaryRow]
    new_records: int
    skipped: int


def run_eval(items: Sequence[EvalItem], target, *, drafter=None, spec=None, retrieval=None,
             modes: Sequence[str] = DEFAULT_MODES, eta: float | None = None, gamma: int = 6,
             max_new_tokens: int | None = None, temperature: float = 0.0, seed: int = 0,
             results: str | Path | None = None, overwrite: bool = False, data_label: str = "",
             decode_options: dict | None = None, sweep: Sweep | None = None, retrieve_from: str | None = None,
             other_items: Sequence[EvalItem] | None = None, on_record: Callable[[dict], None] | None = None,
             progress: bool = True, prefill_progress: Callable[[int, int], None] | None = None, judge=None,
             workers=None, logprobs: int = 0) -> EvalRun:
    """Run every item under every mode (and sweep point, :mod:`.variants`) and score it.

    ``target`` and ``drafter`` are :class:`rapidspec.models.LoadedModel` objects (or anything
    :class:`rapidspec.Rapid` accepts), loaded from ``spec`` (an :class:`~rapidspec.engine.spec.EngineSpec`; its
    drafter options and retrieval build the engine; None: the defaults); ``retrieval``, a
    :class:`rapidspec.retrieval.RetrievalConfig`, replaces the spec's. ``max_new_tokens=None`` uses
    :data:`DEFAULT_MAX_NEW_TOKENS` per task type. ``retrieve_from``: None (each item's own document),
    ``"other-item"`` (the next item's document with other text among ``other_items``, default ``items``:
    unrelated retrieval, the paper's Table 3) or the path of a text file to retrieve from for every item.
    ``on_record`` is called after each record is written (tests use it to simulate an interruption).
    ``judge``: a :class:`~rapidspec.evaluation.judge.Judge` that rates open answers (``qa``, ``summary``) into
    ``metrics`` (``judge``, ``judge_rating``). ``workers``: a :class:`~rapidspec.scale.eval_workers.RayWorkers`
    that answers the items on Ray actors with engines of their own, built from the spec they were given
    (``target``, ``drafter`` and ``spec`` are then unused); the judge and the results file stay here.
    ``logprobs``: K > 0 stores in each record the top-K log-probabilities of its first answer tokens under the
    lc, rag and drafter views (:mod:`~rapidspec.evaluation.logprob_views`). When the drafter is another model
    than the target and a mode drafts from retrieved text, each item also gets a record of mode ``drafter``:
    the drafter's own answer on the retrieved text (rag with the drafter's weights). Drafting modes prepare
    their drafter before the first round and draft ``gamma`` a round (``drafter_start="first"``,
    ``gamma_schedule="constant"``: the paper's setting) unless ``decode_options`` say otherwise.
    """
    from rapidspec.engine.spec import EngineSpec

    modes = tuple(modes)
    _check(items, modes, logprobs)
    spec = spec or EngineSpec()
    if retrieval is not None:
        spec = replace(spec, retrieval=retrieval)
    base = DecodeConfig(**{"mode": "rapid", "eta": eta, "gamma": gamma, "max_gamma": max(gamma, DecodeConfig.max_gamma),
                           "temperature": temperature, "seed": seed, "drafter_start": "first",
                           "gamma_schedule": "constant", **(decode_options or {})})
    corpora = retrieval_corpora(items, retrieve_from, other_items)
    options = RunOptions(base, max_new_tokens, data_label, retrieve_from, corpora, logprobs)
    runner = ItemRunner(spec, target, drafter, options, prefill_progress) if workers is None else workers.start(options)
    config = dict(runner.config)
    if sweep is None or sweep.param != "eta":  # the eta default of the drafter's relation, as the engine decides it
        base = resolve(base, config["drafter_relation"])[0]
    if judge is not None:
        config["judge"] = judge.name
    store = ResultsFile(results, config, overwrite=overwrite)
    done = store.keys()
    variants = run_matrix(modes, base, sweep)
    if separate_drafter(config) and any(MODE_TABLE[m].drafter_reads == "retrieved" and MODE_TABLE[m].drafter_kind == "model"
                                        for m in modes):
        variants.append(Variant(DRAFTER_ROW, DRAFTER_ROW, base.with_mode("rag")))
    wanted = [(item, variant) for item in items for variant in variants]
    pending = [(item, v) for item, v in wanted if record_key(item.id, v.mode, v.eta, v.gamma, v.sweep) not in done]
    _write_records(runner.run_all(pending), store, config, judge, on_record,
                   _bar(len(wanted), len(pending)) if progress and pending else None)
    wanted_keys = {record_key(item.id, v.mode, v.eta, v.gamma, v.sweep) for item, v in wanted}
    selected = [r for r in store.records if key_of(r) in wanted_keys]
    return EvalRun(selected, summarize(selected, seed=seed), new_records=len(pending), skipped=len(wanted) - len(pending))


def _check(items: Sequence[EvalItem], modes: Sequence[str], logprobs: int) -> None:
    """A RapidspecError for an unknown mode, no items, repeated item ids or a log-probability count out of range."""
    for mode in modes:
        if mode not in MODES:
            raise RapidspecError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if not items:
        raise RapidspecError("no items to evaluate")
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise RapidspecError("item ids are not unique")
    if logprobs < 0 or logprobs > MAX_TOP_LOGPROBS:
        raise RapidspecError(f"--logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    if logprobs and any(item.messages for item in items):
        raise RapidspecError("--logprobs applies to questions about documents, not to chat-form items")


def _bar(total: int, pending: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=total - pending, desc="eval", unit="run", dynamic_ncols=True)


def _write_records(answered, store: "ResultsFile", config: dict, judge, on_record, bar) -> None:
    """Rate (``judge``), store and report each answered (item, record) as it comes."""
    try:
        for item, record in answered:
            if judge is not None and item.task_type in JUDGED_TASK_TYPES:
                record["metrics"].update(judge.rate(item.question, record["prediction"], item.answers))
            record["config"] = config
            store.append(record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{item.group} {record['mode']} {record['sweep'] or ''}".rstrip(), refresh=False)
            if on_record is not None:
                on_record(record)
    finally:
        if bar is not None:
            bar.close()


def retrieval_corpora(
    items: Sequence[EvalItem], retrieve_from: str | None, other_items: Sequence[EvalItem] | None = None
) -> dict[str, str]:
    """Item id -> the text its retrieval reads instead of its document (empty: each reads its own).

    ``"other-item"``: the next document after the item's own among the
    distinct documents of ``other_items`` (default ``items``), cyclically.
    """
    if retrieve_from is None:
        return {}
    if any(item.messages for item in items):
        raise RapidspecError("--retrieve-from applies to questions about documents, not to chat-form items")
    if retrieve_from != "other-item":
        from rapidspec.prompting.textio import read_text

        text = read_text(retrieve_from)
        if not text.strip():
            raise RapidspecError(f"the retrieval corpus {retrieve_from} is empty")
        return {item.id: text for item in items}
    documents = list(dict.fromkeys(item.document for item in (*(other_items or ()), *items)))
    if len(documents) < 2:
        raise RapidspecError("retrieving from another item needs items with at least two different documents")
    position = {document: index for index, document in enumerate(documents)}
    return {item.id: documents[(position[item.document] + 1) % len(documents)] for item in items}
