"""A served prefill's pieces: about a second each at the last piece's rate when alone, ``shared`` tokens beside
other requests, whole chunks with 0."""

from __future__ import annotations

from rapidspec.server.pieces import PrefillPieces


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_alone_a_piece_lasts_about_a_second_at_the_last_rate_and_at_most_doubles():
    clock, crowded = Clock(), [False]
    pieces = PrefillPieces(64, lambda: crowded[0], piece_s=1.0, clock=clock, alone_min=0)
    assert pieces() == 64  # the rate is not known yet
    clock.now += 0.01  # 64 tokens in 10 ms: 6,400 tokens/s, but a piece at most doubles
    assert pieces() == 128
    clock.now += 0.5  # 128 tokens in 0.5 s: 256 tokens/s, so 256 tokens last about a second
    assert pieces() == 256
    clock.now += 2.0  # 128 tokens/s
    assert pieces() == 128
    clock.now += 60.0  # slower than the floor: never under ``shared``
    assert pieces() == 64


def test_beside_other_requests_a_piece_is_shared_tokens_and_0_means_whole_chunks():
    clock, crowded = Clock(), [True]
    pieces = PrefillPieces(32, lambda: crowded[0], clock=clock)
    for _ in range(3):
        clock.now += 0.001
        assert pieces() == 32
    crowded[0] = False  # alone again: the last piece's time counted the others' steps too, so it grows from there
    clock.now += 0.001
    assert pieces() == 64
    assert PrefillPieces(0, lambda: False, clock=clock)() is None
    assert PrefillPieces(0, lambda: True, clock=clock)() is None
    crowded[0] = True
    for _ in range(3):  # beside others, the floor of a lone piece does not apply
        clock.now += 10.0
        assert pieces() == 32


def test_alone_a_piece_grows_to_its_floor_however_slow_the_last_ran():
    """A second at a long document's end holds few tokens, which its attention computes slowly: a lone piece
    doubles up to ``alone_min`` tokens (256 by default) even where that lasts longer than a second."""
    clock, crowded = Clock(), [False]
    pieces = PrefillPieces(64, lambda: crowded[0], piece_s=1.0, clock=clock)
    assert pieces() == 64
    clock.now += 2.0  # 32 tokens/s
    assert pieces() == 128
    clock.now += 4.0
    assert pieces() == 256
    clock.now += 8.0
    assert pieces() == 256  # held at the floor
    crowded[0] = True
    clock.now += 8.0
    assert pieces() == 64  # beside others: ``shared`` tokens
