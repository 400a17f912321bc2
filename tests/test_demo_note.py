"""rapidspec demo's line on when rapid's drafter joined (cli/demo.join_note)."""

from __future__ import annotations

from rapidspec.cli.demo import join_note
from rapidspec.stats import GenerationStats


def test_the_note_says_when_lookup_drafted_and_when_nothing_did():
    plain = GenerationStats(new_tokens=19, time_to_first_token=0.07)
    assert join_note(plain).endswith("within this 19-token answer, so it answered as lc does")
    looked = GenerationStats(new_tokens=128, time_to_first_token=0.07, lookup_drafted_tokens=90, lookup_accepted_tokens=61)
    note = join_note(looked)
    assert "its rounds drafted by prompt lookup over the target's text, 61 of 90 drafts kept" in note
    assert "answered as lc does" not in note
    joined = GenerationStats(new_tokens=128, drafter_joined_at=40, lookup_drafted_tokens=30, lookup_accepted_tokens=20)
    assert join_note(joined).endswith("joined after 40 tokens; before it, rounds drafted by prompt lookup over the "
                                      "target's text, 20 of 30 drafts kept (each token the target's)")
