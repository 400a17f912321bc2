"""Per-token cost of a grammar's token mask (llguidance) on this machine, for a real model's vocabulary.

Walks a valid JSON answer token by token, as a generation does, and times the
mask at each position: the time to compute llguidance's mask and turn it into
the ``[V]`` bool tensor the engine applies (:class:`rapidspec.grammar.GrammarState`),
and, for comparison, llguidance's packed bitmask alone (one bit per token). Prints medians and p99
in microseconds.

    python benchmarks/grammar_mask_cost.py --model builtin
    python benchmarks/grammar_mask_cost.py --model builtin:qwen2.5-coder-0.5b --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ANSWER = {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"],
          "notes": "wrote the first published algorithm for Babbage's Analytical Engine", "verified": True}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "born": {"type": "integer"},
        "fields": {"type": "array", "items": {"type": "string"}}, "notes": {"type": "string"},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "born", "fields", "notes", "verified"],
    "additionalProperties": False,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--repeats", type=int, default=10, help="walks through the answer")
    args = parser.parse_args()

    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    from rapidspec.grammar import Grammar, GrammarTokens
    from rapidspec.models import load_model
    from rapidspec.models.vocabulary import eos_token_ids, logit_width

    loaded = load_model(args.model)
    vocab = max(logit_width(loaded.model), len(loaded.tokenizer))
    tokens = GrammarTokens(loaded.tokenizer, vocab, eos_token_ids(loaded))
    grammar = Grammar.json_schema(SCHEMA)
    started = time.perf_counter()
    tokens.start(grammar)
    first = time.perf_counter() - started  # llguidance's view of the tokenizer, once per engine
    answer = loaded.tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)

    ours, packed = [], []
    bitmask = allocate_token_bitmask(1, vocab)
    for _ in range(args.repeats):
        state, alone = tokens.start(grammar), tokens.start(grammar)  # each mask computed once per state
        for token in answer:
            t0 = time.perf_counter()
            mask = state.mask_after([])
            ours.append(time.perf_counter() - t0)
            assert bool(mask[token]), "the answer left the grammar"
            t0 = time.perf_counter()
            fill_next_token_bitmask(alone.matcher, bitmask)
            packed.append(time.perf_counter() - t0)
            state.commit([token])
            alone.commit([token])
    print(f"model {loaded.name}: vocabulary {vocab}, answer {len(answer)} tokens x {args.repeats} walks, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"first grammar (tokenizer made for llguidance): {first * 1e3:.0f} ms")
    for label, values in (("mask as a [V] bool tensor (used)", ours), ("llguidance packed bitmask alone", packed)):
        micro = [v * 1e6 for v in values]
        print(f"{label}: median {statistics.median(micro):.0f} us, p99 {percentile(micro, 0.99):.0f} us")


if __name__ == "__main__":
    main()
