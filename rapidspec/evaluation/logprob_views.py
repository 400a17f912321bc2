"""The first answer tokens under each view of an item: what ``rapidspec eval --logprobs K`` stores per record.

An answer's tokens are fed again (teacher forcing) to three views of the item:

* ``lc``: the target reading the whole document (the paper's p);
* ``rag``: the target reading the retrieved text only;
* ``drafter``: the drafter reading the retrieved text (the paper's q), when
  the drafter is another model; in self-speculation it is the ``rag`` view.

At each of the first :data:`POSITIONS` positions of the answer (position i
predicts answer token i; the position after the last token predicts the
end), each view keeps the log-probabilities at temperature 1 (the
distributions greedy decoding compares) of every token that some view ranks
among its K most likely. That is what
the greedy choice of rapid under any eta or draft gate needs, so it can be
recomputed offline (``benchmarks/offline_eta.py``). The record's field::

    "logprobs": {
        "top": K,
        "tokens": [t_0, ..., t_{m-1}],     # the answer's token at each position, None where it ended
        "eos": [ids that end an answer],
        "views": {"lc": [[[id, logprob], ...] per position, most likely first], "rag": ..., "drafter": ...},
        "text": {"id": "its text", ...}     # every id above, decoded alone
    }

Each view's prompt is prefilled once per item (the ``lc`` view starts from
the engine's stored cache of the same prompt) and cropped back for every
record, so a record costs one short forward per view.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rapidspec.runtime import new_kv_cache

#: Answer positions kept per record: enough to read a choice letter ("(B)") or the start of an answer.
POSITIONS = 4


class ViewScorer:
    """Top-K log-probabilities of answer prefixes under named views, one prefilled cache per view and prompt."""

    def __init__(self, top: int, vocab_size: int, eos_ids: Sequence[int], decode) -> None:
        if top < 1:
            raise ValueError(f"top must be >= 1, got {top}")
        self.top, self.vocab_size = top, vocab_size
        self.eos_ids = sorted(int(t) for t in eos_ids)
        self.decode = decode  # token id -> text
        self._caches: dict[str, tuple[tuple[int, ...], object]] = {}  # view -> (prompt, cache over prompt[:-1])

    def _cache(self, view: str, model, prompt: tuple[int, ...], stored=None):
        held = self._caches.get(view)
        if held is None or held[0] != prompt:
            cache = None
            if stored is not None:  # a stored cache of the same prompt (the engine's prefix cache)
                cache, reused = stored.lookup(list(prompt[:-1]))
                if cache is not None and reused < len(prompt) - 1:
                    cache = None
            if cache is None:
                cache = new_kv_cache(model)
                cache.prefill(list(prompt[:-1]))
            self._caches[view] = held = (prompt, cache)
        return held[1]

    def view_rows(self, view: str, model, prompt: Sequence[int], answer: Sequence[int], positions: int,
                  stored=None) -> torch.Tensor:
        """Log-probabilities [positions, V] at the first ``positions`` positions of ``answer`` after ``prompt``."""
        prompt = tuple(int(t) for t in prompt)
        cache = self._cache(view, model, prompt, stored)
        cache.crop(len(prompt) - 1)
        logits = cache.forward([prompt[-1], *answer[: positions - 1]], num_logits=positions)  # [m, V]
        return logits[:, : self.vocab_size].float().log_softmax(-1).cpu()  # [m, V]

    def record(self, answer: Sequence[int], views: dict[str, torch.Tensor]) -> dict:
        """The record's ``logprobs`` field from each view's rows ([m, V] each).

        Every view lists, per position, the union of all views' top-K tokens (its own top-K first), so
        that p and q are both known exactly at every token some view ranks high.
        """
        answer = [int(t) for t in answer]
        positions = next(iter(views.values())).shape[0]
        tokens = [answer[i] if i < len(answer) else None for i in range(positions)]
        top = {name: rows.topk(min(self.top, rows.shape[-1]), dim=-1).indices.tolist() for name, rows in views.items()}
        out: dict[str, list] = {name: [] for name in views}
        for position in range(positions):
            union = list(dict.fromkeys(i for name in views for i in top[name][position]))
            for name, rows in views.items():
                values = rows[position, union].tolist()
                pairs = sorted(zip(union, values), key=lambda pair: -pair[1])
                out[name].append([[i, round(v, 6)] for i, v in pairs])
        ids = {i for rows in out.values() for row in rows for i, _ in row} | {t for t in tokens if t is not None}
        return {"top": self.top, "tokens": tokens, "eos": self.eos_ids, "views": out,
                "text": {str(i): self.decode(i) for i in sorted(ids)}}

    def clear(self) -> None:
        self._caches.clear()


def answer_views(scorer: ViewScorer, engine, item, config, answer: Sequence[int], *, ended: bool,
                 drafter_model=None, corpus: str | None = None, retriever=None) -> dict:
    """The ``logprobs`` field of one answer to ``item`` (a question about a document) under ``config``.

    ``ended``: the answer stopped at an end-of-sequence token (the position after it is kept too);
    ``drafter_model``: the drafter's torch model when it is not the target (adds the ``drafter`` view);
    ``corpus``: what retrieval read instead of the document; ``retriever``: the one the answer used.
    """
    answer = [int(t) for t in answer]
    positions = max(1, min(POSITIONS, len(answer) + int(ended)))
    full = engine.document_prompts(item.document, item.question, config.with_mode("lc"), query=item.query,
                                   template=item.template)
    retrieved = engine.document_prompts(item.document, item.question, config.with_mode("rag"), query=item.query,
                                        corpus=corpus, retriever=retriever, template=item.template)
    target = engine.target
    with torch.inference_mode():
        views = {
            "lc": scorer.view_rows("lc", target, full.target_ids, answer, positions, stored=engine.prefix_cache),
            "rag": scorer.view_rows("rag", target, retrieved.target_ids, answer, positions),
        }
        if drafter_model is not None:
            views["drafter"] = scorer.view_rows("drafter", drafter_model, retrieved.target_ids, answer, positions)
    return scorer.record(answer, views)
