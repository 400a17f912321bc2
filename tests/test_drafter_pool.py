"""The drafter pool keeps several closed caches and starts each drafter from the one sharing its longest prefix."""

from __future__ import annotations

import torch

from rapidspec.drafting.backends import DrafterPool
from rapidspec.runtime.cache import HeldTokens

V = 16


class RecordingCache(HeldTokens):
    """Logits of zeros; records how many tokens each forward fed."""

    def __init__(self, capacity: int = 1000, size: int = 100) -> None:
        super().__init__(64)
        self.capacity, self.size, self.fed = capacity, size, []

    def forward(self, token_ids, num_logits: int = 1) -> torch.Tensor:
        self._check_forward(token_ids, num_logits)
        self._token_ids.extend(int(t) for t in token_ids)
        self.fed.append(len(token_ids))
        return torch.zeros(1, num_logits, V)

    def crop(self, length: int) -> None:
        self._check_crop(length)
        del self._token_ids[length:]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_bytes(self) -> int:
        return self.size


class Pool(DrafterPool):
    def __init__(self, size: int = 100, **options) -> None:
        super().__init__(**{"reuse_min_tokens": 5, **options})
        self.size, self.made = size, 0

    def _new_cache(self, tokens: int):
        self.made += 1
        return RecordingCache(size=self.size)

    def _fits(self, cache, tokens: int) -> bool:
        return cache.capacity >= tokens


def run(pool: Pool, prompt: list[int]) -> int:
    """Start and close a drafter over ``prompt``; how many prompt tokens its cache reused."""
    drafter, reused = pool.start(prompt, room=8, vocab_size=V, target_device=torch.device("cpu"))
    drafter.close()
    return reused


def prompt(chunk: int, question: int) -> list[int]:
    """A template header, one retrieved chunk, a question."""
    return [1, 2, 3] + [100 + 10 * chunk + i for i in range(10)] + [200 + question, 201, 202]


def test_a_prompt_reuses_the_kept_cache_with_its_longest_prefix_not_only_the_last():
    pool = Pool()
    assert run(pool, prompt(chunk=0, question=0)) == 0
    assert run(pool, prompt(chunk=1, question=1)) == 0  # the header only: a new cache, chunk 0's stays
    assert run(pool, prompt(chunk=0, question=2)) == 13  # header and chunk 0, from the first cache
    assert run(pool, prompt(chunk=1, question=3)) == 13
    assert pool.made == 2 and pool.kept == 2


def test_a_full_pool_gives_its_oldest_cache_to_a_prompt_sharing_little():
    pool = Pool(kept_caches=3)
    for chunk in range(3):
        run(pool, prompt(chunk, question=chunk))
    assert run(pool, prompt(chunk=7, question=7)) == 3  # the header: chunk 0's cache, the oldest
    for chunk in (1, 2, 7):
        assert run(pool, prompt(chunk, question=9)) == 13
    assert run(pool, prompt(chunk=0, question=9)) == 3  # chunk 0's is gone
    assert pool.made == 3


def test_the_pool_is_bounded_in_caches_and_bytes_but_keeps_the_newest():
    pool = Pool(kept_caches=2)
    for chunk in range(3):
        run(pool, prompt(chunk, question=0))
    assert pool.kept == 2
    assert run(pool, prompt(chunk=0, question=1)) == 3  # chunk 0's cache, the oldest, is gone: the full pool's oldest

    big = Pool(size=300, kept_bytes=500)
    for chunk in range(3):
        run(big, prompt(chunk, question=0))
    assert big.kept == 1  # 300 bytes each: one fits the bound
    huge = Pool(size=10_000, kept_bytes=500)
    run(huge, prompt(chunk=0, question=0))
    assert huge.kept == 1 and run(huge, prompt(chunk=0, question=1)) == 13  # the newest stays whatever its size


def test_running_drafters_each_get_a_cache_and_nothing_is_kept_without_keep():
    pool = Pool()
    first, _ = pool.start(prompt(0, 0), room=8, vocab_size=V, target_device=torch.device("cpu"))
    second, reused = pool.start(prompt(0, 1), room=8, vocab_size=V, target_device=torch.device("cpu"))
    assert reused == 0 and first.cache is not second.cache
    first.close(), second.close()
    assert pool.kept == 2
    pool.clear()
    assert pool.kept == 0
    off = Pool(keep=False)
    run(off, prompt(0, 0))
    assert off.kept == 0 and run(off, prompt(0, 0)) == 0


def test_a_cache_too_small_for_the_prompt_is_not_taken():
    pool = Pool()
    run(pool, prompt(0, 0))
    long_prompt = prompt(0, 1) + list(range(300, 1300))
    assert run(pool, long_prompt) == 0 and pool.made == 2
