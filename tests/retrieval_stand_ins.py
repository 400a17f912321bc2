"""Retrieval's stand-ins shared by tests and by the processes they start (light to import: no torch, no
transformers): a haystack of random sentences with an optional needle, and a bag-of-words embedder."""

from __future__ import annotations

import random

import numpy as np

WORDS = (
    "the of and river mountain village winter summer merchant sailor garden letter window lantern "
    "market bridge harbor story evening morning travel old young quiet bright dark road"
).split()
NEEDLE = "The secret password for the vault is swordfish-42."


def haystack(paragraphs: int = 200, seed: int = 0, needle_at: int | None = None) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(paragraphs):
        sentences = [" ".join(rng.choices(WORDS, k=rng.randint(6, 14))).capitalize() + "." for _ in range(3)]
        if i == needle_at:
            sentences.insert(1, NEEDLE)
        out.append(" ".join(sentences))
    return "\n\n".join(out)


class BagOfWordsEmbedder:
    """A deterministic stand-in for a SentenceTransformer (hashing bag of words)."""

    def __init__(self, dim: int = 64) -> None:
        self.dim = dim
        self.calls = 0

    def encode(self, texts, **kwargs):
        self.calls += 1
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().replace(".", " ").replace("?", " ").split():
                out[row, sum(map(ord, word)) % self.dim] += 1.0
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)
