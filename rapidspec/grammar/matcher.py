"""One generation's place in its grammar, and the token masks that keep drafts and verification inside it.

Speculation explores token paths that may be rolled back: the drafter
proposes ``x_1..x_k``, the target verifies all of them at once, and only a
prefix survives. :class:`GrammarState` therefore answers "which tokens may
follow the committed answer and then ``path``?" for any path of drafts
(:meth:`GrammarState.mask_after`), moving llguidance's matcher along the
path and back (its ``rollback``), and remembers each mask of the round, so
the drafter's k masks are the target's first k rows' masks too. After
verification, :meth:`GrammarState.commit` rolls back to the committed answer
and consumes the emitted tokens: a rejected draft leaves no trace.

A mask is a ``[V]`` bool tensor (True = allowed). Masked logits are ``-inf``,
so p, q and p^ = softmax(z / T + eta * g) all live on the allowed tokens: with
eta = 0 every emitted token follows the constrained target distribution.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from rapidspec.errors import RapidspecError
from rapidspec.grammar.spec import Grammar


_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit i of a packed word is token 32 * word + i
#: Compiled grammars kept per tokenizer view: a request whose grammar came before starts from a copy.
KEPT_GRAMMARS = 64


class GrammarTokens:
    """llguidance's view of one tokenizer (made on first use, about a second for a 150K vocabulary), shared.

    ``vocab_size``: the logits' width the masks cover; ``eos_ids``: the tokens
    that end an answer (allowed where the grammar is complete).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._lltokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, object] = OrderedDict()  # llguidance text -> a matcher at its start, never moved

    def prepare(self) -> None:
        """Make the view now (the server does so on a preparing thread, before a request joins the batch)."""
        self._ll()

    def _ll(self):
        if self._lltokenizer is not None:
            return self._lltokenizer
        with self._lock:
            if self._lltokenizer is None:
                from llguidance.hf import from_tokenizer

                eos = sorted(t for t in self.eos_ids if 0 <= t < self.vocab_size)
                try:
                    self._lltokenizer = from_tokenizer(self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)),
                                                       eos_token=eos or None)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise RapidspecError(f"structured output needs a fast tokenizer: {exc}") from None
            return self._lltokenizer

    def start(self, grammar: Grammar, eos_only_at_end: bool = False) -> "GrammarState":
        """A fresh state at the start of ``grammar`` (RapidspecError when it cannot be built for this vocabulary).

        ``eos_only_at_end`` (a request's ``ignore_eos``): an end of answer is allowed only where the grammar allows
        nothing else, so the answer goes on wherever the grammar may and still ends where it must."""
        return GrammarState(self._compile(grammar).deep_copy(), self.vocab_size, self.eos_ids, eos_only_at_end)

    def _compile(self, grammar: Grammar):
        """llguidance's matcher at the start of ``grammar``: compiled once (about half a millisecond for a small
        grammar), then kept for the next ``KEPT_GRAMMARS`` grammars."""
        key = grammar.llguidance
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll(), grammar.llguidance, log_level=0)
        if matcher.is_error():
            raise RapidspecError(f"the {grammar.kind.replace('_', ' ')} cannot be used: {matcher.get_error()}",
                                 code="invalid_grammar")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher


class GrammarState:
    """Where one answer stands in its grammar; see the module docstring.

    ``matcher``: an llguidance ``LLMatcher`` at the committed answer;
    ``vocab_size``: mask width; ``eos_ids``: end-of-answer tokens (a path
    through one of them ends: the position after it allows everything, it is
    never emitted); ``eos_only_at_end``: see :meth:`GrammarTokens.start`.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int], eos_only_at_end: bool = False) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.eos_only_at_end = eos_only_at_end
        self._eos = sorted(t for t in eos_ids if 0 <= t < vocab_size)
        self._path: list[int] = []  # tokens the matcher consumed past the committed answer
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._everything = torch.ones(vocab_size, dtype=torch.bool)
        self._bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # [W] llguidance's packed mask

    @property
    def finished(self) -> bool:
        """The committed answer completes the grammar and nothing may follow (only an end of answer)."""
        return self.matcher.is_stopped()

    def mask_after(self, path: Sequence[int]) -> torch.Tensor:
        """The tokens allowed after the committed answer then ``path`` ([V] bool, CPU); ``path`` must be allowed."""
        key = tuple(path)
        mask = self._masks.get(key)
        if mask is not None:
            return mask
        if any(token in self.eos_ids for token in key):
            return self._everything  # past an end of answer: never emitted
        self._move_to(key)
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)  # 1 bit per token
        mask = ((self._bits[:, None] >> _SHIFTS) & 1).view(-1)[: self.vocab_size].bool()  # [W, 32] -> [V]
        if self.eos_only_at_end and not self.matcher.is_stopped():
            mask[self._eos] = False
        if not bool(mask.any()):  # an error state: let the answer end rather than sample from nothing
            mask[self._eos] = True
        self._masks[key] = mask
        return mask

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """The masks after each prefix of ``drafts``: rows 0..k ([k + 1, V] bool), as the target's rows."""
        return torch.stack([self.mask_after(drafts[:i]) for i in range(len(drafts) + 1)])

    def rows(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """The target's rows after each prefix of ``drafts`` with what the grammar forbids at -inf ([k + 1, V])."""
        return apply_mask(logits, self.masks(drafts))

    def row_after(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """A drafter's row after the committed answer then ``path`` with what the grammar forbids at -inf ([V])."""
        return apply_mask(logits, self.mask_after(path))

    def allowed_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar allows (drafts that did not see the masks: lookup's)."""
        for i, token in enumerate(drafts):
            mask = self.mask_after(drafts[:i])
            if not 0 <= token < mask.shape[0] or not bool(mask[token]):
                return i
        return len(drafts)

    def commit(self, emitted: Sequence[int]) -> None:
        """Roll back to the committed answer, then consume the round's emitted tokens (a new round starts)."""
        self._move_to(())
        tokens = [t for t in emitted if t not in self.eos_ids]
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused emitted tokens {tokens}: {self.matcher.get_error()}")
        self._masks.clear()

    def _move_to(self, path: tuple[int, ...]) -> None:
        common = 0
        for ours, theirs in zip(self._path, path):
            if ours != theirs:
                break
            common += 1
        if common < len(self._path):
            self.matcher.rollback(len(self._path) - common)
        rest = list(path[common:])
        if rest and not self.matcher.consume_tokens(rest):
            raise RuntimeError(f"the grammar refused drafted tokens {rest}: {self.matcher.get_error()}")
        self._path = list(path)


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens ``mask`` forbids at -inf ([..., V] and [..., V' >= V] bool; a new tensor)."""
    return logits.masked_fill(~mask[..., : logits.shape[-1]].to(logits.device), float("-inf"))
