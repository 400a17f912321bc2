"""`rapidspec chat`: the session loop on a tiny model (scripted input), and the command as a user runs it."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from rapidspec import DecodeConfig, Rapid
from rapidspec.cli import main
from rapidspec.cli.chat import ChatSession
from rapidspec.outputs import StreamChunk
from rapidspec.retrieval import RetrievalConfig
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96)
CONFIG = DecodeConfig(mode="rapid", max_new_tokens=8, ignore_eos=True)
LONG_TURN = "Day one: we planted tulips by the blue kettle and talked for hours. " * 12


def session(engine, lines, **options):
    script = iter(lines)

    def read(prompt):
        item = next(script, EOFError)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    return ChatSession(engine, CONFIG, console, read=read, **options), out


def test_turns_commands_and_history_reuse(tiny_model, tmp_path):
    engine = Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model)
    saved = tmp_path / "chat.json"
    chat, out = session(engine, [LONG_TURN, "", "And then?", "/stats", f"/save {saved}", "/bogus", "/reset", "/stats"],
                        system="Be brief.")
    chat.loop()
    text = out.getvalue()
    assert text.count("tok/s") == 2 and "(stopped)" not in text
    assert "mean accepted length" in text  # /stats prints the full table
    assert "unknown command /bogus" in text and "no answer yet" in text
    conversation = json.loads(saved.read_text(encoding="utf-8"))
    roles = [m["role"] for m in conversation["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages == [{"role": "system", "content": "Be brief."}]  # after /reset
    reused = [line for line in text.splitlines() if "reused" in line]
    assert "reused 0/" in reused[0] and "reused 0/" not in reused[1]  # turn 2 starts from turn 1's cache


def test_ctrl_c_stops_the_answer_and_keeps_the_session(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model)

    def interrupted(messages, **options):
        yield StreamChunk(text="partial")
        raise KeyboardInterrupt

    engine.stream_chat = interrupted
    chat, out = session(engine, ["hello", KeyboardInterrupt, "/exit", "never read"])
    chat.loop()
    text = out.getvalue()
    assert "partial" in text and "(stopped)" in text and "Ctrl-D or /exit" in text
    assert chat.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "partial"}]


def test_ctrl_c_during_the_prefill_leaves_no_empty_turn(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model)

    def interrupted(messages, **options):
        raise KeyboardInterrupt
        yield  # a generator that stops before its first chunk

    engine.stream_chat = interrupted
    chat, out = session(engine, ["hello", "/exit"])
    chat.loop()
    assert chat.messages == [] and "not kept" in out.getvalue()


def test_documents_are_the_long_context(tiny_model):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)),
                   target=tiny_model)
    chat, out = session(engine, ["What was planted?"], documents=[LONG_TURN * 3])
    chat.loop()
    assert "chunks retrieved" in out.getvalue()


@pytest.mark.parametrize("extra, message", [(["--document", "/nonexistent.txt"], "no such file"),
                                            (["--recent-messages", "-1"], "recent-messages")])
def test_user_mistakes_exit_2(capsys, extra, message):
    assert main(["chat", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_command_with_piped_input(tiny_model_dir):
    command = [sys.executable, "-c", "import sys; from rapidspec.cli import main; sys.exit(main())", "chat",
               "--target", str(tiny_model_dir), "--retrieval", "bm25", "--max-new-tokens", "4", "--dtype", "float32"]
    done = subprocess.run(command, input="Hello there\n/exit\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "you>" in done.stdout and "tok/s" in done.stdout


def test_chat_and_demo_default_to_the_measured_frequency_penalty(monkeypatch):
    """chat and demo answer with CHAT_FREQUENCY_PENALTY (measured: benchmarks/loops.py); generate keeps OpenAI's 0."""
    from rapidspec.cli import chat, demo, generate
    from rapidspec.cli.options import CHAT_FREQUENCY_PENALTY

    seen = {}
    for module in (chat, demo, generate):
        monkeypatch.setattr(module, "run", lambda args, name=module.__name__: seen.setdefault(name, args) and 0)
    for argv in (["chat"], ["demo"], ["generate", "--document", "x", "--question", "y"],
                 ["chat", "--frequency-penalty", "0"]):
        seen.clear()
        main(argv)
        (args,) = seen.values()
        expected = 0.0 if argv[0] == "generate" or "--frequency-penalty" in argv else CHAT_FREQUENCY_PENALTY
        assert args.frequency_penalty == expected, argv
    assert CHAT_FREQUENCY_PENALTY > 0
