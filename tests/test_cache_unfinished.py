"""A writer killed mid-write leaves a temporary no reader opens; `rapidspec serve` removes it when it starts and
says what it dropped (rapidspec.runtime.cache_dir.drop_unfinished)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rapidspec.cli.serve import announce_unfinished
from rapidspec.runtime.cache_dir import drop_unfinished
from tests.server_harness import HTTP, free_port, serve_subprocess, wait_until

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


@pytest.mark.slow
def test_a_serve_killed_while_it_writes_its_cache_starts_again_and_says_what_it_dropped(tmp_path):
    """End to end: `rapidspec serve` on an empty cache folder writes its first cache file (the built-in GGUF
    converted for the target) and is killed with SIGKILL in the middle of it; started again, it removes what
    the killed process left, says so, writes the file anew and answers."""
    env = {**os.environ, "RAPIDSPEC_CACHE": str(tmp_path), "RAPIDSPEC_KV_CACHE": ""}
    command = [sys.executable, "-m", "rapidspec", "serve", "--target", "builtin:smollm2-135m", "--port",
               str(free_port())]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        def writing() -> list[Path]:
            return [p for p in tmp_path.rglob("*") if p.name.startswith(".") and f".{first.pid}." in p.name]

        assert wait_until(lambda: writing() or first.poll() is not None, timeout=300, every=0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        first.kill()
    left = writing()
    assert left and first.returncode == -signal.SIGKILL
    final = [p.with_name(p.name[1:].split(f".{first.pid}.")[0]) for p in left]
    assert not any(p.exists() for p in final)  # nothing half-written under a name a reader opens

    with serve_subprocess("--target", "builtin:smollm2-135m", env=env) as (process, url):
        model = HTTP.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
        answer = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        process.kill()
        said = process.stdout.read().decode()
    assert "unfinished cache file(s)" in said and all(p.name in said for p in left[:3])
    assert not any(p.exists() for p in left) and all(p.exists() for p in final)
