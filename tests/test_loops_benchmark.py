"""benchmarks/loops.py: what counts as an answer that loops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("loops", Path(__file__).parents[1] / "benchmarks" / "loops.py")
loops = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(loops)


def test_a_repeated_word_or_paragraph_loops_and_a_list_does_not():
    assert loops.loops("1. `make demo` 2. `rapid` " + "command-line " * 90)
    assert loops.loops("The answer is: " * 11)
    assert loops.loops("She went to the lake on a sunny day. Then she went home. " * 3)
    assert not loops.loops("1. make demo 2. make test. The first runs the demo, the second the tests.")
    assert not loops.loops("Caroline went to the LGBTQ support group on 7 May 2023, and she said it was powerful.")
