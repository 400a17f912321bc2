"""Grouped-query attention without repeating key/value heads.

transformers' ``sdpa`` attention repeats key/value heads (``repeat_kv``) for
every layer whenever an attention mask is present, which is the case when the
target verifies several drafted tokens against a cache: at 8K tokens that copy
costs a large share of a verify forward on CPU. This module registers an
attention function under the name :data:`ATTENTION` through transformers'
public ``AttentionInterface`` (and the same masks as ``sdpa`` through
``AttentionMaskInterface``); load a model with ``attn_implementation=ATTENTION``
to use it. Nothing of transformers is patched. Two paths:

* **Short queries on CPU where it is faster** (decode steps and
  verification, at most :data:`MATMUL_MAX_QUERY` tokens, see
  :func:`short_query_path`; which path wins depends on the CPU, so it is
  measured once per machine and shape class and kept, below): the query
  heads of each key/value group are stacked into one matrix, so attention is
  two matrix products per key/value head (or two batched products over all
  of them, or the second one split along the keys so that every thread
  shares one head's long sum, or the scores computed as keys x queries, which
  reads a long cache faster for a few query rows) straight on the cached keys and values (no
  head repetition, no upcast of the cache). On 2 CPU cores, per layer of Qwen2.5-1.5B at 16K
  keys in bfloat16, PyTorch's ``scaled_dot_product_attention`` took about
  19 ms for one query (12.7 ms for 7), this path 0.7 ms (3.2 ms). Scores and
  probabilities are held in the model's dtype (rounded where transformers'
  ``eager`` attention rounds them; the softmax computes in float32 inside),
  which for 7 queries at 16K keys took 2-3 ms instead of 6-9 ms with float32
  copies of the scores.
  Only the last ``q_len`` keys can be masked by causality, so when the mask
  allows every earlier key, only that tail is masked.
* **Everything else** (prefill chunks, GPUs, shapes where it measured faster):
  PyTorch's ``scaled_dot_product_attention(..., enable_gqa=True)``, which
  reads the grouped heads directly; on CUDA a short query (a decode step, a
  verification) never takes cuDNN's kernel (:data:`CUDA_SHORT_QUERY_BACKENDS`).

Queries aligned to the end of the keys (a prefill chunk after the first, a
verification step: "lower-right" causality) never build a mask of context
size (:func:`causal_attention`): the grouped path masks only the [q, q]
triangle of the last keys; on CUDA SDPA gets ``causal_lower_right``, which
takes the flash or memory-efficient kernel where they apply; on CPU two calls
of PyTorch's CPU flash kernel (the keys before the chunk without a mask, the
chunk's own keys causal) are merged exactly by their log-sum-exps.

The path of a short CPU query is reproducible: the same machine, shape and
settings always take the same path, in every process, so two runs of one
greedy request run the same kernels (in bfloat16 the paths round
differently). The rule (:func:`short_query_path`):

1. Queries on other devices, longer than :data:`MATMUL_MAX_QUERY` or
   causal without a cache take SDPA; else :data:`SHORT_QUERY_PATH`, when it
   names a path, is taken.
2. Else the shape class (dtype, heads, key/value heads, query length,
   power-of-two class of the key count, head_dim, threads) is looked up in
   the choices file (:func:`choices_file`: ``$RAPIDSPEC_ATTENTION_PATHS``,
   else ``attention_paths.json`` in the rapidspec cache directory), under a
   key naming the machine (:func:`machine_key`: CPU model, PyTorch's CPU
   capability, PyTorch version). A path found there is taken, never re-timed.
3. Else the candidates are timed once (:func:`measure_short_query_path`, a
   few milliseconds) and the fastest is written to the file (temporary file
   renamed into place; if another process wrote this class meanwhile, its
   path wins), then taken by this and every later process.
4. If the file cannot be written (a read-only or full cache folder: one
   warning per folder and cause, :func:`~rapidspec.runtime.cache_dir.cache_write`),
   :func:`default_short_query_path` (from the CPU capability and the key count)
   is taken instead of the measurement, so that no process takes a path the
   next one could not reproduce; paths already in the file are still taken. A
   corrupt file counts as empty and is rewritten (logged at debug level).

Each process reads the file once per shape class (:func:`fastest_short_query_path`
is memoised). Two processes measuring one class at the same moment may each
keep their own measurement for their lifetime; the file then holds one, which
every later process takes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers.masking_utils import sdpa_mask

from rapidspec.runtime.cache_dir import cache_root, keep_json
from rapidspec.runtime.grouped_attention import PATHS as GROUPED_PATHS, grouped_matmul_attention

logger = logging.getLogger(__name__)

ATTENTION = "rapidspec_sdpa_gqa"
#: Longest query (tokens) that may take a matrix-product path on CPU.
MATMUL_MAX_QUERY = 32
#: The paths a short CPU query can take: per key/value head products
#: (``matmul``), the same with the probabilities-values product split along the
#: keys into a batch of parts, one per thread (``split``: a product of [g*q, n]
#: by [n, d] has a [g*q, d] result too small for a library to share between
#: threads, so one thread summed all n keys while the others waited), one
#: batched product over the key/value heads (``batched``), the same with the
#: scores as keys x queries (``keys``), or PyTorch's SDPA (``sdpa``).
SHORT_QUERY_PATHS = (*GROUPED_PATHS, "sdpa")
#: How short CPU queries choose their path: ``"measure"`` (default) takes the
#: path kept for the shape class in the choices file, measuring and keeping it
#: the first time (:func:`fastest_short_query_path`); a name of
#: :data:`SHORT_QUERY_PATHS` forces it (tests, comparisons).
SHORT_QUERY_PATH = "measure"
#: SDPA's kernels for short queries on CUDA (decode steps, verification): cuDNN's, which SDPA takes first on Hopper,
#: builds a plan for each new key count, and every decode step brings one (a 0.5B-shaped model on an H200 at 30K
#: keys: 49-52 ms a step over growing key counts with it allowed, 14 ms without), so flash attention, else the others.
CUDA_SHORT_QUERY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: Key counts that the queries-first products (the ``matmul`` and ``split`` paths) run fastest at: a cache hands
#: attention its keys rounded up to a multiple of this, from the room ahead in its buffer (:func:`aligned_key_rows`).
KEY_ALIGNMENT = 128
#: Fewest keys of a shape class; shorter caches count as this many.
MEASURE_MIN_KEYS = 256
#: Environment variable naming the choices file (default: :data:`CHOICES_FILE_NAME` in the cache directory).
CHOICES_FILE_ENV = "RAPIDSPEC_ATTENTION_PATHS"
CHOICES_FILE_NAME = "attention_paths.json"
#: Layout of the choices file: ``{"format": 1, "machines": {machine_key: {shape class: path}}}``;
#: a file of another format counts as empty.
CHOICES_FORMAT = 4  # 2: measured by the fastest of 8 timings (1, medians of 5, could keep a path that lost
# by 10x when another process held the cores during the measurement: its files are measured again); 3: ``split``;
# 4: ``keys``


def short_query_path(query: torch.Tensor, kv_heads: int, kv_len: int) -> str:
    """The path (:data:`SHORT_QUERY_PATHS`) of a query [..., heads, q_len, head_dim] over ``kv_len`` keys.

    Only short queries on CPU have a choice. Which path is fastest depends on
    the CPU, not only on the shape. Per 30 layers of SmolLM2 (head_dim 64) in
    bfloat16 on 2 cores, one query: an AVX2-only EPYC ran SDPA in 57 ms at 16K
    keys against 66 ms for the per-head products (and 1.9 vs 12.4 ms at 528
    keys), while an AVX-512 EPYC with bfloat16 instructions ran SDPA in 254 ms
    at 8K keys against 18 ms, and at 528 keys the batched product in 6.5 ms
    against 11.8 (per-head) and 12.6 (SDPA). So the choice is measured on the
    machine it runs on, once, and kept (module docstring).
    """
    if query.device.type != "cpu" or query.shape[-2] > MATMUL_MAX_QUERY:
        return "sdpa"
    if SHORT_QUERY_PATH != "measure":
        return SHORT_QUERY_PATH
    heads, q_len, head_dim = query.shape[-3:]
    keys = max(MEASURE_MIN_KEYS, 1 << (max(kv_len, 1).bit_length() - 1))  # power-of-two class of kv_len
    return fastest_short_query_path(query.dtype, heads, kv_heads, q_len, keys, head_dim, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def fastest_short_query_path(
    dtype: torch.dtype, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, threads: int
) -> str:
    """The path of this shape class on this machine: the one kept in the choices file, else measured and kept.

    Memoised, so each process reads the file once per shape class. ``threads``
    is part of the key because the fastest path depends on it. Returns
    :func:`default_short_query_path` when a measured path cannot be kept
    (module docstring, rule 4).
    """
    shape = f"{str(dtype).removeprefix('torch.')} h{heads}/{kv_heads} q{q_len} n{kv_len} d{head_dim} t{threads}"
    path, machine = choices_file(), machine_key()
    kept = _read_choices(path).get(machine, {}).get(shape)
    if kept is not None:
        return kept
    measured = measure_short_query_path(dtype, heads, kv_heads, q_len, kv_len, head_dim)
    return _keep_choice(path, machine, shape, measured) or default_short_query_path(kv_len)


def default_short_query_path(kv_len: int) -> str:
    """The path taken where no measured one can be kept: from the CPU capability and the key count only.

    From the measurements of :func:`short_query_path`: on AVX-512 CPUs the
    products won (batched over short caches, per head over long ones), on
    AVX2-only CPUs SDPA won for head_dim 64 at every length.
    """
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return "batched" if kv_len < 1024 else "matmul"
    return "sdpa"


def choices_file() -> Path:
    """``$RAPIDSPEC_ATTENTION_PATHS`` if set, else ``attention_paths.json`` in the rapidspec cache directory."""
    override = os.environ.get(CHOICES_FILE_ENV)
    return Path(override).expanduser() if override else cache_root() / CHOICES_FILE_NAME


@functools.lru_cache(maxsize=1)
def machine_key() -> str:
    """What a kept path depends on besides the shape: the CPU model, PyTorch's CPU capability and version."""
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            model = next((line.partition(":")[2].strip() for line in cpuinfo if line.startswith("model name")), "")
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__}"


def _read_choices(path: Path) -> dict[str, dict[str, str]]:
    """The kept paths of the choices file ({machine: {shape class: path}}); {} when missing or corrupt."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        logger.debug("attention choices %s unreadable (%s): counted as empty", path, err)
        return {}
    machines = content.get("machines") if isinstance(content, dict) else None
    if not isinstance(machines, dict) or content.get("format") != CHOICES_FORMAT:
        logger.debug("attention choices %s has no format %d table: counted as empty", path, CHOICES_FORMAT)
        return {}
    return {
        machine: {shape: name for shape, name in kept.items() if name in SHORT_QUERY_PATHS}
        for machine, kept in machines.items()
        if isinstance(kept, dict)
    }


def _keep_choice(path: Path, machine: str, shape: str, measured: str) -> str | None:
    """Write ``measured`` for (machine, shape) into the choices file, atomically; returns the path now kept.

    The file is read again first: a path another process kept meanwhile wins
    (and nothing is written). None when the file cannot be written (logged
    once per folder and cause).
    """
    machines = _read_choices(path)
    kept = machines.get(machine, {}).get(shape)
    if kept is not None:
        return kept
    machines.setdefault(machine, {})[shape] = measured
    content = {"format": CHOICES_FORMAT, "machines": machines}
    without = "short CPU queries take the default path of each shape class not kept there"
    return measured if keep_json(path, content, "the measured attention paths", without) else None


def measure_short_query_path(
    dtype: torch.dtype, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int
) -> str:
    """The fastest of :data:`SHORT_QUERY_PATHS` for this shape, timed now (the best of 8 timings each).

    The best, not the median: another process on the cores only ever adds
    time, so the minimum is the estimate it disturbs least (with medians of 5,
    a measurement on a busy 2-core machine kept SDPA for one query at 16K keys,
    about 10x slower than the products there).

    Costs a few milliseconds per shape class. Keys and values are views of
    longer buffers, as in a cache. Called only where no path is kept
    (:func:`fastest_short_query_path`).
    """
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, q_len, head_dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, kv_len + 64, head_dim, generator=generator).to(dtype)[:, :, :kv_len]
    value = torch.randn(1, kv_heads, kv_len + 64, head_dim, generator=generator).to(dtype)[:, :, :kv_len]
    scaling = head_dim**-0.5
    candidates = {path: functools.partial(grouped_matmul_attention, query, key, value, None, scaling, path=path)
                  for path in GROUPED_PATHS}
    candidates["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        query, key, value, scale=scaling, enable_gqa=heads != kv_heads
    )
    seconds = {name: [] for name in candidates}
    with torch.inference_mode():
        for repeat in range(9):  # alternating, the first round a warm-up
            for name, run in candidates.items():
                started = time.perf_counter()
                run()
                if repeat:
                    seconds[name].append(time.perf_counter() - started)
    best = {name: min(values) for name, values in seconds.items()}
    logger.debug("attention %s h%d/%d q%d n%d d%d: %s", dtype, heads, kv_heads, q_len, kv_len, head_dim, best)
    return min(best, key=best.get)


def aligned_key_rows(length: int, capacity: int) -> int:
    """Rows of a cache's key buffer to hand attention for ``length`` held positions: ``length`` rounded up to
    :data:`KEY_ALIGNMENT`, at most ``capacity``.

    oneDNN's bfloat16 product of a verification's query rows by the keys ran slower on a key count that was not
    a multiple of 128; with the room, a verification of 7 tokens at 16K keys took 12% less (docs/speed.md). The
    rows past ``length`` are scored and masked, never read as keys
    (:func:`~rapidspec.runtime.grouped_attention.grouped_matmul_attention`).
    """
    return min(capacity, -(-length // KEY_ALIGNMENT) * KEY_ALIGNMENT)


def attend(
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, rows >= kv_len, head_dim]; rows past value's length are ignored
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    mask: torch.Tensor | None,  # bool (True = attend) or additive, broadcastable to [batch, 1, q_len, kv_len]
    is_causal: bool = False,  # causal without a mask (only for q_len == kv_len)
    scaling: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention [batch, heads, q_len, head_dim] on the path that pays for its shape (module docstring)."""
    path = "sdpa" if is_causal or dropout_p else short_query_path(query, value.shape[1], value.shape[2])
    if path != "sdpa":
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return grouped_matmul_attention(query, key, value, mask, scaling, path=path)
    return sdpa(query, key[:, :, : value.shape[2]], value, mask, dropout_p, scaling, is_causal)


def sdpa(query, key, value, mask, dropout_p: float, scaling: float | None, is_causal: bool = False) -> torch.Tensor:
    """PyTorch's SDPA with native GQA; a short query on CUDA takes :data:`CUDA_SHORT_QUERY_BACKENDS`."""
    short_cuda = query.device.type == "cuda" and query.shape[-2] <= MATMUL_MAX_QUERY
    with sdpa_kernel(CUDA_SHORT_QUERY_BACKENDS) if short_cuda else contextlib.nullcontext():
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scaling, is_causal=is_causal,
            enable_gqa=query.shape[1] != key.shape[1],
        )


def causal_attention(
    query: torch.Tensor,  # [batch, heads, q_len, head_dim], the last q_len positions of the keys
    key: torch.Tensor,  # [batch, kv_heads, rows >= kv_len, head_dim]; rows past value's length are ignored
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    scaling: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of queries aligned to the *end* of the keys, with no mask of context size (module docstring).

    ``key`` may carry rows past ``value``'s length (:func:`aligned_key_rows`); only a short query's ``matmul`` and
    ``split`` products use them (a verification's), every other path reads the first ``kv_len``: a long query's blocks
    (:func:`query_blocks`) ran no faster with them at 16K keys and slower at 32K.
    """
    q_len, kv_len = query.shape[2], value.shape[2]
    if q_len == 1 or q_len == kv_len:
        return attend(query, key, value, None, q_len > 1, scaling, dropout_p)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if query.device.type == "cpu" and q_len > MATMUL_MAX_QUERY and not dropout_p:
        return query_blocks(query, key, value, scaling)
    path = "sdpa" if dropout_p else short_query_path(query, value.shape[1], kv_len)
    if path != "sdpa":
        return grouped_matmul_attention(query, key, value, None, scaling, path=path, causal_tail=True)
    key = key[:, :, :kv_len]
    if query.device.type == "cpu" and _CPU_FLASH is not None and not dropout_p:
        return split_causal_attention(query, key, value, scaling)
    if query.device.type == "cuda":
        return sdpa(query, key, value, causal_lower_right(q_len, kv_len), dropout_p, scaling)
    positions = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]  # [q_len, 1]
    mask = (torch.arange(kv_len, device=query.device)[None, :] <= positions)[None, None]  # [1, 1, q, n], other devices
    return attend(query, key, value, mask, False, scaling, dropout_p)


def query_blocks(query, key, value, scaling: float) -> torch.Tensor:
    """CPU lower-right causal attention [b, h, q, d] of a long query in blocks of :data:`MATMUL_MAX_QUERY` rows.

    Each block attends to the keys up to its own last position, so it is a short query aligned to the end of
    its keys and takes the short-query path measured for its shape. Per block, the [g*q, n] scores of a key/value
    head stay small enough for the CPU's caches, where a whole 512-token chunk's outgrew them (and PyTorch's
    flash kernel was as slow): the default model's 16K-token prefill took 57.0 s instead of 89.6 s (docs/speed.md).
    """
    q_len, kv_len = query.shape[2], value.shape[2]
    blocks = []
    for start in range(0, q_len, MATMUL_MAX_QUERY):
        end = min(q_len, start + MATMUL_MAX_QUERY)
        keys = kv_len - q_len + end
        blocks.append(causal_attention(query[:, :, start:end], key[:, :, :keys], value[:, :, :keys], scaling))
    return torch.cat(blocks, dim=2)  # [b, h, q, d]


#: PyTorch's CPU flash-attention kernel, which also returns the log-sum-exp of each query's scores.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_causal_attention(query, key, value, scaling: float) -> torch.Tensor:
    """CPU lower-right causal attention: the keys before the chunk, then its own, merged by log-sum-exp.

    out = (e^(l1 - m) o1 + e^(l2 - m) o2) / (e^(l1 - m) + e^(l2 - m)), m = max(l1, l2); [b, h, q, d].
    """
    before = key.shape[2] - query.shape[2]
    past, past_lse = _CPU_FLASH(query, key[:, :, :before], value[:, :, :before], 0.0, False, scale=scaling)
    own, own_lse = _CPU_FLASH(query, key[:, :, before:], value[:, :, before:], 0.0, True, scale=scaling)
    top = torch.maximum(past_lse, own_lse)  # [b, h, q] float32
    past_weight = (past_lse - top).exp_()[..., None]  # [b, h, q, 1]
    own_weight = (own_lse - top).exp_()[..., None]
    merged = past.float().mul_(past_weight).add_(own.float().mul_(own_weight)).div_(past_weight + own_weight)
    return merged.to(query.dtype)


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: torch.Tensor | None,  # [batch, 1, q_len, kv_len] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output [batch, q_len, heads, head_dim], computed with native GQA."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dropout_p = dropout if module.training else 0.0
    if causal and attention_mask is None:
        output = causal_attention(query, key, value, scaling, dropout_p)
    else:
        output = attend(query, key, value, attention_mask, False, scaling, dropout_p)
    return output.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
