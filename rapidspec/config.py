"""The bottom layer: the mode table, the option enumerations and the frozen, validated :class:`DecodeConfig`.

Every other part of rapidspec (prompts, conversations, drafting, the engine,
the server's request schema, benchmarks, evaluation) asks the mode table here
instead of keeping a set of its own::

    mode      target reads   drafter reads  drafter kind  eta > 0
    lc        full           -              -             no
    rag       retrieved      -              -             no
    sd        full           full           model         no
    ragsd     full           retrieved      model         no
    rapid     full           retrieved      model         yes
    magicdec  full           streaming      model         no
    lookup    full           retrieved      lookup        no

``model`` drafts with a language model (the target's weights or another
model, on torch or llama.cpp); ``lookup`` copies the continuation of the
latest earlier match of the last n tokens (prompt lookup,
:mod:`rapidspec.drafting.lookup`). The CLI and the server's request fields
map onto :class:`DecodeConfig` one to one; invalid values raise
:class:`rapidspec.errors.RapidspecError` with a one-line message. This module
imports nothing of rapidspec but :mod:`rapidspec.errors` and :mod:`rapidspec.grammar.spec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from rapidspec.errors import RapidspecError
from rapidspec.grammar.spec import Grammar

Reads = Literal["full", "retrieved", "streaming"]


@dataclass(frozen=True)
class ModeSpec:
    target_reads: Literal["full", "retrieved"]
    drafter_reads: Reads | None = None
    drafter_kind: Literal["model", "lookup"] | None = None
    eta: bool = False  # whether eta > 0 is allowed

    @property
    def uses_retrieval(self) -> bool:
        return "retrieved" in (self.target_reads, self.drafter_reads)


MODE_TABLE: dict[str, ModeSpec] = {
    "lc": ModeSpec("full"),
    "rag": ModeSpec("retrieved"),
    "sd": ModeSpec("full", "full", "model"),
    "ragsd": ModeSpec("full", "retrieved", "model"),
    "rapid": ModeSpec("full", "retrieved", "model", eta=True),
    "magicdec": ModeSpec("full", "streaming", "model"),
    "lookup": ModeSpec("full", "retrieved", "lookup"),
}
MODES: tuple[str, ...] = tuple(MODE_TABLE)

# Views of the table, for membership tests.
TARGET_READS_RETRIEVED = frozenset(m for m, s in MODE_TABLE.items() if s.target_reads == "retrieved")
USES_DRAFTER = frozenset(m for m, s in MODE_TABLE.items() if s.drafter_kind is not None)
USES_RETRIEVAL = frozenset(m for m, s in MODE_TABLE.items() if s.uses_retrieval)

#: The dtype names a user may give (``auto`` picks bfloat16 where it is native, else float32).
DTYPE_NAMES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
#: Accepted values of ``runtime``: the lean forward where the architecture has one
#: (``auto``), always (``lean``, an error where it has none), or never.
RUNTIMES: tuple[str, ...] = ("auto", "lean", "transformers")
#: What a model's linear layers can be loaded as: the float copy, int8 or int4 rounded from it, or the
#: low-bit blocks of its GGUF file (:mod:`rapidspec.runtime.gguf_linears`).
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4", "gguf")
#: The ``quantize`` options of a target: ``auto`` is ``gguf`` for a GGUF file on the CPU, else ``none``.
TARGET_QUANTIZATIONS: tuple[str, ...] = ("auto", *QUANTIZATIONS)
#: The options :func:`rapidspec.runtime.quantization.quantize_linears` rounds a float model to.
ROUNDED_QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")
#: When a llama.cpp drafter prefills its prompt: ``auto`` beside the target's prefill where the CPU has
#: cores to spare for the drafter's threads (:func:`rapidspec.drafting.factory.spare_cores`), else after
#: it; ``beside``; ``after``.
DRAFTER_PREFILLS: tuple[str, ...] = ("auto", "beside", "after")
#: What ``drafter_gguf`` may be: ``auto`` (a copy of the types llama.cpp prefills slowly) or ``as-is``.
DRAFTER_GGUF_CHOICES: tuple[str, ...] = ("auto", "as-is")
#: The default bound of an engine's prefix cache.
DEFAULT_PREFIX_CACHE_GIB = 2.0
#: The default bound of the target's key/value blocks on disk (:mod:`rapidspec.runtime.kv_store`), all models.
DEFAULT_KV_CACHE_GIB = 8.0
#: What runs a model drafter (:mod:`rapidspec.models.backend`): the engine's default, torch or llama.cpp.
DRAFTER_BACKENDS: tuple[str, ...] = ("auto", "torch", "llama.cpp")
#: StreamingLLM's attention sinks (the RAPID paper's MagicDec: SinkCache(window_length=4096, num_sink_tokens=4)).
DEFAULT_SINK_TOKENS = 4
#: Tokens magicdec's drafter view holds, sinks included (the same baseline's window).
DEFAULT_STREAMING_TOKENS = 4096
GAMMA_SCHEDULES: tuple[str, ...] = ("auto", "constant", "heuristic", "cost")
#: How tokens are recovered after a rejection (``DecodeConfig.residual``) and how a long document fits (``truncate``).
RESIDUALS: tuple[str, ...] = ("exact", "paper")
TRUNCATIONS: tuple[str, ...] = ("middle", "error")
#: When the drafter is prepared (``DecodeConfig.drafter_start``).
DRAFTER_STARTS: tuple[str, ...] = ("auto", "first")
#: Target prompt tokens per prefill forward (an engine's default; a drafter's torch cache takes the same). The
#: runtime, which imports nothing above it, has its own default for a cache made without an engine
#: (:data:`rapidspec.runtime.cache.PREFILL_CHUNK_TOKENS`, the same number: tests/test_layout.py).
DEFAULT_PREFILL_CHUNK_TOKENS = 2048
#: Smallest temperature that samples; below it logits / T overflow (0 is greedy).
MIN_TEMPERATURE = 1e-5
#: The largest temperature and eta: z / T and eta * g stay finite in float32 (and far past any useful value).
MAX_TEMPERATURE = 1e4
MAX_ETA = 1e4
#: Upper bounds of the knobs that size memory or work, so no request can ask for gigabytes (a server's
#: requests map onto these fields): drafted tokens per round, token counts, stop strings, top log-probs.
MAX_GAMMA = 64
MAX_TOKENS = 1 << 20
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
#: Tokens a server's prefill step feeds while other requests run or wait (``ServerConfig.shared_prefill_tokens``).
#: The default model prefilled 8K tokens at 159 tokens/s in 64-token pieces and 201 in 2,048-token chunks on
#: 2 CPU cores (docs/serving.md, "Beside expensive requests"): the pieces cost while they let others in.
SHARED_PREFILL_TOKENS = 64

@dataclass(frozen=True)
class DecodeConfig:
    """How to decode. See README "Modes and knobs".

    * ``mode``: ``lc`` | ``rag`` | ``sd`` | ``ragsd`` | ``rapid`` | ``magicdec`` | ``lookup``
      (:data:`MODE_TABLE`).
    * ``drafter_backend``: ``auto`` (the engine's default), ``torch`` or
      ``llama.cpp``: what runs a model drafter (:mod:`rapidspec.drafting.backends`).
    * ``sink_tokens``, ``streaming_tokens``: mode ``magicdec``'s drafter reads
      the first ``sink_tokens`` and the last ``streaming_tokens - sink_tokens``
      tokens of the target's prompt (a StreamingLLM cache, :mod:`rapidspec.drafting.streaming`).
    * ``eta``: strength of the retrieval-augmented target (paper's eta). Only
      ``rapid`` uses it; ``None`` means the default of the drafter's relation to
      the target for ``rapid`` (:func:`rapidspec.engine.resolve` decides it, :mod:`rapidspec.drafting.eta_default`)
      and 0 otherwise (greedy compares logits at temperature 1, where eta = 5
      shifts as much as the paper's eta = 50 at T = 0.1).
    * ``gamma``: drafted tokens per round. ``gamma_schedule="heuristic"``
      grows it by 2 after a fully accepted round and shrinks it by 1 otherwise
      (between 1 and ``max_gamma``), as transformers' assisted generation does.
      ``"cost"`` drafts the k in [0, ``max_gamma``] with the most expected
      tokens per second from the machine's calibrated step costs
      (:mod:`rapidspec.drafting.calibration`) and the answer's own acceptance
      so far; k = 0 is a plain target step, whose token follows p even when
      eta > 0, taken only when every drafting round is expected to be slower
      per token (:mod:`rapidspec.drafting.gamma_schedule`). Its choices never
      follow the clock: a request gets the same rounds alone, in a batch or on
      a busy machine. ``"constant"`` drafts ``gamma`` every round.
      ``"auto"`` (default) is ``cost`` (:func:`rapidspec.engine.resolve` decides it).
    * ``drafter_start``: ``auto`` (default): the first token is the target's
      (plain step after its prefill); retrieval and the drafter's prefill run
      in bounded pieces between the next rounds, only while the expected
      saving over the rest of the answer exceeds their cost, and the drafter
      joins once ready (:mod:`rapidspec.drafting.join`). ``first``: both run
      before the first round and every round may draft (the paper's setting).
    * ``draft_confidence``: a round stops drafting after a token the drafter
      gave a probability below this (q at temperature 1 when greedy, else the
      filtered q it was sampled from); 0 = always draft ``gamma`` tokens. The
      paper's code stops at 0.1 (transformers' ``assistant_confidence_threshold``).
    * ``temperature``: 0 is greedy, > 0 samples.
    * ``top_k`` (0 = off), ``top_p`` in (0, 1]: filters applied to both the
      target and the drafter logits before the temperature softmax.
    * ``frequency_penalty``, ``presence_penalty`` in [-2, 2] (OpenAI's: minus
      the count of a token in the answer so far times the first, minus the
      second once it occurs) and ``repetition_penalty`` in (0, 10]
      (transformers' and vLLM's: a token of the prompt or the answer has its
      logit divided by it when positive, multiplied when negative; 1 = off).
      Applied to the target's and the drafter's logits alike along each
      drafted path, before the temperature (:mod:`rapidspec.verification.penalties`).
    * ``draft_gate``: alpha of the gate ``q >= alpha * max(q)``.
    * ``residual``: ``exact`` (tokens follow p^) or ``paper`` (Eq. 10).
    * ``max_new_tokens``, ``stop``: stop strings, ``seed``: for sampling.
    * ``ignore_eos``: keep generating after an end-of-sequence token until
      ``max_new_tokens`` (benchmarks with a fixed answer length, as vLLM's).
    * ``truncate``: a document longer than the window is middle-truncated
      (``middle``) or refused (``error``).
    * ``max_model_len``: the window (prompt and answer, in tokens) a
      generation may use, at most the target's; None = the target's.
    * ``time_limit_s``: seconds a generation may run (prefill included; the
      queue of a server not counted): the answer ends there with stop reason
      ``time``; a prefill that does not finish in time is an error. None = no limit.
    * ``logprobs``: None = off; n >= 0 = report each answer token's
      log-probability and the n most likely tokens at its position, under the
      distribution the token follows (p, or p^ for ``rapid``; at temperature 1
      without filters when greedy), at most 20.
    * ``grammar``: what the answer must match (:class:`~rapidspec.grammar.Grammar`:
      a JSON schema, any JSON object, Lark or a regex), or None. Also takes
      OpenAI's ``response_format`` dict or a Pydantic model class. Drafts and
      verification are masked alike; the answer ends once the grammar is complete.

    Counts are bounded (:data:`MAX_GAMMA`, :data:`MAX_TOKENS`, :data:`MAX_STOP_STRINGS`).
    """

    mode: str = "rapid"  # MODES
    eta: float | None = None
    gamma: int = 6
    gamma_schedule: str = "auto"  # GAMMA_SCHEDULES
    max_gamma: int = 16
    drafter_start: str = "auto"  # DRAFTER_STARTS
    draft_confidence: float = 0.0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_gate: float = 0.1
    residual: str = "exact"  # RESIDUALS
    max_new_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    truncate: str = "middle"  # TRUNCATIONS
    sink_tokens: int = DEFAULT_SINK_TOKENS
    streaming_tokens: int = DEFAULT_STREAMING_TOKENS
    drafter_backend: str = "auto"  # DRAFTER_BACKENDS
    max_model_len: int | None = None
    time_limit_s: float | None = None
    logprobs: int | None = None
    grammar: Grammar | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RapidspecError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.eta is not None:
            if not (0 <= self.eta <= MAX_ETA):  # NaN fails too
                raise RapidspecError(f"eta must be a number in [0, {MAX_ETA:g}], got {self.eta}")
            if self.eta > 0 and not MODE_TABLE[self.mode].eta:
                raise RapidspecError(f"eta applies to mode 'rapid' only; mode {self.mode!r} uses eta = 0")
        _check_count("gamma", self.gamma, 1, MAX_GAMMA)
        _check_count("max_gamma", self.max_gamma, 1, MAX_GAMMA)
        if self.gamma_schedule not in GAMMA_SCHEDULES:
            raise RapidspecError(f"gamma_schedule must be one of {', '.join(GAMMA_SCHEDULES)}, got {self.gamma_schedule!r}")
        if self.drafter_start not in DRAFTER_STARTS:
            raise RapidspecError(f"drafter_start must be one of {', '.join(DRAFTER_STARTS)}, got {self.drafter_start!r}")
        if self.max_gamma < self.gamma:
            raise RapidspecError(f"max_gamma ({self.max_gamma}) must be >= gamma ({self.gamma})")
        if not (0.0 <= self.draft_confidence < 1.0):
            raise RapidspecError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if not (0 <= self.temperature <= MAX_TEMPERATURE):
            raise RapidspecError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf
            raise RapidspecError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature:g}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise RapidspecError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        _check_count("top_k", self.top_k, 0, MAX_TOKENS)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise RapidspecError(f"{name} must be a number in [-2, 2], got {value!r}")
        if (isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float))
                or not 0.0 < self.repetition_penalty <= 10.0):
            raise RapidspecError(f"repetition_penalty must be a number in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RapidspecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.draft_gate <= 1.0):
            raise RapidspecError(f"draft_gate must be in [0, 1], got {self.draft_gate}")
        if self.residual not in RESIDUALS:
            raise RapidspecError(f"residual must be 'exact' or 'paper', got {self.residual!r}")
        _check_count("max_new_tokens", self.max_new_tokens, 1, MAX_TOKENS)
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s or len(s) > 1000 for s in self.stop):
            raise RapidspecError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most 1000 characters")
        if self.truncate not in TRUNCATIONS:
            raise RapidspecError(f"truncate must be 'middle' or 'error', got {self.truncate!r}")
        _check_count("sink_tokens", self.sink_tokens, 0, MAX_TOKENS)
        _check_count("streaming_tokens", self.streaming_tokens, self.sink_tokens + 16, MAX_TOKENS)
        if self.drafter_backend not in DRAFTER_BACKENDS:
            raise RapidspecError(f"drafter_backend must be one of {', '.join(DRAFTER_BACKENDS)}, got {self.drafter_backend!r}")
        if self.max_model_len is not None:
            _check_count("max_model_len", self.max_model_len, 32, MAX_TOKENS)
        if self.time_limit_s is not None and (isinstance(self.time_limit_s, bool) or not isinstance(self.time_limit_s, (int, float))
                                              or not math.isfinite(self.time_limit_s) or self.time_limit_s <= 0):
            raise RapidspecError(f"time_limit_s must be a number of seconds > 0 or None, got {self.time_limit_s!r}")
        if self.logprobs is not None:
            _check_count("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "grammar", Grammar.of(self.grammar))

    @property
    def eta_value(self) -> float:
        """The eta the rounds use: the config's, 0 outside ``rapid``. A ``rapid`` config without one is not
        resolved yet: :func:`rapidspec.engine.resolve` fills in the default of the drafter's relation."""
        if not MODE_TABLE[self.mode].eta:
            return 0.0
        if self.eta is None:
            raise ValueError("eta is decided by the engine: resolve the config first (rapidspec.engine.resolve)")
        return float(self.eta)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_options(cls, config: DecodeConfig | None, options: dict) -> DecodeConfig:
        """``config`` with ``options`` (field values) changed, or a new config of ``options`` when it is None."""
        return config.with_(**options) if config is not None else cls(**options)

    def with_(self, **changes) -> "DecodeConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def with_mode(self, mode: str, **changes) -> "DecodeConfig":
        """A copy in ``mode``: its eta is kept where the mode takes one, else reset (eta applies to rapid only)."""
        return replace(self, mode=mode, eta=self.eta if MODE_TABLE[mode].eta else None, **changes)


def _check_count(name: str, value: object, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise RapidspecError(f"{name} must be an integer in [{minimum}, {maximum}], got {value!r}")
