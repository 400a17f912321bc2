"""What an engine is built from, decided once: :class:`EngineSpec`.

The command line builds one from its options, one to one
(:func:`rapidspec.cli.options.engine_spec`); every command, the server, its
Ray Serve replicas, ``rapidspec eval`` (local and on Ray actors) and
``rapidspec bench`` pass it to :class:`rapidspec.Rapid`, the one way
they build an engine, so no option is dropped on the way and a process on
another machine builds exactly what the command named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rapidspec.config import DEFAULT_KV_CACHE_GIB, DEFAULT_PREFILL_CHUNK_TOKENS, DEFAULT_PREFIX_CACHE_GIB
from rapidspec.errors import RapidspecError
from rapidspec.models.spec import ModelSpec
from rapidspec.retrieval.config import RetrievalConfig


@dataclass(frozen=True)
class EngineSpec:
    """The models and every drafter option (``models``, a :class:`~rapidspec.models.spec.ModelSpec`:
    target, drafter, dtype, device, quantization, runtime, drafter backend, threads, prefill, GGUF choice),
    retrieval, whether the engine keeps caches for later prompts sharing a prefix (``reuse_document_cache``), the
    target's prefill chunk, the memory for kept target caches (``prefix_cache_gib``), and its key/value blocks on disk
    (``kv_cache_gib``, 0 = none; ``kv_cache_dir``, None = ``$RAPIDSPEC_KV_CACHE`` or ``<cache>/kv``)."""

    models: ModelSpec = field(default_factory=ModelSpec)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    reuse_document_cache: bool = True
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB
    kv_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.models, ModelSpec):
            raise RapidspecError(f"models must be a ModelSpec, got {type(self.models).__name__}")
        if not isinstance(self.retrieval, RetrievalConfig):
            raise RapidspecError(f"retrieval must be a RetrievalConfig, got {type(self.retrieval).__name__}")
        if isinstance(self.prefill_chunk_tokens, bool) or not isinstance(self.prefill_chunk_tokens, int) \
                or self.prefill_chunk_tokens < 1:
            raise RapidspecError(f"prefill_chunk_tokens must be an integer >= 1, got {self.prefill_chunk_tokens!r}")
        if isinstance(self.prefix_cache_gib, bool) or not isinstance(self.prefix_cache_gib, (int, float)) \
                or not self.prefix_cache_gib >= 0:
            raise RapidspecError(f"prefix_cache_gib must be a number >= 0, got {self.prefix_cache_gib!r}")
        if isinstance(self.kv_cache_gib, bool) or not isinstance(self.kv_cache_gib, (int, float)) \
                or not self.kv_cache_gib >= 0:
            raise RapidspecError(f"kv_cache_gib must be a number >= 0, got {self.kv_cache_gib!r}")
        if self.kv_cache_dir is not None and (not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir.strip()):
            raise RapidspecError(f"kv_cache_dir must be a folder's path, got {self.kv_cache_dir!r}")
