"""What a conversation's earlier answers say about its drafter: the prior of its next answer's join decision.

The drafter's join (:mod:`.join`) expects a draft to be kept with the
acceptance of earlier answers and plans its prefill from the drafter caches
earlier answers left. Read engine-wide, both would depend on which requests
happened to finish before this one, and with eta > 0 the round the drafter
joins decides the text. So both are kept per conversation:
:meth:`ConversationMemory.record` files a finished answer under its prompt's
token ids, with the acceptance counts of the entry it started from (decayed
by :data:`MEMORY_DECAY`) plus its own, and the drafter's prompt and answer;
:meth:`ConversationMemory.lookup` finds, for a new prompt, the entry of the
longest recorded prompt it continues: the same conversation's previous turn
(its prompt, then the answer, then the next message). A first question has
none, whatever ran before: the prior (:data:`MEMORY_PRIOR`) and no kept
cache. The same prompt asked again continues none of its own entries either.
So a request's rounds are a function of the request (with its conversation's
earlier turns) and the machine's calibration.

Entries are bounded (:data:`MAX_ENTRIES`, least recently used dropped) and
hold a digest of the prompt, not its tokens.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from rapidspec.drafting.gamma_schedule import ACCEPTANCE_PRIOR_STRENGTH, acceptance_estimates

#: Earlier answers' acceptance counts decay by this per answer of the conversation, drafted or not (about the
#: last 10 weigh; after answers without the drafter the prior comes back, so a drafter judged poor is tried again).
MEMORY_DECAY = 0.9
#: What the start decision expects of a draft before the conversation's answers say otherwise: kept. Optimism while
#: the evidence is thin tries the drafter on the first answer long enough to pay for a good one, and the answer's
#: counts then decide (one prior observation against each answer's tens of drafts). A pessimistic prior never
#: learns: with 0.7 the Qwen2.5-Coder 0.5B self-drafter, which keeps most of its drafts on the demo document's
#: questions, was never prefilled for a 128-token answer on 2 cores.
MEMORY_PRIOR = 1.0
#: Conversations remembered (least recently used dropped).
MAX_ENTRIES = 256
_EDGE = 8  # tokens compared at each end of a candidate prefix before its digest is computed


def _digest(token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class Turn:
    """One recorded answer: its prompt's length, ends and digest; the conversation's decayed per-position counts
    up to it; what its drafter read and wrote (the drafter's prompt and the answer, () without a drafter)."""

    length: int
    head: tuple[int, ...]
    tail: tuple[int, ...]
    digest: bytes
    accepted: tuple[float, ...]
    drafted: tuple[float, ...]
    drafter_tokens: tuple[int, ...]

    def estimates(self, positions: int) -> list[float]:
        """a_1..a_positions from this conversation's counts (:data:`MEMORY_PRIOR` where there are none)."""
        return _estimates(self.accepted, self.drafted, positions)

    def kept(self) -> list[tuple[int, ...]]:
        """The drafter cache this conversation's previous answer left, as the join's plan counts it."""
        return [self.drafter_tokens] if self.drafter_tokens else []


def prior_estimates(positions: int) -> list[float]:
    """a_1..a_positions of a conversation with no earlier answers."""
    return _estimates((), (), positions)


def _estimates(accepted: Sequence[float], drafted: Sequence[float], positions: int) -> list[float]:
    pad = lambda counts: (list(counts) + [0.0] * positions)[:positions]  # noqa: E731
    return acceptance_estimates(pad(accepted), pad(drafted), ACCEPTANCE_PRIOR_STRENGTH, MEMORY_PRIOR)


class ConversationMemory:
    """Each conversation's latest recorded answer (:class:`Turn`), found by the prompts that continue it.
    Thread-safe."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._turns: OrderedDict[tuple[int, bytes], Turn] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def lookup(self, prompt_ids: Sequence[int]) -> Turn | None:
        """The turn of the longest recorded prompt that ``prompt_ids`` continues (strictly longer), or None."""
        with self._lock:
            candidates = sorted((t for t in self._turns.values() if t.length < len(prompt_ids)
                                 and tuple(prompt_ids[:len(t.head)]) == t.head
                                 and tuple(prompt_ids[max(0, t.length - _EDGE):t.length]) == t.tail),
                                key=lambda t: -t.length)
            for turn in candidates:
                if _digest(prompt_ids[:turn.length]) == turn.digest:
                    self._turns.move_to_end((turn.length, turn.digest))
                    return turn
        return None

    def record(self, prompt_ids: Sequence[int], previous: Turn | None, drafted_per_position: Sequence[int],
               accepted_per_position: Sequence[int], drafter_tokens: Sequence[int] = ()) -> Turn:
        """File a finished answer to ``prompt_ids``, which started from ``previous`` (its :meth:`lookup`);
        ``drafter_tokens``: what its drafter cache holds after it (its prompt less the last token, then the answer)."""
        accepted, drafted = (previous.accepted, previous.drafted) if previous is not None else ((), ())
        size = max(len(drafted), len(drafted_per_position))
        accepted = [x * MEMORY_DECAY for x in accepted] + [0.0] * (size - len(accepted))
        drafted = [x * MEMORY_DECAY for x in drafted] + [0.0] * (size - len(drafted))
        for i, (d, a) in enumerate(zip(drafted_per_position, accepted_per_position)):
            drafted[i] += d
            accepted[i] += a
        turn = Turn(len(prompt_ids), tuple(prompt_ids[:_EDGE]), tuple(prompt_ids[-_EDGE:]), _digest(prompt_ids),
                    tuple(accepted), tuple(drafted), tuple(drafter_tokens))
        with self._lock:
            key = (turn.length, turn.digest)
            self._turns.pop(key, None)
            self._turns[key] = turn
            while len(self._turns) > self.max_entries:
                self._turns.popitem(last=False)
        return turn

    def clear(self) -> None:
        with self._lock:
            self._turns.clear()
