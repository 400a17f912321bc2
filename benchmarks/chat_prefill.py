"""Turn-by-turn target prefill of a long conversation, with and without the prefix cache.

    python benchmarks/chat_prefill.py $DATA/locomo/locomo_dev.json --conversation 0 \
        --mode rapid --drafter-quantize int8 --max-new-tokens 24

A LoCoMo conversation is replayed as a chat: at turn t the history holds its
first t sessions (one speaker as the user, the other as the assistant), the
earlier questions and the engine's own answers, and the user asks one of the
conversation's questions. One engine keeps its prefix cache (turn t prefills
only what is new since turn t - 1); a second one, with the cache off, prefills
the same target prompt from scratch (run in mode ``lc`` for one token: only
its prefill is used; the target reads the same prompt in every mode but
``rag``). Turns stop before the prompt outgrows the window, where cutting the
oldest turns would change the prefix. Prints a table, then one JSON object as
the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from rapidspec import EngineSpec, Rapid
from rapidspec.cli.options import add_model_options, load_models
from rapidspec.config import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import LOCOMO_ADVERSARIAL, locomo_sessions
from rapidspec.prompting.conversation import parse_messages, render
from rapidspec.retrieval import RetrievalConfig

WINDOW_MARGIN = 64


def questions_by_session(qa: list[dict]) -> dict[int, list[str]]:
    """Non-adversarial questions, keyed by the last session their evidence comes from."""
    found: dict[int, list[str]] = {}
    for item in qa:
        sessions = [int(m.group(1)) for e in item.get("evidence", []) if (m := re.match(r"D(\d+):", str(e)))]
        if item.get("category") != LOCOMO_ADVERSARIAL and sessions:
            found.setdefault(max(sessions), []).append(str(item["question"]).strip())
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="LoCoMo JSON file")
    parser.add_argument("--conversation", type=int, default=0, help="index of the conversation in the file")
    parser.add_argument("--turns", type=int, default=None, help="at most this many turns (default: as many as fit)")
    parser.add_argument("--mode", default="rapid", help="mode of the engine with the prefix cache (default: rapid)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    add_model_options(parser)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        samples = json.loads(args.data.read_text(encoding="utf-8"))
        sample = samples[args.conversation]
        sessions = locomo_sessions(sample["conversation"])
        questions = questions_by_session(sample.get("qa", []))
    except (OSError, ValueError, IndexError, KeyError, TypeError) as err:
        console.print(f"chat_prefill: error: cannot read conversation {args.conversation} of {args.data}: {err}")
        return 2

    target, drafter = load_models(args)
    retrieval = RetrievalConfig(method="bm25")
    cached = Rapid(EngineSpec(retrieval=retrieval, kv_cache_gib=0),
                   target=target, drafter=drafter)  # timed prefills: none read from disk
    uncached = Rapid(EngineSpec(retrieval=retrieval, reuse_document_cache=False, kv_cache_gib=0), target=target)
    config = DecodeConfig(mode=args.mode, max_new_tokens=args.max_new_tokens, truncate="error")
    conversation = sample["conversation"]
    messages = [{"role": "system", "content": f"A conversation between {conversation.get('speaker_a')} (the user) "
                                              f"and {conversation.get('speaker_b')} (the assistant)."}]
    window = target.max_context - args.max_new_tokens - WINDOW_MARGIN
    rows = []
    for turn, session in enumerate(tqdm(sessions[: args.turns], desc="turns", file=sys.stderr), start=1):
        question = (questions.get(turn) or ["What did we talk about last time?"])[0]
        asked = messages + session + [{"role": "user", "content": question}]
        if len(render(target.tokenizer, parse_messages(asked))) > window:
            break
        with_cache = cached.chat(asked, config=config)
        without = uncached.chat(asked, config=config.with_(mode="lc", max_new_tokens=1, eta=None))
        s, f = with_cache.stats, without.stats
        assert s.prompt_tokens_target == f.prompt_tokens_target
        rows.append({
            "turn": turn, "prompt_tokens": s.prompt_tokens_target, "reused_tokens": s.target_prefill_reused_tokens,
            "prefill_s_reuse": s.target_prefill_seconds, "prefill_s_full": f.target_prefill_seconds,
            "decode_tokens_per_s": s.decode_tokens_per_second, "acceptance": s.acceptance_rate,
        })
        messages = asked + [{"role": "assistant", "content": with_cache.text}]
    if not rows:
        console.print("chat_prefill: error: not even the first session fits the window")
        return 2

    table = Table(title=f"LoCoMo conversation {args.conversation}: target prefill per turn ({target.name}, mode {args.mode})")
    for name in ("turn", "prompt tokens", "reused", "prefilled", "prefill s (reuse)", "prefill s (full)", "speedup"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["turn"]), str(r["prompt_tokens"]), str(r["reused_tokens"]),
                      str(r["prompt_tokens"] - r["reused_tokens"]), f"{r['prefill_s_reuse']:.2f}",
                      f"{r['prefill_s_full']:.2f}", f"{r['prefill_s_full'] / r['prefill_s_reuse']:.1f}x")
    Console().print(table)
    later = rows[1:] or rows
    summary = {
        "conversation": args.conversation, "model": target.name, "mode": args.mode, "turns": rows,
        "total_prefill_s_reuse": sum(r["prefill_s_reuse"] for r in rows),
        "total_prefill_s_full": sum(r["prefill_s_full"] for r in rows),
        "median_speedup_after_turn_1": statistics.median(r["prefill_s_full"] / r["prefill_s_reuse"] for r in later),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RapidspecError as err:
        print(f"chat_prefill: error: {err}", file=sys.stderr)
        sys.exit(2)
