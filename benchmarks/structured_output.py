"""rapid with and without a JSON schema on the same extraction prompt: decode speed, acceptance, validity.

The built-in long document (its planted fact: when a library's reading room
closes) and one question, answered by rapid (defaults, greedy) as free text
and under a JSON schema, alternately, ``--repeats`` times each; the target's
document prefill is shared through the prefix cache, so the rows compare
decoding. Prints per-run rows and the medians; the schema's answers are
checked against the schema.

    python benchmarks/structured_output.py --target builtin:qwen2.5-coder-0.5b --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics

SCHEMA = {
    "type": "object",
    "properties": {"place": {"type": "string", "maxLength": 60}, "day": {"type": "string", "maxLength": 20},
                   "closing_time": {"type": "string", "maxLength": 20}},
    "required": ["place", "day", "closing_time"],
    "additionalProperties": False,
}
QUESTION = ("Which reading room closes early, on which day and at what time? Answer as JSON with the keys place, "
            "day and closing_time.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    import jsonschema

    from rapidspec import Rapid
    from rapidspec.engine.spec import EngineSpec
    from rapidspec.grammar import Grammar
    from rapidspec.models.spec import ModelSpec
    from rapidspec.prompting.demo_document import demo_document

    engine = Rapid(EngineSpec(ModelSpec(target=args.target)))
    item = demo_document(tokenizer=engine.tokenizer)
    grammar = Grammar.json_schema(SCHEMA)
    engine.generate(item.document, QUESTION, mode="lc", max_new_tokens=1)  # the document's prefill, stored
    rows: dict[str, list] = {"free text": [], "JSON schema": []}
    for repeat in range(args.repeats):
        for label, shape in (("free text", None), ("JSON schema", grammar)):
            out = engine.generate(item.document, QUESTION, mode="rapid", max_new_tokens=args.max_new_tokens,
                                  grammar=shape)
            stats = out.stats
            valid = ""
            if shape is not None and stats.stop_reason in ("length", "time"):
                valid = "cut by max-new-tokens"
            elif shape is not None:
                jsonschema.validate(json.loads(out.text), SCHEMA)  # a complete answer is always valid
                valid = "valid"
            rows[label].append((stats.decode_tokens_per_second, stats.acceptance_rate or 0.0))
            print(f"{repeat + 1} {label:12s} {stats.new_tokens:3d} tokens {stats.decode_tokens_per_second:6.1f} tok/s "
                  f"acceptance {stats.acceptance_rate or 0:.2f} {valid} {out.text[:90]!r}")
    print(f"target {args.target}, drafter {engine.drafter_label}, {args.repeats} runs each, greedy, defaults")
    medians = {label: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
               for label, runs in rows.items()}
    for label, (speed, acceptance) in medians.items():
        print(f"median {label:12s} {speed:6.1f} tok/s, acceptance {acceptance:.2f}")
    print(f"JSON schema / free text decode speed: {medians['JSON schema'][0] / medians['free text'][0]:.2f}x")


if __name__ == "__main__":
    main()
