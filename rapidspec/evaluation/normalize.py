"""SQuAD's answer normalisation, shared by the scorers and the answer reader."""

from __future__ import annotations

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def strip_punctuation(text: str) -> str:
    """``text`` without ASCII punctuation (``string.punctuation``)."""
    return "".join(ch for ch in text if ch not in _PUNCTUATION)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze spaces."""
    text = strip_punctuation(text.lower())
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())
