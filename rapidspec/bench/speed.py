"""Speed harness behind ``rapidspec bench``.

Contract:

* Every mode decodes the same (document, question) pairs in the same process;
  speedups are ratios against ``lc`` of the same run and the same input
  (``lc`` is always run, first in each round).
* One warm-up generation per mode on a short document, then ``repeats``
  timed rounds; within a round the modes run one after another, so slow drift
  of a shared machine hits every mode alike. Reported numbers are medians over
  the rounds (``time.perf_counter``; the engine synchronises GPUs).
* The engine must be built with ``reuse_document_cache=False``: otherwise a
  later mode reuses an earlier mode's prefill of the same document. The one
  exception is ``share_prefill=True`` (``--share-prefill``), which does that
  on purpose and credits every run with the one measured prefill.
* Answers have a fixed length when ``ignore_eos`` is set (the CLI default).
* ``hf-assisted`` is transformers' own ``model.generate(..., assistant_model=
  drafter)`` on the full prompt with the assistant's default settings (what a
  user gets). Its prefill is timed as a separate ``max_new_tokens=1`` call
  (target prefill and the first token; the assistant is not run by that call)
  and its decode time is ``full call - that call`` for ``new_tokens - 1``
  tokens. The assistant's own prefill of the full prompt therefore falls in
  decode time: that is where transformers pays it. Acceptance counters are
  not exposed by transformers and are reported as missing.
* ``llama.cpp`` is plain greedy decoding of the target's GGUF file on
  llama.cpp (:mod:`rapidspec.bench.llama_peer`), the peer a CPU user
  would pick, on the same prompt tokens as ``lc``.

Pure library: no printing; progress goes to an optional callback.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from rapidspec.config import MODES, TARGET_READS_RETRIEVED, USES_DRAFTER, DecodeConfig

from rapidspec.bench.memory import GIB, PeakMemory
from rapidspec.bench.results import BenchReport, Measurement, Result
from rapidspec.engine.rounds import sync
from rapidspec.errors import RapidspecError
from rapidspec.prompting.prompts import prompt_ids
from rapidspec.bench.inputs import (  # noqa: F401  (re-exported)
    HF_ASSISTED,
    LLAMA_CPP,
    BENCH_MODES,
    DEFAULT_MODES,
    MIN_LENGTH,
    SWEEP_PARAMS,
    WARMUP_CHARS,
    BenchItem,
    Sweep,
    Variant,
    parse_modes,
    parse_lengths,
    parse_sweep,
    load_items,
    demo_items,
    variants,
)

# ------------------------------------------------------------------ running


# Engine modes whose target reads the whole document (their prefill can be shared).
FULL_CONTEXT_MODES = tuple(m for m in MODES if m not in TARGET_READS_RETRIEVED)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _engine_measurement(engine, item: BenchItem, config: DecodeConfig, profile: bool, prefill_progress=None) -> Measurement:
    out = engine.generate(item.document, item.question, config=config, profile=profile, prefill_progress=prefill_progress)
    s = out.stats
    return Measurement(
        token_ids=tuple(out.token_ids),
        text=out.text,
        prompt_tokens_target=s.prompt_tokens_target,
        prompt_tokens_drafter=s.prompt_tokens_drafter,
        retrieval_seconds=s.retrieval_seconds,
        target_prefill_seconds=s.target_prefill_seconds,
        drafter_prefill_seconds=s.drafter_prefill_seconds if config.mode in USES_DRAFTER else None,
        decode_seconds=s.decode_seconds,
        total_seconds=s.total_seconds,
        new_tokens=s.new_tokens,
        decode_tokens_per_second=s.decode_tokens_per_second,
        rounds=s.rounds,
        drafted_tokens=s.drafted_tokens,
        accepted_tokens=s.accepted_tokens,
        acceptance_rate=s.acceptance_rate,
        mean_accepted_length=s.mean_accepted_length,
        draft_seconds=s.draft_seconds,
        verify_seconds=s.verify_seconds,
        accept_seconds=s.accept_seconds,
        bookkeeping_seconds=s.bookkeeping_seconds,
    )


def hf_assisted_generate(
    engine, input_ids: list[int], max_new_tokens: int, ignore_eos: bool = False
) -> tuple[list[int], float]:
    """transformers' assisted greedy generation with the engine's drafter; (new token ids without EOS, seconds).

    With ``ignore_eos`` no token stops generation (``eos_token_id=None``) and
    EOS tokens stay in the output, as in the engine.
    """
    model = engine.target.model
    assistant = engine.drafter.model
    device = model.device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, n]
    eos = sorted(engine.eos_token_ids)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else eos[0]
    with torch.inference_mode():
        sync(device)
        started = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=assistant,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None if ignore_eos else eos,
            pad_token_id=pad,
        )
        sync(device)
        seconds = time.perf_counter() - started
    new = [int(t) for t in out[0, ids.shape[1] :]]
    if not ignore_eos:  # the engine does not emit EOS (nor padding after it)
        for index, token in enumerate(new):
            if token in engine.eos_token_ids:
                new = new[:index]
                break
    return new, seconds


def _hf_measurement(engine, item: BenchItem, config: DecodeConfig) -> Measurement:
    from rapidspec.prompting.prompts import fit_document

    window = engine.target.max_context - config.max_new_tokens
    document, _ = fit_document(engine.tokenizer, engine.template, item.document, item.question, window, config.truncate)
    input_ids = prompt_ids(engine.tokenizer, engine.template, document, item.question, retrieved=False)
    _, prefill = hf_assisted_generate(engine, input_ids, 1, config.ignore_eos)
    tokens, total = hf_assisted_generate(engine, input_ids, config.max_new_tokens, config.ignore_eos)
    decode = max(total - prefill, 1e-9)
    decoded_tokens = max(len(tokens) - 1, 0)
    return Measurement(
        token_ids=tuple(tokens),
        text=engine.tokenizer.decode(tokens, skip_special_tokens=True),
        prompt_tokens_target=len(input_ids),
        prompt_tokens_drafter=len(input_ids),
        retrieval_seconds=0.0,
        target_prefill_seconds=prefill,
        drafter_prefill_seconds=None,  # inside decode_seconds (see the module docstring)
        decode_seconds=decode,
        total_seconds=total,
        new_tokens=len(tokens),
        decode_tokens_per_second=decoded_tokens / decode if decoded_tokens else None,
    )


def measure(
    engine, item: BenchItem, variant: Variant, base: DecodeConfig, profile: bool = False, peer=None,
    reuse_prefill: bool = False, prefill_progress=None,
) -> Measurement:
    """One timed generation of ``variant`` on ``item``, with the peak memory it reached.

    ``peer``: the :class:`~rapidspec.bench.llama_peer.LlamaCppPeer` that runs mode ``llama.cpp``;
    ``prefill_progress(done, total)``: hears of the engine's target prefill chunks.
    """
    devices = {engine.target.model.device}
    if variant.mode == HF_ASSISTED:
        devices.add(engine.drafter.model.device)
    with PeakMemory(devices) as peak:
        if variant.mode == HF_ASSISTED:
            result = _hf_measurement(engine, item, base)
        elif variant.mode == LLAMA_CPP:
            result = peer.measure(engine, item, base, reuse_prefill)
        else:
            result = _engine_measurement(engine, item, variant.config, profile, prefill_progress)
    result.peak_rss_bytes = peak.peak_rss_bytes
    result.peak_cuda_bytes = peak.peak_cuda_bytes
    return result


def _summarise(engine, variant: Variant, item_index: int, item: BenchItem, runs: list[Measurement],
               profile: bool) -> Result:
    last = runs[-1]
    config = variant.config
    split = None
    if profile and variant.mode in USES_DRAFTER:
        rounds = _median([m.rounds for m in runs]) or 1
        split = {}
        for name in ("draft", "verify", "accept", "bookkeeping"):
            total = _median([getattr(m, f"{name}_seconds") for m in runs])
            split[f"{name}_seconds"] = total
            split[f"{name}_ms_per_round"] = 1000 * total / rounds
    return Result(
        label=variant.label,
        mode=variant.mode,
        length=item.length,
        item_index=item_index,
        repeats=len(runs),
        prompt_tokens_target=last.prompt_tokens_target,
        prompt_tokens_drafter=last.prompt_tokens_drafter,
        new_tokens=last.new_tokens,
        retrieval_seconds=_median([m.retrieval_seconds for m in runs]),
        target_prefill_seconds=_median([m.target_prefill_seconds for m in runs]),
        drafter_prefill_seconds=_median([m.drafter_prefill_seconds for m in runs]),
        decode_seconds=_median([m.decode_seconds for m in runs]),
        total_seconds=_median([m.total_seconds for m in runs]),
        decode_tokens_per_second=_median([m.decode_tokens_per_second for m in runs]),
        rounds=last.rounds,
        acceptance_rate=_median([m.acceptance_rate for m in runs]),
        mean_accepted_length=_median([m.mean_accepted_length for m in runs]),
        eta=engine.resolve(config)[0].eta_value if config is not None else None,  # what the engine ran
        gamma=config.gamma if config is not None and variant.mode in USES_DRAFTER else None,
        sweep_value=variant.sweep_value,
        peak_rss_gib=max(m.peak_rss_bytes for m in runs) / GIB,
        peak_cuda_gib=None if last.peak_cuda_bytes is None else max(m.peak_cuda_bytes or 0 for m in runs) / GIB,
        profile=split,
        text=last.text,
        token_ids=last.token_ids,
    )


def compare_with_lc(results: list[Result]) -> None:
    """Fill in speedups and greedy equality against the ``lc`` result of the same input."""
    lc = {r.item_index: r for r in results if r.label == "lc"}
    for r in results:
        ref = lc.get(r.item_index)
        if ref is None:
            continue
        if r.decode_tokens_per_second and ref.decode_tokens_per_second:
            r.decode_speedup = r.decode_tokens_per_second / ref.decode_tokens_per_second
        if r.total_seconds:
            r.end_to_end_speedup = ref.total_seconds / r.total_seconds
        r.equals_lc = tuple(r.token_ids) == tuple(ref.token_ids)


def run_benchmark(engine, items: Sequence[BenchItem], modes: Sequence[str] = DEFAULT_MODES,
                  base: DecodeConfig | None = None, repeats: int = 3, sweep: Sweep | None = None,
                  profile: bool = False, warmup: bool = True, progress: Callable[[str], None] | None = None,
                  share_prefill: bool = False, prefill_progress: Callable[[int, int], None] | None = None
                  ) -> BenchReport:
    """Run every variant on every item ``repeats`` times; medians and ratios against ``lc``.

    ``engine`` is a :class:`rapidspec.engine.Rapid` built with
    ``reuse_document_cache=share_prefill``. ``base`` carries the shared decode
    settings (gamma, eta, max_new_tokens, temperature...). ``progress(message)``
    is called before each generation (warm-ups included); ``prefill_progress(done, total)``
    hears of each target prefill chunk.

    ``share_prefill``: the target's prefill of each input is computed once (by
    the first ``lc`` run) and the other runs of the engine's full-context modes
    start from a copy of that cache; their ``target_prefill_seconds`` (and
    totals) are set to that one measured prefill, so end-to-end figures stay
    comparable while long inputs cost one prefill instead of one per run.
    Drafter prefills are never shared: every run prefills its drafter.
    """
    if engine.reuse_document_cache != share_prefill:
        raise RapidspecError(
            f"benchmark engines must be built with reuse_document_cache={share_prefill} "
            f"(share_prefill={share_prefill})"
        )
    if repeats < 1:
        raise RapidspecError(f"repeats must be >= 1, got {repeats}")
    if not items:
        raise RapidspecError("nothing to benchmark: no inputs")
    base = base or DecodeConfig(max_new_tokens=64)
    columns = variants(modes, base, sweep)
    note = progress or (lambda message: None)
    peer = None
    if any(v.mode == LLAMA_CPP for v in columns):
        from rapidspec.bench.llama_peer import LlamaCppPeer

        peer = LlamaCppPeer(engine, engine.drafting.threads)

    if warmup:
        _warm_up(engine, items[0], columns, base, note, peer)
    results: list[Result] = []
    for index, item in enumerate(items):
        runs: dict[str, list[Measurement]] = {v.label: [] for v in columns}
        engine.clear_document_cache()
        shared_prefill_seconds = None
        for repeat in range(repeats):
            for variant in columns:
                where = f"length {item.length}" if item.length else f"record {index + 1}"
                note(f"{where}, repeat {repeat + 1}/{repeats}: {variant.label}")
                engine.drafting.clear()  # only the target's prefill is shared: every run prefills its drafter
                run = measure(engine, item, variant, base, profile, peer=peer, reuse_prefill=share_prefill,
                              prefill_progress=prefill_progress)
                if share_prefill and variant.mode in FULL_CONTEXT_MODES:
                    if shared_prefill_seconds is None:  # the first lc run: a full prefill
                        shared_prefill_seconds = run.target_prefill_seconds
                    else:
                        run.total_seconds += shared_prefill_seconds - run.target_prefill_seconds
                        run.target_prefill_seconds = shared_prefill_seconds
                runs[variant.label].append(run)
        results.extend(_summarise(engine, v, index, item, runs[v.label], profile) for v in columns)
    compare_with_lc(results)
    return BenchReport(model=engine.target.label, drafter=engine.drafter_label, device=str(engine.target.model.device),
                       dtype=str(engine.target.model.dtype).removeprefix("torch."), repeats=repeats,
                       max_new_tokens=base.max_new_tokens, ignore_eos=base.ignore_eos, shared_prefill=share_prefill,
                       gamma=base.gamma, eta=engine.resolve(base.with_(mode="rapid"))[0].eta_value, sweep=sweep,
                       results=results, draft_confidence=base.draft_confidence)


def _warm_up(engine, item: BenchItem, columns, base: DecodeConfig, note, peer) -> None:
    """Each variant once on the start of ``item``'s document, 4 tokens at most (loads, packs and calibrates)."""
    short = BenchItem(item.document[:WARMUP_CHARS], item.question)
    warm_base = base.with_(max_new_tokens=min(4, base.max_new_tokens))
    for variant in columns:
        note(f"warm-up {variant.label}")
        config = variant.config.with_(max_new_tokens=warm_base.max_new_tokens) if variant.config else None
        measure(engine, short, Variant(variant.label, variant.mode, config), warm_base, peer=peer)


def count_generations(n_items: int, n_variants: int, repeats: int) -> int:
    """How many ``progress`` calls a run makes (for a progress bar)."""
    return n_variants + n_items * n_variants * repeats
