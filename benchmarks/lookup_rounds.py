"""The shortest match of the lookup rounds before a model drafter joins (rapidspec.drafting.lookup.ROUNDS_MIN_NGRAM).

    python -m benchmarks.documents_file builtin --tokens 16000 --out demo_16k.jsonl
    python benchmarks/lookup_rounds.py demo_16k.jsonl --min-ngrams 1,2,3 --repeats 2

Reads the first document of a documents file (``benchmarks/documents_file.py``'s
format), prefills it once, then answers its questions greedily (``--max-new-tokens``
each) with lc and with rapid on the default drafter settings, once per shortest
match in ``--min-ngrams``, ``--repeats`` times in turn. Every answer finds the
document in the prefix cache; rapid's rounds draft by prompt lookup until the
drafter joins (the output counts the lookup drafts; the drafter's own are not
counted, and it joined none of the short answers in the kept runs). For each setting and
repeat it prints decode milliseconds per token over all the questions and the
lookup drafts accepted, one JSON object per line.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("documents", help="a JSONL file of {document, questions}")
    parser.add_argument("--min-ngrams", default="1,2,3", help="shortest matches to compare (comma-separated)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    import rapidspec.engine.rapid as engine_module
    from rapidspec import Rapid

    with open(args.documents, encoding="utf-8") as lines:
        item = json.loads(next(lines))
    engine = Rapid()
    document, questions = item["document"], item["questions"]
    engine.generate(document, questions[0], mode="lc", temperature=0.0, max_new_tokens=4)  # the prefill, once
    settings = ["lc", *(int(n) for n in args.min_ngrams.split(","))]
    for repeat in range(args.repeats):
        for setting in settings:
            if setting != "lc":
                engine_module.ROUNDS_MIN_NGRAM = setting  # what the engine gives the rounds' LookupDrafter
            seconds = tokens = drafted = accepted = 0
            for question in questions:
                stats = engine.generate(document, question, mode="lc" if setting == "lc" else "rapid",
                                        temperature=0.0, max_new_tokens=args.max_new_tokens).stats
                seconds += stats.decode_seconds
                tokens += stats.new_tokens - 1  # the first token is the prefill's
                drafted += stats.lookup_drafted_tokens
                accepted += stats.lookup_accepted_tokens
            print(json.dumps({"repeat": repeat, "min_ngram": setting, "ms_per_token": round(seconds / tokens * 1e3, 2),
                              "tokens": tokens, "lookup_accepted": accepted, "lookup_drafted": drafted}), flush=True)


if __name__ == "__main__":
    main()
