"""Answering and scoring one (item, run variant) with one engine: what a local eval and each Ray worker do.

:class:`RunOptions` is everything besides the models that decides a record
(retrieval, the decode defaults, the answer length, the data label, where the
drafter retrieves from); :class:`ItemRunner` holds the engine built from the
models and the options, and turns an (item, variant) pair into a record
without its ``config``, which the caller adds (with the judge's name when
there is one). Records do not depend on which process made them.
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
    """What besides the models decides a record; ``corpora``: item id -> the text its retrieval reads instead;
    ``logprobs``: K > 0 stores the top-K log-probabilities of each answer's first tokens under each view
    (:mod:`.logprob_views`)."""

    retrieval: object  # RetrievalConfig
    base: DecodeConfig
    max_new_tokens: int | None = None
    data_label: str = ""
    retrieve_from: str | None = None
    corpora: dict = field(default_factory=dict, hash=False)
    logprobs: int = 0


class ItemRunner:
    """One engine over ``target`` and ``drafter`` (built on first use) answering items under ``options``."""

    def __init__(self, target, drafter, options: RunOptions,
                 prefill_progress: Callable[[int, int], None] | None = None) -> None:
        from rapidspec.drafting.backends import choose_backend

        self.target, self.drafter, self.options = target, drafter, options
        self.prefill_progress = prefill_progress
        backend = choose_backend(options.base.drafter_backend, target, drafter)
        self.config = run_config(target, drafter, backend, options.base, data=options.data_label,
                                 max_new_tokens=options.max_new_tokens, retrieval=options.retrieval,
                                 retrieve_from=options.retrieve_from, logprobs=options.logprobs)
        self._engine = None
        self._drafter_engine = None
        self._views = None
        self._retrievers: dict = {}

    def _engine_for(self, budget_tokens: int | None):
        from rapidspec.engine import Rapid
        from rapidspec.retrieval import Retriever

        if self._engine is None:
            self._engine = Rapid(self.target, self.drafter, retrieval=self.options.retrieval)
            self._retrievers[None] = self._engine.retriever
        if budget_tokens not in self._retrievers:
            self._retrievers[budget_tokens] = Retriever(  # the same embedder, once it is loaded
                replace(self.options.retrieval, budget_tokens=budget_tokens), tokenizer=self._engine.tokenizer,
                embedder=self._retrievers[None].loaded_embedder,
            )
        self._engine.retriever = self._retrievers[budget_tokens]
        return self._engine

    def _drafter_engine_for(self, engine):
        """An engine whose target is the drafter model, for its own answers on the retrieved text (mode rag)."""
        from rapidspec.engine import Rapid

        if self._drafter_engine is None:
            self._drafter_engine = Rapid(engine.drafter, drafter_backend="torch")
        self._drafter_engine.retriever = engine.retriever  # the same chunks and scores as the drafting modes
        return self._drafter_engine

    def _separate_drafter(self, engine):
        """The drafter's torch model when the drafter is not the target's weights, else None."""
        return engine.drafter if separate_drafter(self.config) else None

    def run(self, item: EvalItem, variant) -> dict:
        """The scored record of ``item`` under ``variant`` (:mod:`.variants`), without ``config``."""
        engine = self._engine_for(variant.budget_tokens)
        engine.template = item.template  # public attributes; the document cache is keyed by tokens
        limit = self.options.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[item.task_type]
        run = variant.config.with_(max_new_tokens=limit)
        corpus = self.options.corpora.get(item.id)
        answering = engine
        if variant.mode == DRAFTER_ROW:
            answering = self._drafter_engine_for(engine)
            answering.template = item.template
        if item.messages:  # chat form: the conversation so far is the long context
            output = answering.chat(list(item.messages), query=item.query, config=run,
                                    prefill_progress=self.prefill_progress)
        else:
            output = answering.generate(item.document, item.question, query=item.query, corpus=corpus, config=run,
                                        prefill_progress=self.prefill_progress)
        record = self._record(item, variant, output)
        if self.options.logprobs:
            record["logprobs"] = self._logprobs(engine, item, run, output, corpus)
        return record

    def _logprobs(self, engine, item: EvalItem, run: DecodeConfig, output, corpus: str | None) -> dict:
        from rapidspec.evaluation.logprob_views import ViewScorer, answer_views

        if self._views is None:
            self._views = ViewScorer(self.options.logprobs, engine.vocab_size, engine.eos_token_ids,
                                     lambda token: engine.tokenizer.decode([token]))
        return answer_views(self._views, engine, item, run, output.token_ids, ended=output.stats.stop_reason == "eos",
                            drafter_model=self._separate_drafter(engine), corpus=corpus)

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
