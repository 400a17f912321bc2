"""Long prefills report their progress: the engine's callback and the CLI's bar."""

from __future__ import annotations

import io
import time

from rich.console import Console
from rich.progress import Progress

from rapidspec import Rapid
from rapidspec.cli import prefill_bar as bars
from rapidspec.retrieval import RetrievalConfig
from tests.specs import spec_of

DOCUMENT = "\n\n".join(f"Entry {i}: the harbour logged {i} ships." for i in range(120))


def test_the_engine_reports_each_target_prefill_chunk(tiny_model):
    calls = []
    rapid = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), prefill_chunk_tokens=512), target=tiny_model)
    rapid.generate(DOCUMENT, "How many ships in entry 7?", mode="lc", max_new_tokens=2,
                   prefill_progress=lambda done, total: calls.append((done, total)))
    total = calls[0][1]
    assert total > 2048 and calls[0] == (0, total) and calls[-1] == (total, total)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls) and len(calls) == -(-total // 512) + 1


def test_the_bar_shows_long_prefills_only_and_goes_away():
    stream = io.StringIO()
    progress = Progress(console=Console(file=stream, force_terminal=True, width=80))
    bar = bars.PrefillBar(progress)
    bar(0, 100)
    assert not progress.tasks  # short: nothing shown
    with progress:
        bar(0, 8192)
        time.sleep(0.01)
        bar(4096, 8192)
        assert progress.tasks[0].completed == 4096 and progress.tasks[0].total == 8192
        assert progress.tasks[0].fields["rate"].endswith(" tokens/s")  # the rate since the first chunk
        bar(8192, 8192)
        assert not progress.tasks  # done: removed


def test_no_bar_when_quiet_or_when_stderr_is_not_a_terminal(monkeypatch):
    assert bars.prefill_bar(quiet=True) is None
    monkeypatch.setattr(bars.sys.stderr, "isatty", lambda: False, raising=False)
    assert bars.prefill_bar(quiet=False) is None
    monkeypatch.setattr(bars.sys.stderr, "isatty", lambda: True, raising=False)
    assert isinstance(bars.prefill_bar(quiet=False), bars.PrefillBar)
