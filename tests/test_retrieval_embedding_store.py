"""Chunk embeddings on disk: reused across processes, a new key whenever the text, chunking or embedder changes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig, Retriever
from rapidspec.retrieval.embedding_store import EmbeddingStore, default_directory
from tests.retrieval_stand_ins import BagOfWordsEmbedder, haystack
from tests.test_retrieval_retriever import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class CountingEmbedder(BagOfWordsEmbedder):
    """Counts the texts it embeds besides the fingerprint's probe (one text)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        self.texts = 0

    def encode(self, texts, **kwargs):
        if len(texts) > 1 or "probe" not in texts[0]:
            self.texts += len(texts)
        return super().encode(texts, **kwargs)


def embedding_files(folder):
    return [p for p in folder.glob("*.npy") if not p.name.startswith("chunks-")]


def retriever(tok, embedder, folder, chunk_tokens=64, gib=1.0):
    config = RetrievalConfig(method="dense", chunk_tokens=chunk_tokens, embedding_store_gib=gib)
    r = Retriever(config, tokenizer=tok, embedder=embedder)
    if r._store is not None:
        r._store.directory = folder
    return r


def test_a_second_retriever_reads_the_embeddings_instead_of_embedding(tok, tmp_path):
    doc = haystack(60)
    first, again = CountingEmbedder(), CountingEmbedder()
    expected = retriever(tok, first, tmp_path).retrieve(doc, "winter garden")
    assert first.texts > 10 and len(embedding_files(tmp_path)) == 1
    result = retriever(tok, again, tmp_path).retrieve(doc, "winter garden")
    assert again.texts == 1  # the query only
    assert [c.index for c in result.chunks] == [c.index for c in expected.chunks]


@pytest.mark.parametrize("change", ["document", "chunking", "embedder"])
def test_a_change_is_a_new_key(tok, tmp_path, change):
    doc = haystack(60)
    retriever(tok, CountingEmbedder(), tmp_path).retrieve(doc, "winter")
    embedder = CountingEmbedder(dim=32 if change == "embedder" else 64)
    other = retriever(tok, embedder, tmp_path, chunk_tokens=48 if change == "chunking" else 64)
    other.retrieve(haystack(60, seed=1) if change == "document" else doc, "winter")
    assert embedder.texts > 10 and len(embedding_files(tmp_path)) == 2


def test_off_when_the_size_is_zero(tok, tmp_path):
    r = retriever(tok, CountingEmbedder(), tmp_path, gib=0)
    assert r._store is None
    r.retrieve(haystack(20), "winter")
    assert not list(tmp_path.glob("*.npy"))
    with pytest.raises(RapidspecError, match="embedding_store_gib"):
        RetrievalConfig(embedding_store_gib=-1)


def test_an_unreadable_or_mismatched_file_is_replaced(tok, tmp_path):
    doc = haystack(40)
    retriever(tok, CountingEmbedder(), tmp_path).retrieve(doc, "winter")
    [path] = embedding_files(tmp_path)
    path.write_bytes(b"not an array")
    embedder = CountingEmbedder()
    retriever(tok, embedder, tmp_path).retrieve(doc, "winter")
    assert embedder.texts > 10 and np.load(path).dtype == np.float32
    np.save(path, np.zeros((1, 64), dtype=np.float32))  # the wrong number of rows
    embedder = CountingEmbedder()
    retriever(tok, embedder, tmp_path).retrieve(doc, "winter")
    assert embedder.texts > 10


def test_the_store_keeps_the_most_recent_within_its_bound(tmp_path):
    store = EmbeddingStore(tmp_path, max_bytes=3 * (128 + 100 * 64 * 4))  # room for three files
    for i in range(5):
        store.save(f"k{i}", np.full((100, 64), i, dtype=np.float32))
        os.utime(tmp_path / f"k{i}.npy", (i, i))  # k0 the oldest
    assert sorted(p.stem for p in tmp_path.glob("*.npy")) == ["k2", "k3", "k4"]
    assert store.load("k4", 100)[0, 0] == 4 and store.load("k0", 100) is None


def test_a_store_that_cannot_be_written_is_logged_once(tok, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="rapidspec"):
        for seed in range(2):
            retriever(tok, CountingEmbedder(), blocked / "embeddings").retrieve(haystack(20, seed=seed), "winter")
    assert caplog.text.count("cannot store embeddings") <= 2  # once per store; the answers came


def test_reused_across_processes(tmp_path):
    """A second process reads what the first stored: its embedder refuses to embed chunks."""
    script = textwrap.dedent("""
        import sys
        from tests.byte_tokenizer import build_byte_tokenizer
        from tests.retrieval_stand_ins import BagOfWordsEmbedder, haystack
        from rapidspec.retrieval import RetrievalConfig, Retriever

        class Refusing(BagOfWordsEmbedder):
            def encode(self, texts, **kwargs):
                assert len(texts) == 1, "embedded chunks instead of reading them"
                return super().encode(texts, **kwargs)

        embedder = Refusing() if sys.argv[1] == "second" else BagOfWordsEmbedder()
        r = Retriever(RetrievalConfig(method="dense", chunk_tokens=64), tokenizer=build_byte_tokenizer(),
                      embedder=embedder)
        print(r.retrieve(haystack(60), "winter garden").text[:80])
    """)
    env = os.environ | {"RAPIDSPEC_EMBEDDING_STORE": str(tmp_path)}
    outputs = [subprocess.run([sys.executable, "-c", script, which], capture_output=True, text=True, env=env,
                              timeout=120) for which in ("first", "second")]
    assert all(o.returncode == 0 for o in outputs), outputs[1].stderr[-1000:]
    assert outputs[0].stdout == outputs[1].stdout and len(embedding_files(tmp_path)) == 1


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDSPEC_EMBEDDING_STORE", str(tmp_path / "x"))
    assert default_directory() == tmp_path / "x"
    monkeypatch.delenv("RAPIDSPEC_EMBEDDING_STORE")
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path))
    assert default_directory() == tmp_path / "embeddings"


def test_a_second_retriever_reads_the_chunks_without_a_splitter(tok, tmp_path):
    """Chunk boundaries are stored too: a fresh retriever builds no chunker for a stored document."""
    doc = haystack(60)
    first = retriever(tok, CountingEmbedder(), tmp_path)
    expected = first.retrieve(doc, "winter garden")
    again = retriever(tok, CountingEmbedder(), tmp_path)
    assert again.chunks(doc) == first.chunks(doc) and again._chunkers == {}
    assert [c.text for c in again.retrieve(doc, "winter garden").chunks] == [c.text for c in expected.chunks]


@pytest.mark.parametrize("change", ["document", "chunk size", "tokenizer"])
def test_stored_chunks_follow_the_text_the_size_and_the_tokenizer(tok, tmp_path, change):
    from tests.conftest import train_bpe_tokenizer
    from tests.retrieval_stand_ins import NEEDLE, WORDS

    doc = haystack(60)
    retriever(tok, CountingEmbedder(), tmp_path).chunks(doc)
    other_tok = train_bpe_tokenizer([" ".join(WORDS[::-1])] * 3 + [NEEDLE], 300) if change == "tokenizer" else tok
    other = retriever(other_tok, CountingEmbedder(), tmp_path, chunk_tokens=48 if change == "chunk size" else 64)
    other.chunks(haystack(60, seed=1) if change == "document" else doc)
    assert other._chunkers != {}  # chunked, not read


def test_stored_chunks_that_do_not_fit_the_document_are_ignored(tok, tmp_path):
    doc = haystack(60)
    first = retriever(tok, CountingEmbedder(), tmp_path)
    expected = first.chunks(doc)
    key = first._chunks_key(doc, 64)
    first._store.save(key, np.array([[5, 3, 1]], dtype=np.int64))  # an end before its start
    again = retriever(tok, CountingEmbedder(), tmp_path)
    assert again.chunks(doc) == expected and again._chunkers != {}
