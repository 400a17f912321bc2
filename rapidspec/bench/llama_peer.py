"""The ``llama.cpp`` column of ``rapidspec bench``: plain greedy decoding of the target's GGUF on llama.cpp.

The peer a CPU user would pick instead of rapidspec, measured on the same
input in the same run: the target's own GGUF file (the weights as they are,
quantized), through :mod:`rapidspec.runtime.llama_cpp`, on the same prompt
tokens as ``lc``. Like the engine it prefills ``prompt[:-1]`` and its decode
time covers ``max_new_tokens`` forward passes from the last prompt token on.
With ``reuse_prefill`` (the bench's ``--share-prefill``) the context of an
input is prefilled once and later runs roll back to the prompt, credited
with that one measured prefill. Its tokens differ from ``lc``'s where the
quantized weights choose differently (the ``= lc`` column says so).
"""

from __future__ import annotations

import time

import torch

from rapidspec.drafting.backends import check_llama_vocabulary
from rapidspec.models.backend import gguf_file
from rapidspec.errors import RapidspecError
from rapidspec.bench.inputs import BenchItem
from rapidspec.bench.results import Measurement
from rapidspec.runtime.llama_cpp import LlamaCppModel, llama_cpp_available

class LlamaCppPeer:
    """Plain decoding of ``engine.target``'s GGUF file on llama.cpp with ``threads`` threads."""

    def __init__(self, engine, threads: int) -> None:
        if not llama_cpp_available():
            raise RapidspecError("mode llama.cpp needs llama-cpp-python: run `make install` (it builds it)")
        gguf = gguf_file(engine.target)
        if gguf is None:
            raise RapidspecError(f"mode llama.cpp runs the target's GGUF file; {engine.target.name!r} was not read from one")
        self.model = LlamaCppModel(gguf, threads=threads)
        check_llama_vocabulary(engine.tokenizer, self.model)
        self._context = None
        self._prompt: list[int] = []
        self._prefill_seconds = 0.0

    def generate(self, prompt: list[int], max_new_tokens: int, stop_tokens: frozenset[int], reuse_prefill: bool):
        """(new token ids, prefill seconds, decode seconds) of greedy decoding after ``prompt``."""
        if not (reuse_prefill and self._context is not None and self._prompt == prompt):
            self._context = None  # free the last one first
            context = self.model.new_context(len(prompt) + max_new_tokens + 1)
            started = time.perf_counter()
            context.prefill(prompt[:-1])
            self._context, self._prompt, self._prefill_seconds = context, list(prompt), time.perf_counter() - started
        context = self._context
        context.crop(len(prompt) - 1)
        tokens: list[int] = []
        started = time.perf_counter()
        fed = [prompt[-1]]
        with torch.inference_mode():
            while len(tokens) < max_new_tokens:
                token = int(context.forward(fed)[0].argmax())
                if token in stop_tokens:
                    break
                tokens.append(token)
                fed = [token]
        return tokens, self._prefill_seconds, time.perf_counter() - started

    def measure(self, engine, item: BenchItem, config, reuse_prefill: bool) -> Measurement:
        """One timed run on ``item`` with ``config``'s answer length and EOS rule (a bench Measurement)."""
        prompt = list(engine.document_prompts(item.document, item.question, config.with_mode("lc")).target_ids)
        stop_tokens = frozenset() if config.ignore_eos else engine.eos_token_ids
        tokens, prefill, decode = self.generate(prompt, config.max_new_tokens, stop_tokens, reuse_prefill)
        return Measurement(
            token_ids=tuple(tokens),
            text=engine.tokenizer.decode(tokens, skip_special_tokens=True),
            prompt_tokens_target=len(prompt),
            prompt_tokens_drafter=0,
            retrieval_seconds=0.0,
            target_prefill_seconds=prefill,
            drafter_prefill_seconds=None,
            decode_seconds=decode,
            total_seconds=prefill + decode,
            new_tokens=len(tokens),
            decode_tokens_per_second=len(tokens) / decode if tokens and decode > 0 else None,
        )
