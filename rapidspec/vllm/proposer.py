"""RAPID's drafter as a vLLM proposer: the drafter reads retrieved text, vLLM's model reads the whole prompt.

Turned on with vLLM's ``custom_class`` method (docs/vllm.md)::

    LLM(model=folder, speculative_config={"method": "custom_class", "model": "rapidspec.vllm.RapidProposer",
                                          "num_speculative_tokens": 6})

vLLM builds the class with its ``VllmConfig`` and calls :meth:`RapidProposer.propose`
every step with one row per running request: its tokens so far
(``token_ids_cpu[i, :num_tokens_no_spec[i]]``) and the tokens sampled for it
this step (empty: no drafts wanted, e.g. while its prompt is still being
read). For each request the proposer:

1. the first time it is seen (while vLLM still reads its prompt, when vLLM
   reads it in chunks), reads its prompt back into chat messages
   (:mod:`.prompt_reading`), retrieves from its long context for its last user
   message exactly as ``rapidspec chat`` and ``rapidspec serve`` do
   (:func:`rapidspec.prompting.conversation.chat_prompts` in mode ``ragsd``) and
   prefills a drafter on the short prompt (a llama.cpp context over a GGUF on
   the CPU, or a torch cache on vLLM's device; the drafter pools of
   :mod:`rapidspec.drafting.backends`, which hand a finished request's cache to
   the next one with the same document). By default this runs on the
   proposer's own thread while vLLM goes on: the request is decoded without
   drafts until its drafter is ready, and no other request waits for it;
2. every step, feeds the drafter the tokens vLLM accepted since the last step
   (:mod:`.requests`) and drafts up to ``num_speculative_tokens`` greedily,
   fewer where rapidspec's ``cost`` schedule expects a round not to pay
   (:mod:`.costs`);
3. forgets a request once a step comes without it (vLLM does not tell a
   proposer when a request ends, so the last ones are let go at the next step).

vLLM verifies the drafts itself, losslessly: the answers are vLLM's own, so
this is RAPID's ``ragsd`` (eta = 0). The retrieval-augmented target
distribution (eta > 0) needs the drafter's distribution in vLLM's rejection
sampler and the target's logits back out, which the ``custom_class``
interface does not carry.

A request the proposer cannot draft for (its prompt does not fit the
drafter, the drafter fails) gets no drafts, with one warning per cause;
vLLM decodes it as without speculation.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from rapidspec.config import DecodeConfig
from rapidspec.drafting.gamma_schedule import CostSchedule
from rapidspec.models.vocabulary import eos_token_ids
from rapidspec.prompting.conversation import chat_prompts
from rapidspec.retrieval import Retriever
from rapidspec.vllm.costs import StepClock
from rapidspec.vllm.drafter_source import drafter_pool
from rapidspec.vllm.options import ProposerOptions
from rapidspec.vllm.prompt_reading import ChatLayout, read_prompt
from rapidspec.vllm.requests import RequestDrafts, Requests

# Under vLLM's logger: vLLM gives it a handler in each of its processes, so the proposer's lines show with vLLM's.
logger = logging.getLogger("vllm.rapidspec")

#: Tokens of the drafter's window kept for the answer when its prompt is fitted to it.
ANSWER_ROOM_TOKENS = 1024


class RapidProposer:
    """vLLM's ``custom_class`` proposer (module docstring); built by vLLM with its ``VllmConfig``."""

    def __init__(self, vllm_config) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        self.most = int(vllm_config.speculative_config.num_speculative_tokens)
        model_config = vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.options = ProposerOptions.from_env()
        device = getattr(vllm_config.device_config, "device", None)
        self.device = torch.device(device if device is not None else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        self.layout = ChatLayout.learn(self.tokenizer)
        folder = Path(model_config.model)
        generation = GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file() else None
        self.stop_tokens = eos_token_ids(SimpleNamespace(model=SimpleNamespace(generation_config=generation),
                                                         tokenizer=self.tokenizer))
        self.pool = drafter_pool(self.options, folder, self.tokenizer, self.device)
        self.vocab_size = min(self.pool.logit_width, int(model_config.get_vocab_size()))
        self.retriever = Retriever(self.options.retrieval, tokenizer=self.tokenizer)
        self.config = DecodeConfig(mode="ragsd", temperature=0.0, gamma=self.most, max_gamma=self.most,
                                   gamma_schedule="constant", max_model_len=self.max_model_len)
        self.generator = torch.Generator()
        self.requests = Requests()
        self.clock = StepClock()
        self.totals = {"requests": 0, "finished": 0, "drafted": 0, "accepted": 0, "rounds": 0}
        self._beside = ThreadPoolExecutor(1, thread_name_prefix="rapidspec-vllm-prepare") \
            if self.options.prepare == "beside" else None
        self._warned: set[str] = set()
        # the embedder and chunker a first retrieval would load (seconds), before the first request needs them
        if self._beside is None:
            self._warm_up()
        else:
            self._beside.submit(self._warm_up)
        logger.info("rapidspec proposer: drafter %s, up to %d drafts a step (%s schedule), retrieval %s, prepared %s",
                    self.pool.label, self.most, self.options.schedule, self.options.retrieval.method,
                    self.options.prepare)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's call to load a proposer's model: the drafter was loaded when the proposer was built."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        """One list of draft token ids per row of vLLM's batch (module docstring)."""
        self.clock.step_started()
        costs, plain_step = self.clock.costs(), self.clock.plain_step()
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        taken: set[int] = set()
        verified = 0
        for row, sampled in enumerate(sampled_token_ids):
            length = int(num_tokens_no_spec[row])
            tokens = np.asarray(token_ids_cpu[row, :length], dtype=np.int64)
            request = self.requests.match(tokens, taken)
            if request is None:  # new: its prompt is still being read (nothing sampled: prepared beside that) or done
                request = self._start(tokens, length - len(sampled))
                self.requests.add(request)
                self.totals["requests"] += 1
            else:
                request.advance(tokens)
            request.join_if_ready()
            taken.add(id(request))
            verified += 1
            room = self.max_model_len - length - 1
            if not sampled or room <= 0 or request.drafter is None:
                continue
            drafts[row] = self._draft(request, min(self.most, room), costs, plain_step)
            verified += len(drafts[row])
        self._finish(taken)
        self.clock.step_ended(verified, any(drafts))
        return drafts

    def _start(self, tokens: np.ndarray, prompt_tokens: int) -> RequestDrafts:
        """The drafts of a request seen for the first time; its drafter is prepared on the proposer's own thread
        (``prepare="beside"``: the request gets no drafts until it is ready) or now."""
        schedule = CostSchedule(self.most, self.most, 0.0, self.clock.costs()) if self.options.schedule == "cost" else None
        prompt = [int(t) for t in tokens[:prompt_tokens]]
        if self._beside is None:
            return RequestDrafts(tokens, prompt_tokens, self._prepare(prompt), schedule)
        request = RequestDrafts(tokens, prompt_tokens, None, schedule)
        request.preparing = self._beside.submit(self._prepare, prompt)
        return request

    def _prepare(self, prompt: list[int]):
        """A drafter prefilled on the short prompt of ``prompt`` (module docstring), or None where there is none."""
        try:
            read = read_prompt(self.tokenizer, self.layout, prompt)
            window = max(self.pool.max_context - ANSWER_ROOM_TOKENS, self.pool.max_context // 2) \
                if self.pool.max_context else self.max_model_len
            pair = chat_prompts(self.tokenizer, self.retriever, read.messages, read.documents, mode="ragsd",
                                target_window=self.max_model_len, drafter_window=window,
                                recent_messages=self.options.recent_messages, raw=read.raw)
            room = self.max_model_len - len(prompt)
            if self.pool.max_context:
                room = min(room, self.pool.max_context - len(pair.drafter_ids))
            pending = self.pool.begin(pair.drafter_ids, max(room, 1), self.vocab_size, self.device)
            pending.advance(None)
            return pending.drafter()
        except Exception as err:  # noqa: BLE001  (vLLM's engine must go on: this request decodes without drafts)
            self._warn(f"{type(err).__name__}: {err}", "a request gets no drafts")
            return None

    def _draft(self, request: RequestDrafts, most: int, costs, plain_step: float | None) -> list[int]:
        capacity = getattr(request.drafter.cache, "capacity", None)
        if capacity is not None:
            most = min(most, capacity - len(request.drafter.sequence) - 1)
        if most <= 0:
            return []
        started = time.perf_counter()
        try:
            proposal = request.propose(most, self.config, self.generator, self.stop_tokens, costs, plain_step)
        except Exception as err:  # noqa: BLE001  (as in _start: no drafts for this request from now on)
            self._warn(f"{type(err).__name__}: {err}", "a request's drafter stopped")
            request.drafter.close(keep=False)
            request.drafter = None
            return []
        self.clock.drafted(proposal.forwards, time.perf_counter() - started)
        return list(proposal.tokens)

    def _finish(self, running: set[int]) -> None:
        for request in self.requests.finished(running):
            self.totals["finished"] += 1
            for key in ("drafted", "accepted", "rounds"):
                self.totals[key] += getattr(request, key)
            logger.info("rapidspec proposer: a request ended (%d drafted, %d accepted in %d rounds); %d running; "
                        "totals %s", request.drafted, request.accepted, request.rounds, len(self.requests),
                        json.dumps(self.totals))

    def _warm_up(self) -> None:
        try:
            self.retriever.warm_up()
        except Exception as err:  # noqa: BLE001  (the first request's retrieval says it again, or works)
            self._warn(f"{type(err).__name__}: {err}", "retrieval could not warm up")

    def _warn(self, cause: str, what: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            logger.warning("rapidspec proposer: %s (%s)", what, cause)
