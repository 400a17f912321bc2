"""A writer killed mid-write leaves a temporary no reader opens; `rapidspec serve` removes it when it starts and
says what it dropped (rapidspec.runtime.cache_dir.drop_unfinished)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from rapidspec.cli.serve import announce_unfinished
from rapidspec.runtime.cache_dir import drop_unfinished

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rapidspec.runtime.cache_dir import cache_write

    def write(temporary):
        with open(temporary, "wb") as out:
            out.write(b"half of a block")
            out.flush()
            print("writing", flush=True)
            time.sleep(60)  # killed here
            out.write(b" and the rest")

    cache_write(Path(sys.argv[1]), write, "a test file", "nothing")
""")


def killed_mid_write(target: Path) -> Path:
    """The temporary a writer left when SIGKILL stopped it in the middle of :func:`cache_write`."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    [left] = [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]
    return left


def test_a_killed_writers_temporary_is_dropped_and_a_live_ones_kept(tmp_path):
    target = tmp_path / "kv" / "model" / "block.safetensors"
    left = killed_mid_write(target)
    assert not target.exists() and left.read_bytes() == b"half of a block"
    live = target.with_name(f".other.safetensors.{os.getpid()}.0123456789ab.tmp")  # this process: a write under way
    live.write_bytes(b"in progress")
    folder = tmp_path / "gguf" / f".copy.{left.name.split('.')[-3]}.abcdef012345.tmp"  # a killed writer's folder
    (folder / "inner").mkdir(parents=True)
    assert sorted(drop_unfinished(tmp_path)) == sorted([left, folder])
    assert not left.exists() and not folder.exists() and live.exists()
    assert drop_unfinished(tmp_path) == []


def test_serve_says_what_it_dropped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path))
    left = killed_mid_write(tmp_path / "step_costs.json")
    assert announce_unfinished() == [left]
    err = capsys.readouterr().err
    assert "removed 1 unfinished cache file(s)" in err and left.name in err
    assert announce_unfinished() == [] and capsys.readouterr().err == ""


ASSEMBLER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from rapidspec.models.store import assemble_parts

    print("assembling", flush=True)
    assemble_parts([Path(sys.argv[1])], Path(sys.argv[2]), 1 << 20, "0" * 64)  # the part is a pipe nobody writes
""")


def test_a_killed_model_install_leaves_a_temporary_serve_drops(tmp_path):
    """The model store assembles a model file under its writer's pid too: killed while it reads a part (a pipe
    that never delivers), it leaves a temporary that the sweep at `serve`'s start recognises and removes."""
    part, models = tmp_path / "part.fifo", tmp_path / "models"
    os.mkfifo(part)
    destination = models / "model.gguf"
    writer = subprocess.Popen([sys.executable, "-c", ASSEMBLER, str(part), str(destination)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "assembling"
        with open(part, "wb") as feed:  # returns once the assembler has the pipe open: its temporary exists
            feed.write(b"half of a model")
            feed.flush()
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=30)
    finally:
        writer.kill()
    [left] = [p for p in models.iterdir() if p.name.startswith(".model.gguf.")]
    assert not destination.exists()
    assert drop_unfinished(tmp_path) == [left] and not left.exists()
