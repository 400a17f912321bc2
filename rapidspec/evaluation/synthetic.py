"""Synthetic needle-in-a-haystack tasks on real prose (RULER-style, written here).

Contract:

* The haystack is real prose, the paragraphs of the built-in demo document's
  source (:mod:`rapidspec.prompting.demo_document`: the Python Language Reference),
  taken in order from a seeded starting paragraph (wrapping around), until the
  document reaches ``length - reserve_tokens`` tokens (the last paragraph cut
  at a sentence). ``reserve_tokens`` leaves room for the instructions, the
  question and the answer, so the whole prompt fits a ``length``-token window
  and no needle is truncated away.
* Needles are RULER's sentences "One of the special magic numbers for KEY is:
  VALUE." with KEY an adjective-noun pair and VALUE a 7-digit number, each its
  own paragraph at a seeded depth (a paragraph boundary).
* Tasks: ``niah_single`` (one needle), ``niah_multikey`` (four needles with
  different keys, one asked for), ``niah_multivalue`` (four values for one
  key, all asked for). The answer opens with RULER's answer prefix ("The
  special magic numbers for KEY mentioned in the provided text are"), given
  with 128 new tokens (RULER's budget). Scored by :func:`rapidspec.evaluation.metrics.needle_recall`
  (fraction of gold values in the answer).
* Deterministic: the same seed, length, task and index give the same item.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.items import EvalItem
from rapidspec.prompting.demo_document import SENTENCE_END, token_counter, source_paragraphs
from rapidspec.prompting.prompts import PromptTemplate

TASKS = ("niah_single", "niah_multikey", "niah_multivalue")
NEEDLES_PER_ITEM = 4  # multikey: 1 asked + 3 distractors; multivalue: 4 values

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION_ONE = "What is the special magic number for {key} mentioned in the provided text?"
QUESTION_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"
# RULER's answer prefixes: the answer starts with them, as RULER's niah templates do.
PREFIX_ONE = "The special magic number for {key} mentioned in the provided text is"
PREFIX_ALL = "The special magic numbers for {key} mentioned in the provided text are"

TEMPLATE = PromptTemplate(
    body=(
        "Some special magic numbers are hidden within the following {source}. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n\n<text>\n{document}\n</text>\n\n{question}"
    ),
)

_ADJECTIVES = (
    "amber", "brave", "calm", "daring", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
)
_NOUNS = (
    "anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jungle",
    "kettle", "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "river", "saddle", "tunnel",
)


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def _values(rng: random.Random, n: int) -> list[str]:
    values: list[str] = []
    while len(values) < n:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in values:
            values.append(value)
    return values


def haystack(tokens: int, rng: random.Random, tokenizer: Any | None = None) -> list[str]:
    """Paragraphs of real prose totalling about ``tokens`` tokens (separators included)."""
    source = source_paragraphs()
    count = token_counter(tokenizer)
    separator = 1 if tokenizer is None else max(0, count("a\n\nb") - count("a") - count("b"))
    start = rng.randrange(len(source))
    chosen: list[str] = []
    total = 0
    for offset in range(len(source) * 4):  # wrap around the source if needed
        paragraph = source[(start + offset) % len(source)]
        n = count(paragraph) + separator
        if total + n <= tokens:
            chosen.append(paragraph)
            total += n
            continue
        partial: list[str] = []
        for sentence in SENTENCE_END.split(paragraph):
            if total + count(" ".join([*partial, sentence])) + separator > tokens:
                break
            partial.append(sentence)
        if partial:
            chosen.append(" ".join(partial))
        return chosen
    raise RapidspecError(f"cannot build a haystack of {tokens} tokens")  # pragma: no cover


def needle_item(
    task: str, length: int, index: int = 0, seed: int = 0, tokenizer: Any | None = None, reserve_tokens: int = 256
) -> EvalItem:
    """One synthetic item of ``task`` whose prompt fits ``length`` tokens."""
    if task not in TASKS:
        raise RapidspecError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")
    if length - reserve_tokens < 200:
        raise RapidspecError(f"synthetic length {length} is too short (minimum {reserve_tokens + 200})")
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    count = token_counter(tokenizer)
    if task == "niah_single":
        keys, values = _keys(rng, 1), _values(rng, 1)
        asked, answers = keys[0], (values[0],)
    elif task == "niah_multikey":
        keys, values = _keys(rng, NEEDLES_PER_ITEM), _values(rng, NEEDLES_PER_ITEM)
        asked, answers = keys[0], (values[0],)
    else:
        keys, values = _keys(rng, 1) * NEEDLES_PER_ITEM, _values(rng, NEEDLES_PER_ITEM)
        asked, answers = keys[0], tuple(values)
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    needle_tokens = sum(count(n) + 2 for n in needles)
    paragraphs = haystack(length - reserve_tokens - needle_tokens, rng, tokenizer)
    # Each needle goes to a random paragraph boundary (depth); insert from the back so indices stay valid.
    depths = sorted((rng.randint(0, len(paragraphs)) for _ in needles), reverse=True)
    order = list(range(len(needles)))
    rng.shuffle(order)
    for depth, which in zip(depths, order):
        paragraphs.insert(depth, needles[which])
    document = "\n\n".join(paragraphs)
    every = task == "niah_multivalue"
    question = (QUESTION_ALL if every else QUESTION_ONE).format(key=asked)
    template = replace(TEMPLATE, answer_prefix=(PREFIX_ALL if every else PREFIX_ONE).format(key=asked))
    return EvalItem(
        id=f"{task}@{length}-{index}",
        document=document,
        question=question,
        query=question,
        answers=answers,
        task_type="needle",
        template=template,
        group=f"synthetic/{task}@{length}",
        meta={"needles": needles, "depths": [document.index(n) / max(1, len(document)) for n in needles]},
    )


def synthetic_items(
    lengths: Sequence[int] = (4096,),
    tasks: Sequence[str] = TASKS,
    per_task: int = 10,
    seed: int = 0,
    tokenizer: Any | None = None,
    reserve_tokens: int = 256,
) -> list[EvalItem]:
    """``per_task`` items of each task at each length, interleaved (length, index, task) so that a limit stays balanced."""
    if per_task < 1:
        raise RapidspecError(f"per_task must be >= 1, got {per_task}")
    return [
        needle_item(task, length, index, seed, tokenizer, reserve_tokens)
        for length in lengths
        for index in range(per_task)
        for task in tasks
    ]
