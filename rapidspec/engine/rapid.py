"""The RAPID engine: one generator that drafts, verifies and streams tokens.

:meth:`Rapid.decode` runs the only decode loop of the project (:func:`.rounds.run_rounds`); ``stream`` (a
document and a question), ``stream_chat`` (a conversation), the CLI, the
server, evaluation and benchmarks all consume it. Prompts come from :mod:`rapidspec.prompting.prompts` and
:mod:`rapidspec.prompting.conversation`; target caches are reused through :mod:`rapidspec.runtime.prefix_cache`;
each generation's drafter comes from :mod:`rapidspec.drafting.factory` (the mode table says which). One round::

    1 prefill   target cache <- target prompt[:-1]; the first round is a plain step (the first token is the
                target's); between rounds the drafter is prepared in bounded pieces while it pays and joins
                when ready (:mod:`rapidspec.drafting.join`; ``drafter_start="first"``: before the first round)
    2 draft     the drafter proposes k tokens (k from the gamma schedule; 0 = a plain step)   } run_round
    3 verify    target feeds [pending, x_1..x_k] in ONE forward -> logits z_1..z_{k+1}       }
    4 accept    sampling.verify: accepted prefix, then the recovered or bonus token        }
    5 commit    both caches roll back to the committed tokens (minus the pending last one)   commit_round

The logits processors (a grammar's masks, the penalties: :mod:`rapidspec.verification.processors`) process
the drafter's rows in 2 and the target's in 3 alike and follow the committed tokens in 5. A request's eta
default and gamma schedule are decided once (:mod:`.defaults`). Modes ``lc`` and ``rag`` have no drafter:
every round is a plain step. Caches follow :mod:`rapidspec.runtime.protocol`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from rapidspec.config import DecodeConfig
from rapidspec.drafting.calibration import VERIFY_PROBE_TOKENS, CostBook, EngineCosts
from rapidspec.drafting.eta_default import EtaWarnings
from rapidspec.drafting.factory import DrafterFactory, drop_started
from rapidspec.drafting.gamma_schedule import GammaSchedule
from rapidspec.drafting.join import DrafterJoin
from rapidspec.drafting.lookup import ROUNDS_MIN_NGRAM, LookupDrafter
from rapidspec.drafting.memory import ConversationMemory, prior_estimates
from rapidspec.engine.defaults import resolve
from rapidspec.engine.rounds import Rounds, run_rounds, sync as device_sync
from rapidspec.engine.spec import EngineSpec
from rapidspec.errors import RapidspecError
from rapidspec.grammar import GrammarTokens
from rapidspec.grammar.tools import ToolChoice, template_tokenizer, with_tool_grammar
from rapidspec.models.vocabulary import eos_token_ids
from rapidspec.outputs import GenerationOutput, StreamChunk, last_output
from rapidspec.prompting.conversation import DEFAULT_RECENT_MESSAGES, chat_prompts, parse_documents, parse_messages
from rapidspec.prompting.prompts import PromptPair, PromptTemplate, document_prompts, with_streaming_drafter
from rapidspec.runtime import new_kv_cache
from rapidspec.runtime.errors import PrefillStopped
from rapidspec.runtime.kv_store import DiskKVStore, for_model
from rapidspec.runtime.prefix_cache import GIB, PrefixCache
from rapidspec.stats import GenerationStats
from rapidspec.verification import sampling
from rapidspec.verification.penalties import Penalties
from rapidspec.verification.processors import LogitsProcessors

logger = logging.getLogger(__name__)

# Reuse a stored target cache only when it saves at least this many tokens.
MIN_REUSED_PREFIX_TOKENS = 64


class Rapid:
    """Long-context generation with a retrieval-augmented drafter, built from ``spec``, the one way every
    command, the server, its replicas, eval, bench and tests build an engine.

    ``spec``: an :class:`~rapidspec.engine.spec.EngineSpec` (None: the defaults, the ``builtin`` model
    drafting for itself): the models and the drafter's options (``spec.models``, handed whole to the drafter
    factory), retrieval, the prefill chunk, the caches kept in memory and on disk. The models are loaded from
    ``spec.models``, or passed as what they are: ``target``, a :class:`rapidspec.models.LoadedModel` (anything
    with ``model``, ``tokenizer`` and ``max_context``), and ``drafter``: None drafts with the target's weights
    and a cache of its own (self-speculation); a loaded model or a model name drafts with that model,
    smaller or larger, on any device; its vocabulary must equal the target's. Models passed in replace the
    spec's model names and loading options; its drafter options still apply. ``template``: the prompt of
    a document and a question (:class:`~rapidspec.prompting.prompts.PromptTemplate`).
    """

    def __init__(self, spec: EngineSpec | None = None, *, target=None, drafter=None,
                 template: PromptTemplate | None = None) -> None:
        from rapidspec.retrieval import Retriever

        spec = EngineSpec() if spec is None else spec
        if not isinstance(spec, EngineSpec):
            raise RapidspecError(f"Rapid takes an EngineSpec (models already loaded go in target= and drafter=), "
                                 f"got {type(spec).__name__}")
        if target is None and drafter is not None:
            raise RapidspecError("a drafter passed in needs its target passed in too (target=)")
        if target is None:
            target, drafter = spec.models.load()
        self.spec, self.target, self.tokenizer = spec, target, target.tokenizer
        self.template = template or PromptTemplate()
        self.retriever = Retriever(spec.retrieval, tokenizer=self.tokenizer)
        self.prefill_chunk_tokens, self.reuse_document_cache = spec.prefill_chunk_tokens, spec.reuse_document_cache
        self.prefix_cache = PrefixCache(int(spec.prefix_cache_gib * GIB), MIN_REUSED_PREFIX_TOKENS)
        self._kv_cache = (int(spec.kv_cache_gib * GIB), spec.kv_cache_dir)
        self._disk: DiskKVStore | None = None
        self.eos_token_ids = eos_token_ids(target)
        self.drafting = DrafterFactory(target, drafter, spec.models, spec.prefill_chunk_tokens,
                                       keep=spec.reuse_document_cache, kv_cache=self._kv_cache)
        self.vocab_size = self.drafting.vocab_size
        self.grammar_tokens = GrammarTokens(self.tokenizer, max(self.vocab_size, len(self.tokenizer)),
                                            self.eos_token_ids)
        self._eta_warnings = EtaWarnings()
        self._costs = EngineCosts(CostBook(), target, self.drafting, self.retriever, self.eos_token_ids)
        # each conversation's earlier answers (their acceptance, the drafter cache they left): the join's plan reads it
        self.memory = ConversationMemory()

    def resolve(self, config: DecodeConfig) -> tuple[DecodeConfig, str | None]:
        """``config`` with the eta default of this engine's drafter and a concrete gamma schedule, and where its
        eta came from (:func:`rapidspec.engine.defaults.resolve`): what a generation runs and reports."""
        return resolve(config, self.drafter_relation)

    @property
    def costs(self):
        """The machine's step costs this engine reads (a :class:`~rapidspec.drafting.calibration.CostBook`); settable."""
        return self._costs.book

    @costs.setter
    def costs(self, book) -> None:
        self._costs.book = book

    @property
    def drafter(self):
        """The torch drafter model (the target for self-speculation), loaded on first use when given by name."""
        return self.drafting.model

    @property
    def drafter_backend(self) -> str:
        """What drafts by default: ``torch`` or ``llama.cpp`` (``auto`` resolved once)."""
        return self.drafting.backend

    @property
    def drafter_label(self) -> str:
        """What drafts by default, e.g. ``self (llama.cpp, SmolLM2-135M-Instruct, Q8_0 copy of Q4_1)``."""
        return self.drafting.label

    @property
    def drafter_relation(self) -> str:
        """``self``, ``larger`` or ``smaller``: what decides the default eta (:mod:`rapidspec.drafting.eta_default`)."""
        return self.drafting.relation

    # ------------------------------------------------------------------ API
    def calibrate(self, config: DecodeConfig | None = None, contexts: Sequence[int] = (), again: bool = False,
                  embedder: bool = False, progress=None) -> list[dict]:
        """Load ``config``'s drafter and measure its step and prefill costs now where this machine has none kept
        (:mod:`rapidspec.drafting.calibration`), so that the first generation does not spend that time (nothing to
        do for modes without a model drafter); with ``contexts``, the target's verify costs at those context
        lengths too (on a cache of filler tokens, prefilled with ``progress(done, total)``); with ``embedder`` and
        a retrieval that embeds (dense, hybrid, auto), the embedder's cost. ``again``: measure even what is kept.
        A context the prefix cache holds is measured on a copy of its entry, with no prefill; a context whose
        costs are kept (and ``again`` not set) makes no cache. Returns the engine's entries."""
        self._costs.calibrate(config or DecodeConfig(), contexts, again, embedder, self.prefill_chunk_tokens, progress,
                              lambda tokens: self.prefix_cache.longest_copy(tokens, tokens + VERIFY_PROBE_TOKENS))
        return self.costs.entries()

    def generate(self, document: str, question: str, **options) -> GenerationOutput:
        """Generate an answer; same options as :meth:`stream`."""
        return last_output(self.stream(document, question, **options))

    def chat(self, messages, **options) -> GenerationOutput:
        """Answer the last user message of a conversation; same options as :meth:`stream_chat`."""
        return last_output(self.stream_chat(messages, **options))

    def stream(self, document: str, question: str, *, query: str | None = None, corpus: str | None = None,
               retriever=None, template: PromptTemplate | None = None, config: DecodeConfig | None = None,
               generator: torch.Generator | None = None, profile: bool = False, observer=None, prefill_progress=None,
               **options) -> Iterator[StreamChunk]:
        """Yield the answer to ``question`` about ``document`` as it is generated.

        ``options`` are :class:`DecodeConfig` fields (``mode``, ``eta``, ...) or
        pass a ready ``config``; ``query`` is what retrieval searches for
        (default: the question); ``corpus`` what it searches in (default: the
        document; another text gives the drafter unrelated chunks on purpose);
        ``retriever`` and ``template`` replace the engine's for this call;
        the rest as in :meth:`decode`.
        """
        config = DecodeConfig.from_options(config, options)
        prompts = self.document_prompts(document, question, config, query=query, corpus=corpus, retriever=retriever,
                                        template=template)
        yield from self.decode(prompts, config, generator=generator, profile=profile, observer=observer,
                               prefill_progress=prefill_progress)

    def stream_chat(self, messages, *, documents=None, query: str | None = None,
                    recent_messages: int = DEFAULT_RECENT_MESSAGES, retriever=None, config: DecodeConfig | None = None,
                    tools: ToolChoice | None = None, generator: torch.Generator | None = None, profile: bool = False,
                    observer=None, prefill_progress=None, **options) -> Iterator[StreamChunk]:
        """Yield the answer to the last user message of ``messages`` (OpenAI-style dicts).

        ``documents``: texts or ``{"title", "text"}``; without them the earlier
        turns are the drafter's corpus (:mod:`rapidspec.prompting.conversation`);
        ``retriever`` replaces the engine's for this call; ``tools``: a
        :class:`~rapidspec.grammar.tools.ToolChoice` (the calls come back as
        text, :func:`~rapidspec.grammar.tools.parse_tool_calls` reads them).
        """
        config = with_tool_grammar(DecodeConfig.from_options(config, options), tools, self.tokenizer)
        prompts = self.chat_prompts(messages, config, documents=documents, query=query, recent_messages=recent_messages,
                                    retriever=retriever, tools=tools)
        yield from self.decode(prompts, config, generator=generator, profile=profile, observer=observer,
                               prefill_progress=prefill_progress)

    def document_prompts(self, document: str, question: str, config: DecodeConfig, query: str | None = None,
                         corpus: str | None = None, retriever=None,
                         template: PromptTemplate | None = None) -> PromptPair:
        """The target's and drafter's prompts of a (document, question) pair (the options as in :meth:`stream`);
        with ``config.drafter_start="auto"`` retrieval waits for the drafter's preparation (``PromptPair.deferred``)."""
        target_window, drafter_window = self._windows(config)
        return document_prompts(
            self.tokenizer, template or self.template, retriever or self.retriever, document, question, config,
            target_window, drafter_window, query=query, corpus=corpus, defer=config.drafter_start == "auto",
        )

    def chat_prompts(self, messages, config: DecodeConfig, *, documents=None, query: str | None = None,
                     recent_messages: int = DEFAULT_RECENT_MESSAGES, raw: bool = False, retriever=None,
                     tools: ToolChoice | None = None) -> PromptPair:
        """The prompts of a conversation; ``raw`` skips the chat template, ``retriever`` replaces the engine's,
        ``tools`` go into the chat template (RapidspecError when the model's template has none)."""
        target_window, drafter_window = self._windows(config)
        pair = chat_prompts(
            template_tokenizer(self.tokenizer, tools), retriever or self.retriever, parse_messages(messages),
            parse_documents(documents), mode=config.mode,
            target_window=target_window, drafter_window=drafter_window, truncate=config.truncate, query=query,
            recent_messages=recent_messages, raw=raw, defer=config.drafter_start == "auto",
        )
        return with_streaming_drafter(pair, config, drafter_window)

    def decode(self, prompts: PromptPair, config: DecodeConfig, *, generator: torch.Generator | None = None,
               profile: bool = False, observer=None, schedule: GammaSchedule | None = None,
               should_stop: Callable[[], bool] | None = None,
               prefill_progress: Callable[[int, int], None] | None = None,
               yield_prefill_chunks: bool = False,
               prefill_chunk_limit: Callable[[], int | None] | None = None) -> Iterator[StreamChunk]:
        """Prefill and decode ``prompts`` (from :meth:`document_prompts` or :meth:`chat_prompts`).

        ``generator`` overrides the seeded one for sampling; ``profile`` syncs the device around each phase
        (exact times on GPUs); ``observer(target_cache, target_seq, drafter_cache, drafter_seq)`` is called
        after every round's rollback (read only; the drafter's cache is None for ``lookup``); ``schedule``
        replaces the config's gamma schedule (:mod:`rapidspec.drafting.gamma_schedule`). Closing the iterator stops
        after the current round; ``should_stop()`` is asked between the target's prefill chunks, and a yes
        ends the prefill with :class:`~rapidspec.runtime.errors.PrefillStopped` (a cancelled request);
        ``prefill_progress(done, total)`` hears of each target prefill chunk (a progress bar);
        ``yield_prefill_chunks`` yields an empty chunk after each, its ``prefill`` saying how far it got (a caller
        interleaving generations; run them all inside ``torch.inference_mode()``, as the server's worker does), and
        ``prefill_chunk_limit()``, asked before each chunk, may make the next one shorter (None: no limit; a
        limited chunk of a lean target yields an empty chunk without ``prefill`` between its layers too). A
        prefill stopped or closed early keeps what it read (the prefix cache and the disk) for the next request.
        ``config.time_limit_s`` ends the answer with stop reason ``time`` (a RapidspecError when the prefill alone
        takes longer).
        """
        generation_started = time.perf_counter()
        config, eta_source = resolve(config, self.drafter_relation, self._eta_warnings)
        previous = self.memory.lookup(prompts.target_ids)  # the conversation's earlier answers, never other requests'
        stats = GenerationStats.starting(config, prompts)
        stats.eta_source = eta_source
        deadline = None if config.time_limit_s is None else time.monotonic() + config.time_limit_s

        def out_of_time() -> bool:
            return deadline is not None and time.monotonic() > deadline

        run = self._rounds(config, prompts, stats, generator, out_of_time, profile, schedule, generation_started)
        with torch.inference_mode():
            # 1 prefill
            started, target_device = time.perf_counter(), self.target.model.device
            use_store = self.reuse_document_cache and not prompts.target_reads_retrieved
            room = len(run.target_seq) + config.max_new_tokens + config.max_gamma + 1  # all a generation can hold
            beside = self.drafting.start_beside(prompts, config, stats, target_device)  # None: drafter after target
            try:
                run.target_cache = yield from self._prefill_target(
                    run.target_seq, stats, use_store, room, lambda: out_of_time() or (should_stop is not None and should_stop()),
                    prefill_progress, yield_prefill_chunks, prefill_chunk_limit)
            except BaseException as error:
                drop_started(beside)
                if isinstance(error, PrefillStopped) and out_of_time():
                    raise RapidspecError(f"the prefill of {len(run.target_seq)} prompt tokens did not finish within "
                                         f"time_limit_s={config.time_limit_s:g}", code="time_limit_exceeded") from None
                raise
            device_sync(target_device)
            stats.target_prefill_seconds = time.perf_counter() - started
            acceptance = prior_estimates(config.max_gamma) if previous is None else previous.estimates(config.max_gamma)
            run.join = DrafterJoin(self.drafting, prompts, config, stats, target_device, self._costs, acceptance,
                                   [] if previous is None else previous.kept(), beside)
            if self.drafting.drafter_kind(config) == "model" and config.drafter_start != "first":
                run.lookup = LookupDrafter(list(run.target_seq), self.vocab_size, target_device,  # until it joins
                                           min_ngram=ROUNDS_MIN_NGRAM)
            # 2-5 decode (a closed stream stops at a yield, after a round's rollback, so its cache is consistent too)
            consistent = False  # an error inside a round may leave a cache half-written: then keep neither
            try:
                if config.drafter_start == "first":
                    run.prepare_drafter_now()
                yield from run_rounds(run, prompts, self.tokenizer, observer)
                consistent = True
            except GeneratorExit:
                consistent = True
                raise
            finally:
                self._finish(run, prompts, previous, use_store, consistent)

    def _rounds(self, config: DecodeConfig, prompts: PromptPair, stats: GenerationStats, generator, out_of_time,
                profile: bool, schedule: GammaSchedule | None, started: float) -> Rounds:
        """A generation's round state before its prefill: the seeded generator, the grammar (started before any
        work; ``ignore_eos``: the answer ends where the grammar does), the penalties, the end-of-answer tokens."""
        device = self.target.model.device
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(config.seed if config.seed is not None else secrets.randbits(63))
        grammar = (None if config.grammar is None
                   else self.grammar_tokens.start(config.grammar, eos_only_at_end=config.ignore_eos))
        processors = LogitsProcessors(grammar, Penalties.of(config, prompts.target_ids, self.vocab_size, device))
        stop_tokens = frozenset() if config.ignore_eos and grammar is None else self.eos_token_ids
        return Rounds(started=started, config=config, params=sampling.SamplingParams.of(config), stats=stats,
                      generator=generator, stop_tokens=stop_tokens, vocab=self.vocab_size, out_of_time=out_of_time,
                      processors=processors, sync=profile, target_seq=list(prompts.target_ids), fixed_schedule=schedule)

    def _finish(self, run: Rounds, prompts: PromptPair, previous, use_store: bool, consistent: bool) -> None:
        """After the last round, or an error in one (``consistent`` False: keep no cache): close the join and the
        drafter, keep the target's cache, and remember what the answer taught the conversation's join."""
        run.join.close()
        if run.drafter is not None:
            run.drafter.close(keep=consistent)
        if use_store and consistent:
            self._keep(run.target_cache)
        if consistent and self.drafting.drafter_kind(run.config) == "model":
            drafter_ids = () if run.join.prompts.deferred is not None else run.join.prompts.drafter_ids or ()
            left = [*drafter_ids[:-1], *run.target_seq[len(prompts.target_ids):]] if drafter_ids else ()
            self.memory.record(prompts.target_ids, previous, run.stats.drafted_per_position,
                               run.stats.accepted_per_position, left)

    @property
    def disk_store(self) -> DiskKVStore | None:
        """The target's key/value blocks on disk (:mod:`rapidspec.runtime.kv_store`), made on first use; None
        with ``kv_cache_gib=0``."""
        max_bytes, folder = self._kv_cache
        if self._disk is None and max_bytes:
            self._disk = for_model(self.target, max_bytes, folder)
        return self._disk

    def clear_document_cache(self) -> None:
        """Forget every stored target cache and the drafters' kept caches (the next prefills start from scratch)."""
        self.prefix_cache.clear()
        self.drafting.clear()

    # ------------------------------------------------------------ internals
    def _windows(self, config: DecodeConfig) -> tuple[int, int]:
        """Prompt tokens that fit the target's and the drafter's windows with the answer."""
        window = min(self.target.max_context, config.max_model_len or self.target.max_context)
        target_window = window - config.max_new_tokens
        if target_window < 16:
            raise RapidspecError(f"max_new_tokens={config.max_new_tokens} leaves no room for the prompt in the "
                                 f"{window}-token window", param="max_tokens", code="context_length_exceeded")
        drafter_context = self.drafting.max_context(config) or window
        drafter_context = min(drafter_context, config.max_model_len or drafter_context)
        return target_window, max(16, drafter_context - config.max_new_tokens)

    def _keep(self, cache) -> None:
        """Hand ``cache`` to the disk (written in the store's thread; nothing changes it) and the prefix cache (it is
        the store's from now on). The disk first: while its write is pending no entry is taken (:meth:`_may_take`)."""
        if self.disk_store is not None:
            self.disk_store.write(cache)
        self.prefix_cache.store(cache)

    def _may_take(self) -> bool:
        """Whether a lookup may take a prefix-cache entry instead of copying it: not while the disk's writer may
        still read one (asked under the prefix cache's lock, after any entry's write was handed over)."""
        return self.disk_store is None or not self.disk_store.writing()

    def _prefill_target(self, token_ids: list[int], stats: GenerationStats, use_store: bool, room: int, should_stop,
                        progress=None, ticks: bool = False, chunk_limit=None):
        """A generator: prefills ``token_ids[:-1]`` from a stored cache sharing a prefix (with ``ticks``, an empty
        chunk after each prefill chunk saying how far it got); returns the cache, allocated once with ``room``
        positions (the generation never grows it). Stopped or closed early, it keeps what it read (``use_store``)."""
        wanted, cache = token_ids[:-1], None
        if use_store:
            cache, stats.target_prefill_reused_tokens = self.prefix_cache.lookup(wanted, room, self._may_take)
        if cache is None:
            cache = new_kv_cache(self.target, self.prefill_chunk_tokens)
        cache.reserve(room)
        if use_store and self.disk_store is not None:
            stats.target_prefill_disk_tokens = self.disk_store.extend(cache, wanted)
            stats.target_prefill_reused_tokens = cache.length
        try:
            for done in cache.prefill_chunks(wanted[cache.length :], should_stop, progress, chunk_limit):
                if ticks:  # done None: between two layers of a limited chunk (no news)
                    yield StreamChunk(text="", prefill=None if done is None else (cache.length, len(wanted)))
        except (PrefillStopped, GeneratorExit):  # a cancelled request: the next one starts from what was read
            if use_store:
                self._keep(cache)
            raise
        return cache
