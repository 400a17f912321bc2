"""Load test of `rapidspec serve`: now `rapidspec bench serve`; this script only calls it.

    python benchmarks/serve_load.py --num-prompts 32 --max-tokens 16 --max-queue 16

is `rapidspec bench serve --num-prompts 32 --max-tokens 16 --max-queue 16`:
it starts `rapidspec serve` on 127.0.0.1 (a free port; the built-in model
unless --target says otherwise), sends the requests (all about the built-in
document, or --dataset FILE), prints a table, then one JSON object as the
last line. See `rapidspec bench serve --help`.
"""

from __future__ import annotations

import sys

from rapidspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
