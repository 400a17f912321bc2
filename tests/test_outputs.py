"""The helpers over a generation's stream in rapidspec.outputs."""

from __future__ import annotations


def test_timed_output_times_the_first_tokens_and_the_end():
    import time

    from rapidspec.config import DecodeConfig
    from rapidspec.outputs import GenerationOutput, StreamChunk, timed_output
    from rapidspec.stats import GenerationStats

    final = GenerationOutput("ab", (1, 2), GenerationStats(), DecodeConfig())

    def chunks():
        time.sleep(0.02)
        yield StreamChunk("")  # nothing emitted yet
        time.sleep(0.02)
        yield StreamChunk("a", (1,))
        time.sleep(0.02)
        yield StreamChunk("b", (2,), output=final)

    output, first, total = timed_output(chunks())
    assert output is final and 0.04 <= first < total and total >= 0.06
