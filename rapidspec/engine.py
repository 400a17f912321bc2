"""The RAPID engine: one generator that drafts, verifies and streams tokens.

:meth:`Rapid.decode` is the only decode loop of the project; ``stream`` (a
document and a question), ``stream_chat`` (a conversation), the CLI, the
server, evaluation and benchmarks all consume it. Prompts come from
:mod:`rapidspec.prompts` and :mod:`rapidspec.conversation`; target caches are
reused through :mod:`rapidspec.prefix_cache`. One round of speculative
decoding (modes ``sd``, ``ragsd``, ``rapid``)::

    1 prefill   target cache <- target prompt[:-1], drafter cache <- drafter prompt[:-1]
    2 draft     drafter feeds its pending tokens, then drafts k tokens one by one, k from
                the gamma schedule (fewer when a draft's q is below ``draft_confidence``;
                none when the ``cost`` schedule makes the round a plain target step)
    3 verify    target feeds [pending, x_1..x_k] in ONE forward -> logits z_1..z_{k+1}
    4 accept    keep the longest accepted prefix x_1..x_n, then emit one token from
                the residual (n < k) or from p^ at position k+1 (bonus, n = k); with
                eta > 0 the bonus needs q there, so only then the drafter feeds x_k
    5 roll back both caches to the committed tokens (minus the pending last one)

The math of step 4 lives in :mod:`rapidspec.sampling`; the caches in :mod:`rapidspec.runtime`
(:mod:`rapidspec.runtime.cache`, :mod:`rapidspec.runtime.lean_cache`); the choice of k in
:mod:`rapidspec.gamma_schedule`. Modes ``lc`` and ``rag`` run the plain loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator

import torch

from rapidspec import sampling
from rapidspec.config import DecodeConfig
from rapidspec.conversation import DEFAULT_RECENT_MESSAGES, chat_prompts, parse_documents, parse_messages
from rapidspec.errors import RapidspecError
from rapidspec.gamma_schedule import GammaSchedule, new_schedule
from rapidspec.outputs import GenerationOutput, StreamChunk, last_output
from rapidspec.prefix_cache import GIB, PrefixCache
from rapidspec.prompts import PromptPair, PromptTemplate, document_prompts, with_streaming_drafter
from rapidspec.runtime import new_kv_cache
from rapidspec.stats import GenerationStats, RoundRecord
from rapidspec.text_stream import TextAssembler
from rapidspec.vocabulary import check_same_vocabulary, eos_token_ids, logit_width

logger = logging.getLogger(__name__)

# Reuse a stored target cache only when it saves at least this many tokens.
MIN_REUSED_PREFIX_TOKENS = 64
DEFAULT_PREFIX_CACHE_GIB = 2.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Rapid:
    """Long-context generation with a retrieval-augmented drafter.

    ``target`` and ``drafter`` are :class:`rapidspec.models.LoadedModel`
    objects (anything with ``model``, ``tokenizer`` and ``max_context``).
    Without a drafter the target's weights draft with a cache of their own
    (self-speculation). A drafter may be smaller or larger and live on another
    device; its vocabulary must equal the target's.
    """

    def __init__(
        self,
        target,
        drafter=None,
        retrieval=None,
        template: PromptTemplate | None = None,
        prefill_chunk_tokens: int = 2048,
        reuse_document_cache: bool = True,
        prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB,
    ) -> None:
        from rapidspec.retrieval import RetrievalConfig, Retriever

        self.target = target
        self.drafter = drafter if drafter is not None else target
        if self.drafter is not target:
            check_same_vocabulary(target.tokenizer, self.drafter.tokenizer)
        self.tokenizer = target.tokenizer
        self.template = template or PromptTemplate()
        self.retriever = Retriever(retrieval or RetrievalConfig(), tokenizer=self.tokenizer)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.reuse_document_cache = reuse_document_cache
        self.prefix_cache = PrefixCache(int(prefix_cache_gib * GIB), MIN_REUSED_PREFIX_TOKENS)
        self.eos_token_ids = eos_token_ids(target)
        # Logits beyond the smaller vocabulary (embedding padding) are never real tokens.
        self.vocab_size = min(logit_width(target.model), logit_width(self.drafter.model))

    # ------------------------------------------------------------------ API
    def generate(self, document: str, question: str, **options) -> GenerationOutput:
        """Generate an answer; same options as :meth:`stream`."""
        return last_output(self.stream(document, question, **options))

    def chat(self, messages, **options) -> GenerationOutput:
        """Answer the last user message of a conversation; same options as :meth:`stream_chat`."""
        return last_output(self.stream_chat(messages, **options))

    def stream(
        self,
        document: str,
        question: str,
        *,
        query: str | None = None,
        corpus: str | None = None,
        config: DecodeConfig | None = None,
        generator: torch.Generator | None = None,
        profile: bool = False,
        observer=None,
        **options,
    ) -> Iterator[StreamChunk]:
        """Yield the answer to ``question`` about ``document`` as it is generated.

        ``options`` are :class:`DecodeConfig` fields (``mode``, ``eta``, ...) or
        pass a ready ``config``; ``query`` is what retrieval searches for
        (default: the question); ``corpus`` what it searches in (default: the
        document; another text gives the drafter unrelated chunks on purpose);
        the rest as in :meth:`decode`.
        """
        config = DecodeConfig.from_options(config, options)
        prompts = self.document_prompts(document, question, config, query=query, corpus=corpus)
        yield from self.decode(prompts, config, generator=generator, profile=profile, observer=observer)

    def stream_chat(
        self,
        messages,
        *,
        documents=None,
        query: str | None = None,
        recent_messages: int = DEFAULT_RECENT_MESSAGES,
        config: DecodeConfig | None = None,
        generator: torch.Generator | None = None,
        profile: bool = False,
        observer=None,
        **options,
    ) -> Iterator[StreamChunk]:
        """Yield the answer to the last user message of ``messages`` (OpenAI-style dicts).

        ``documents``: texts or ``{"title", "text"}``; without them the earlier
        turns are the drafter's corpus (:mod:`rapidspec.conversation`).
        """
        config = DecodeConfig.from_options(config, options)
        prompts = self.chat_prompts(messages, config, documents=documents, query=query, recent_messages=recent_messages)
        yield from self.decode(prompts, config, generator=generator, profile=profile, observer=observer)

    def document_prompts(
        self, document: str, question: str, config: DecodeConfig, query: str | None = None, corpus: str | None = None
    ) -> PromptPair:
        """The target's and drafter's prompts of a (document, question) pair (``corpus``: see :meth:`stream`)."""
        target_window, drafter_window = self._windows(config)
        return document_prompts(
            self.tokenizer, self.template, self.retriever, document, question, config, target_window, drafter_window,
            query=query, corpus=corpus,
        )

    def chat_prompts(
        self, messages, config: DecodeConfig, *, documents=None, query: str | None = None,
        recent_messages: int = DEFAULT_RECENT_MESSAGES, raw: bool = False, retriever=None,
    ) -> PromptPair:
        """The prompts of a conversation; ``raw`` skips the chat template, ``retriever`` replaces the engine's."""
        target_window, drafter_window = self._windows(config)
        pair = chat_prompts(
            self.tokenizer, retriever or self.retriever, parse_messages(messages), parse_documents(documents), mode=config.mode,
            target_window=target_window, drafter_window=drafter_window, truncate=config.truncate, query=query,
            recent_messages=recent_messages, raw=raw,
        )
        return with_streaming_drafter(pair, config, drafter_window)

    def decode(
        self,
        prompts: PromptPair,
        config: DecodeConfig,
        *,
        generator: torch.Generator | None = None,
        profile: bool = False,
        observer=None,
        schedule: GammaSchedule | None = None,
    ) -> Iterator[StreamChunk]:
        """Prefill and decode ``prompts`` (from :meth:`document_prompts` or :meth:`chat_prompts`).

        ``generator`` overrides the seeded one for sampling; ``profile`` syncs
        the device around each phase (exact times on GPUs); ``observer(target_cache,
        target_seq, drafter_cache, drafter_seq)`` is called after every round's
        rollback (read only); ``schedule`` replaces the gamma schedule the config
        names (:mod:`rapidspec.gamma_schedule`). Closing the iterator stops after the current round.
        """
        stats = GenerationStats.starting(config, prompts)
        target_device = self.target.model.device
        if generator is None:
            generator = torch.Generator(device=target_device)
            generator.manual_seed(config.seed if config.seed is not None else secrets.randbits(63))

        with torch.inference_mode():
            # 1 prefill
            target_seq = list(prompts.target_ids)
            started = time.perf_counter()
            use_store = self.reuse_document_cache and not prompts.target_reads_retrieved
            target_cache = self._prefill_target(target_seq, stats, use_store)
            _sync(target_device)
            stats.target_prefill_seconds = time.perf_counter() - started

            drafter_cache = drafter_seq = None
            if prompts.drafter_ids is not None:
                drafter_seq = list(prompts.drafter_ids)
                started = time.perf_counter()
                drafter_cache = new_kv_cache(self.drafter, self.prefill_chunk_tokens)
                drafter_cache.prefill(drafter_seq[:-1])
                _sync(self.drafter.model.device)
                stats.drafter_prefill_seconds = time.perf_counter() - started

            # 2-5 decode
            # (a closed stream stops at a yield, after a round's rollback, so its cache is consistent too)
            try:
                yield from self._decode(
                    config, stats, generator, target_cache, target_seq, drafter_cache, drafter_seq, prompts, profile,
                    observer, schedule or new_schedule(config),
                )
            except GeneratorExit:
                if use_store:
                    self.prefix_cache.store(target_cache)
                raise
            if use_store:
                self.prefix_cache.store(target_cache)  # the cache is the store's from now on

    def clear_document_cache(self) -> None:
        """Forget every stored target cache (the next prefill starts from scratch)."""
        self.prefix_cache.clear()

    # ------------------------------------------------------------ internals
    def _windows(self, config: DecodeConfig) -> tuple[int, int]:
        """Prompt tokens that fit the target's and the drafter's windows with the answer."""
        target_window = self.target.max_context - config.max_new_tokens
        if target_window < 16:
            raise RapidspecError(f"max_new_tokens={config.max_new_tokens} leaves no room for the prompt in the "
                                 f"{self.target.max_context}-token window", param="max_tokens", code="context_length_exceeded")
        return target_window, max(16, self.drafter.max_context - config.max_new_tokens)

    def _prefill_target(self, token_ids: list[int], stats: GenerationStats, use_store: bool):
        """Prefill the target on ``token_ids[:-1]``, starting from a stored cache sharing a prefix."""
        wanted = token_ids[:-1]
        cache = None
        if use_store:
            cache, stats.target_prefill_reused_tokens = self.prefix_cache.lookup(wanted)
        if cache is None:
            cache = new_kv_cache(self.target, self.prefill_chunk_tokens)
        cache.prefill(wanted[cache.length :])
        return cache

    def _decode(
        self, config, stats, generator, target_cache, target_seq, drafter_cache, drafter_seq, prompts, profile, observer,
        schedule,
    ):
        prompt_length = len(target_seq)
        drafter_prompt_length = len(drafter_seq) if drafter_seq is not None else 0
        assembler = TextAssembler(self.tokenizer, config.stop)
        sync = profile or config.gamma_schedule == "cost"  # the cost schedule needs exact step times
        started = time.perf_counter()
        while True:
            remaining = config.max_new_tokens - (len(target_seq) - prompt_length)
            if drafter_cache is None:
                emitted = self._plain_step(config, generator, target_cache, target_seq)
            else:
                emitted, measured = self._speculative_step(
                    config, generator, target_cache, target_seq, drafter_cache, drafter_seq,
                    min(schedule.next_drafts(), remaining - 1), sync,
                )
                stats.add_round(measured)
                schedule.record(measured)
            # 5 commit: stop at EOS and at max_new_tokens, then roll back the caches
            finished = ""
            for index, token in enumerate(emitted):
                if self._ends_generation(token, config):
                    emitted, finished = emitted[:index], "eos"
                    break
            if len(emitted) >= remaining:
                emitted, finished = emitted[:remaining], finished or "length"
            target_seq.extend(emitted)
            target_cache.crop(min(target_cache.length, len(target_seq) - 1))
            if drafter_cache is not None:
                drafter_seq.extend(emitted)
                drafter_cache.crop(min(drafter_cache.length, len(drafter_seq) - 1))
            if observer is not None:
                observer(target_cache, target_seq, drafter_cache, drafter_seq)
            text, stopped = assembler.add(emitted)
            if stopped:
                finished = "stop"
            elif finished:
                text += assembler.flush()
            if text or emitted:
                yield StreamChunk(text=text, token_ids=tuple(emitted))
            if finished:
                break
        _sync(target_cache.device)
        stats.decode_seconds = time.perf_counter() - started
        stats.new_tokens = len(target_seq) - prompt_length
        stats.stop_reason = finished
        generated = tuple(target_seq[prompt_length:])
        if drafter_seq is not None:
            assert tuple(drafter_seq[drafter_prompt_length:]) == generated
        output = GenerationOutput(assembler.text, generated, stats, config, prompts.retrieval, prompts.retrieved_turns)
        yield StreamChunk(text="", token_ids=(), output=output)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.vocab_size]

    def _choose(self, logits: torch.Tensor, config: DecodeConfig, generator) -> torch.Tensor:
        """Next token of plain decoding from [k, V] logits ([k])."""
        if config.greedy:
            return logits.argmax(dim=-1)
        probs = (sampling.filter_logits(logits, config.top_k, config.top_p) / config.temperature).softmax(-1)
        return sampling.sample(probs, generator)

    def _plain_step(self, config, generator, cache, seq) -> list[int]:
        """One step of plain autoregressive decoding (modes lc, rag)."""
        logits = self._logits(cache.forward(seq[cache.length :], num_logits=1))  # [1, V]
        return [int(self._choose(logits, config, generator)[0])]

    def _ends_generation(self, token: int, config: DecodeConfig) -> bool:
        """Whether ``token`` is an EOS that stops generation (never with ``ignore_eos``)."""
        return token in self.eos_token_ids and not config.ignore_eos

    def _draft_row(self, logits: torch.Tensor, config: DecodeConfig, device: torch.device) -> torch.Tensor:
        """What step 4 keeps of a drafter position ([V] -> [V] on ``device``).

        Greedy: the raw logits (q is taken at T = 1). Sampling: q, the filtered
        logits at the temperature, normalised.
        """
        if config.greedy:
            return logits.to(device)
        filtered = sampling.filter_logits(logits[None].to(device), config.top_k, config.top_p)  # [1, V]
        return (filtered / config.temperature).softmax(-1)[0]

    def _speculative_step(self, config, generator, target_cache, target_seq, drafter_cache, drafter_seq, k, sync):
        """One draft/verify round of k drafts (``sync``: time the devices exactly); returns (emitted tokens, its record)."""
        eta, alpha = config.effective_eta, config.draft_gate
        greedy, confidence = config.greedy, config.draft_confidence
        target_device = target_cache.device
        drafter_device = drafter_cache.device

        # 2 draft: feed the pending tokens, then draft up to k tokens one by one
        # (x_k itself is not fed). Rows kept for step 4: q, or the raw logits
        # when greedy (only needed when eta > 0).
        started = time.perf_counter()
        drafts: list[int] = []
        draft_rows: list[torch.Tensor] = []  # each [V], on the target's device
        if k > 0:
            logits = self._logits(drafter_cache.forward(drafter_seq[drafter_cache.length :], 1))[0]  # [V]
            for position in range(k):
                if greedy:
                    if eta > 0:
                        draft_rows.append(self._draft_row(logits, config, target_device))
                    token = int(logits.argmax())
                    unsure = confidence > 0 and sampling.top_probability(logits) < confidence
                else:
                    draft_rows.append(self._draft_row(logits, config, target_device))
                    token = int(sampling.sample(draft_rows[-1][None], generator)[0])
                    unsure = confidence > 0 and float(draft_rows[-1][token]) < confidence
                drafts.append(token)
                if position == k - 1 or unsure or self._ends_generation(token, config):
                    break  # nothing to draft after EOS; an unsure draft likely ends the accepted run
                logits = self._logits(drafter_cache.forward([token], 1))[0]
        if sync:
            _sync(drafter_device)
        draft_seconds = time.perf_counter() - started

        # 3 verify: one target forward over [pending, x_1..x_k].
        started = time.perf_counter()
        pending = target_seq[target_cache.length :]
        target_logits = self._logits(target_cache.forward(pending + drafts, num_logits=len(drafts) + 1))  # [k+1, V]
        if sync:
            _sync(target_device)
        verify_seconds = time.perf_counter() - started

        # 4 accept
        started = time.perf_counter()
        bonus_row, bonus_seconds = None, 0.0  # drafter time inside step 4 counts as drafting
        draft_tensor = torch.tensor(drafts, dtype=torch.long, device=target_device)  # [k]
        rows = torch.stack(draft_rows) if draft_rows else None  # [k, V]
        if greedy:
            choices = sampling.greedy_target_choices(target_logits, rows, eta, alpha)  # [k+1]
            accepted = sampling.greedy_accepted_length(draft_tensor, choices)
            bonus_row, bonus_seconds = self._bonus_row(
                config, drafter_cache, drafter_seq, drafts, accepted, target_device, sync
            )
            if bonus_row is not None:
                bonus = slice(accepted, accepted + 1)
                choices[bonus] = sampling.greedy_target_choices(target_logits[bonus], bonus_row[None], eta, alpha)
            next_token = int(choices[accepted])
        else:
            scaled = sampling.filter_logits(target_logits, config.top_k, config.top_p) / config.temperature
            target_probs = scaled.softmax(-1)  # [k+1, V]
            augmented_probs = target_probs.clone()
            if eta > 0 and rows is not None:
                n_rows = rows.shape[0]
                augmented_probs[:n_rows] = sampling.augmented_logits(
                    scaled[:n_rows], target_probs[:n_rows], rows, eta, alpha
                ).softmax(-1)
            uniforms = torch.rand(len(drafts), generator=generator, device=target_device)  # [k]
            accept = sampling.acceptance_mask(draft_tensor, rows, augmented_probs, uniforms) if drafts else draft_tensor.bool()
            accepted = sampling.accepted_prefix_length(accept)
            i = slice(accepted, accepted + 1)
            if accepted < len(drafts):
                residual = sampling.residual_probs(target_probs[i], rows[i], augmented_probs[i], config.residual)
                next_token = int(sampling.sample(residual, generator)[0])
            else:
                bonus_row, bonus_seconds = self._bonus_row(
                    config, drafter_cache, drafter_seq, drafts, accepted, target_device, sync
                )
                if bonus_row is not None:
                    augmented_probs[i] = sampling.augmented_logits(
                        scaled[i], target_probs[i], bonus_row[None], eta, alpha
                    ).softmax(-1)
                next_token = int(sampling.sample(augmented_probs[i], generator)[0])
        if sync:
            _sync(target_device)
        measured = RoundRecord(
            len(drafts), accepted, draft_seconds + bonus_seconds, len(drafts) + (bonus_row is not None), verify_seconds,
            time.perf_counter() - started - bonus_seconds, len(pending) + len(drafts),
        )
        return drafts[:accepted] + [next_token], measured

    def _bonus_row(
        self, config, drafter_cache, drafter_seq, drafts, accepted, target_device, sync
    ) -> tuple[torch.Tensor | None, float]:
        """The drafter's row at the bonus position k + 1 ([V] or None) and the seconds it took.

        Computed only when it is used: eta > 0 and every draft accepted (and
        the last draft is not an EOS that ends generation). Feeding x_k then
        costs nothing extra, since the next round would feed it anyway.
        """
        if config.effective_eta == 0 or accepted < len(drafts):
            return None, 0.0
        if drafts and self._ends_generation(drafts[-1], config):
            return None, 0.0
        started = time.perf_counter()
        unfed = (drafter_seq + drafts)[drafter_cache.length :]
        logits = self._logits(drafter_cache.forward(unfed, 1))[0]  # [V]
        row = self._draft_row(logits, config, target_device)
        if sync:
            _sync(drafter_cache.device)
        return row, time.perf_counter() - started

