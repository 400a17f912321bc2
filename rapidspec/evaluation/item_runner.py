"""Answering and scoring one (item, run variant) with one engine: what a local eval and each Ray worker do.

:class:`RunOptions` is everything besides the engine that decides a record
(the decode defaults, the answer length, the data label, where the drafter
retrieves from); :class:`ItemRunner` holds the engine built from an
:class:`~rapidspec.engine.spec.EngineSpec` (every drafter option and retrieval,
:class:`rapidspec.Rapid`) over the loaded models, and turns an (item, variant) pair into a record
without its ``config``, which the caller adds (with the judge's name when
there is one). Each call names its retriever and prompt template; the
engine's own are never reassigned. Records do not depend on which process
made them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from rapidspec.config import DecodeConfig
from rapidspec.evaluation.datasets import EvalItem
from rapidspec.evaluation.metrics import score_prediction
from rapidspec.evaluation.run_config import DEFAULT_MAX_NEW_TOKENS, run_config, separate_drafter

#: The record mode of the drafter's own answer on the retrieved text (a separate drafter only).
DRAFTER_ROW = "drafter"



@dataclass(frozen=True)
class RunOptions:
    """What besides the engine decides a record; ``corpora``: item id -> the text its retrieval reads instead;
    ``logprobs``: K > 0 stores the top-K log-probabilities of each answer's first tokens under each view
    (:mod:`.logprob_views`)."""

    base: DecodeConfig
    max_new_tokens: int | None = None
    data_label: str = ""
    retrieve_from: str | None = None
    corpora: dict = field(default_factory=dict, hash=False)
    logprobs: int = 0


class ItemRunner:
    """The engine of ``spec`` (an EngineSpec) over ``target`` and ``drafter`` (loaded from ``spec.models``)
    answering items under ``options``."""

    def __init__(self, spec, target, drafter, options: RunOptions,
                 prefill_progress: Callable[[int, int], None] | None = None) -> None:
        from rapidspec.engine import Rapid

        self.spec, self.options = spec, options
        self.prefill_progress = prefill_progress
        self.engine = Rapid(spec, target=target, drafter=drafter)
        self.config = run_config(target, drafter, self.engine.drafter_backend, options.base, data=options.data_label,
                                 max_new_tokens=options.max_new_tokens, retrieval=spec.retrieval,
                                 retrieve_from=options.retrieve_from, logprobs=options.logprobs,
                                 drafter_relation=self.engine.drafter_relation)
        self._drafter_engine = None
        self._views = None
        self._retrievers: dict = {None: self.engine.retriever}

    def _retriever(self, budget_tokens: int | None):
        """The retriever of a budget sweep point (None: the run's own), sharing the loaded embedder."""
        from rapidspec.retrieval import Retriever

        if budget_tokens not in self._retrievers:
            self._retrievers[budget_tokens] = Retriever(
                replace(self.spec.retrieval, budget_tokens=budget_tokens), tokenizer=self.engine.tokenizer,
                embedder=self._retrievers[None].loaded_embedder,
            )
        return self._retrievers[budget_tokens]

    def _drafter_engine_for(self):
        """An engine whose target is the drafter model, for its own answers on the retrieved text (mode rag)."""
        from rapidspec.engine import EngineSpec, Rapid
        from rapidspec.models.spec import ModelSpec

        if self._drafter_engine is None:
            spec = EngineSpec(ModelSpec(drafter_backend="torch"), self.spec.retrieval)
            self._drafter_engine = Rapid(spec, target=self.engine.drafter)
        return self._drafter_engine

    def run(self, item: EvalItem, variant) -> dict:
        """The scored record of ``item`` under ``variant`` (:mod:`.variants`), without ``config``."""
        limit = self.options.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[item.task_type]
        run = variant.config.with_(max_new_tokens=limit)
        corpus = self.options.corpora.get(item.id)
        retriever = self._retriever(variant.budget_tokens)
        answering = self._drafter_engine_for() if variant.mode == DRAFTER_ROW else self.engine
        if item.messages:  # chat form: the conversation so far is the long context
            output = answering.chat(list(item.messages), query=item.query, retriever=retriever, config=run,
                                    prefill_progress=self.prefill_progress)
        else:
            output = answering.generate(item.document, item.question, query=item.query, corpus=corpus,
                                        retriever=retriever, template=item.template, config=run,
                                        prefill_progress=self.prefill_progress)
        record = self._record(item, variant, output)
        if self.options.logprobs:
            record["logprobs"] = self._logprobs(item, run, output, corpus, retriever)
        return record

    def _logprobs(self, item: EvalItem, run: DecodeConfig, output, corpus: str | None, retriever) -> dict:
        from rapidspec.evaluation.logprob_views import ViewScorer, answer_views

        engine = self.engine
        if self._views is None:
            self._views = ViewScorer(self.options.logprobs, engine.vocab_size, engine.eos_token_ids,
                                     lambda token: engine.tokenizer.decode([token]))
        return answer_views(self._views, engine, item, run, output.token_ids, ended=output.stats.stop_reason == "eos",
                            drafter_model=engine.drafter if separate_drafter(self.config) else None, corpus=corpus,
                            retriever=retriever)

    @staticmethod
    def _record(item: EvalItem, variant, output) -> dict:
        metrics = score_prediction(item.task_type, output.text, item.answers, len(item.choices),
                                   choices=item.choices, scorer=item.scorer, category=item.meta.get("category"))
        return {
            "id": item.id, "group": item.group, "mode": variant.mode, "eta": variant.eta, "gamma": variant.gamma,
            "sweep": variant.sweep,
            "task_type": item.task_type, "prediction": output.text, "gold": list(item.answers),
            "score": metrics["score"], "metrics": metrics, "stats": output.stats.to_dict(),
            "retrieved_chunks": len(output.retrieval.chunks) if output.retrieval is not None else None,
        }

    def run_all(self, pending: Iterable[tuple[EvalItem, object]]) -> Iterator[tuple[EvalItem, dict]]:
        """(item, record) for each pair, in order."""
        for item, variant in pending:
            yield item, self.run(item, variant)
