"""rapidspec.prompting.textio.read_text: exact UTF-8, stdin, one-line errors."""

from __future__ import annotations

import io
import sys

import pytest

from rapidspec.errors import RapidspecError
from rapidspec.prompting.textio import read_text


def test_reads_utf8_exactly(tmp_path):
    text = "line one\r\nline two 😀 日本語\n\n"
    path = tmp_path / "a.txt"
    path.write_bytes(text.encode("utf-8"))
    assert read_text(path) == text
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # BOM dropped
    assert read_text(str(path)) == text


def test_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("a\r\nb".encode()), encoding="utf-8"))
    assert read_text("-") == "a\r\nb"


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.txt", "no such file"),
    (lambda p: p, "is a directory"),
])
def test_path_errors(tmp_path, make, message):
    with pytest.raises(RapidspecError, match=message):
        read_text(make(tmp_path))


def test_invalid_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(RapidspecError, match="not valid UTF-8 \\(byte 3"):
        read_text(path)
