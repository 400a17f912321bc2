"""A quiet terminal: no model-loading bars or llama.cpp log unless asked for, one-line argparse mistakes."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from rapidspec.cli import build_parser, main
from rapidspec.errors import RapidspecError
from rapidspec.models.loading import builtin_gguf_path, load_model
from rapidspec.runtime.llama_cpp import llama_cpp_available

# ---------------------------------------------------------------- transformers' bars


def test_a_model_loads_without_bars_unless_logging_asks(tiny_model_dir, capfd, caplog):
    caplog.set_level(logging.WARNING, logger="rapidspec")
    load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    caplog.set_level(logging.INFO, logger="rapidspec")
    load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    assert "Loading weights" in capfd.readouterr().err


def test_the_cli_shows_loading_bars_with_verbose_only(tiny_model_dir, tmp_path, capfd, caplog):
    document = tmp_path / "doc.txt"
    document.write_text("The cat is called Biscuit.\n\n" * 5, encoding="utf-8")
    argv = ["generate", "--target", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu", "--mode", "lc",
            "--document", str(document), "--question", "Cat?", "--max-new-tokens", "2"]
    caplog.set_level(logging.WARNING, logger="rapidspec")  # as the command sets it without --verbose
    assert main(argv) == 0
    assert "Loading weights" not in capfd.readouterr().err
    # --verbose in a process of its own: main's logging set-up does nothing where pytest's handlers are installed
    run = subprocess.run([sys.executable, "-m", "rapidspec", "-v", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Loading weights" in run.stderr, run.stderr


def test_the_gguf_de_quantization_bar_shows_only_when_logging_asks(capfd, caplog):
    """transformers draws that bar with plain tqdm; everything else written to stderr in the block passes."""
    from tqdm.auto import tqdm

    from rapidspec.models.conversion import GGUF_BAR
    from rapidspec.runtime.progress_bars import plain_bar_hidden

    def convert():
        for _ in tqdm(range(3), desc=GGUF_BAR + "..."):
            pass
        print("a real warning", file=sys.stderr)

    caplog.set_level(logging.WARNING, logger="rapidspec")
    with plain_bar_hidden(GGUF_BAR):
        convert()
    assert capfd.readouterr().err == "a real warning\n"
    caplog.set_level(logging.INFO, logger="rapidspec")
    with plain_bar_hidden(GGUF_BAR):
        convert()
    err = capfd.readouterr().err
    assert GGUF_BAR in err and err.endswith("a real warning\n")


def test_transformers_packed_gguf_advice_only_when_logging_asks(caplog, monkeypatch):
    """transformers advises float32 for packed GGUF weights, which rapidspec never computes with."""
    from rapidspec.models.conversion import PACKED_ADVICE, without_packed_advice

    # transformers stops its records at its own logger once its logging is configured (which test does it first
    # depends on the order): caplog listens at the root
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    advising = logging.getLogger("transformers.quantizers.quantizer_gguf")
    for level, shown in ((logging.WARNING, False), (logging.INFO, True)):
        caplog.clear()
        caplog.set_level(level, logger="rapidspec")
        with caplog.at_level(logging.WARNING, logger=advising.name), without_packed_advice():
            advising.warning("Loading a GGUF checkpoint with its %s, ...", PACKED_ADVICE)
            advising.warning("something else")
        messages = [r.getMessage() for r in caplog.records if r.name == advising.name]
        assert (any(PACKED_ADVICE in m for m in messages), "something else" in messages) == (shown, True)
    assert not advising.filters


# ---------------------------------------------------------------- llama.cpp's log

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")


@pytest.mark.slow  # loads a built-in model's GGUF in llama.cpp
@needs_llama_cpp
def test_llama_cpp_logs_to_logging_not_to_stderr(capfd, caplog):
    from rapidspec.runtime.llama_cpp import LlamaCppModel

    capfd.readouterr()
    LlamaCppModel(builtin_gguf_path("builtin:smollm2-135m"), threads=1).new_context(64)
    assert capfd.readouterr().err == ""
    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
        LlamaCppModel(builtin_gguf_path("builtin:smollm2-135m"), threads=1).new_context(64)
    assert capfd.readouterr().err == ""
    lines = [r.getMessage() for r in caplog.records if r.name == "llama.cpp"]
    assert any("llama_model_loader" in line for line in lines) and all(line == line.strip() for line in lines)


@pytest.mark.slow  # loads a built-in model's GGUF in llama.cpp
@needs_llama_cpp
def test_qwen_s_control_token_warning_is_info(capfd, caplog):
    from rapidspec.runtime.llama_cpp import LlamaCppModel

    try:
        path = builtin_gguf_path("builtin:qwen2.5-coder-0.5b")
    except RapidspecError:
        pytest.skip("Qwen2.5-Coder 0.5B is not installed")
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="llama.cpp"):
        LlamaCppModel(path, threads=1)
    assert capfd.readouterr().err == ""
    (record,) = [r for r in caplog.records if "control-looking token" in r.getMessage()]
    assert record.levelno == logging.INFO and record.name == "llama.cpp"


def test_harmless_llama_cpp_warnings_are_info_the_rest_warnings(caplog):
    from rapidspec.runtime.llama_log import on_log

    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
        on_log(3, b"load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug\n", None)
        on_log(3, b"llama_context: something else\n", None)
        on_log(4, b"llama_model_load: error loading model\n", None)
        on_log(2, b"print_info: file type   = Q4_1\n", None)
        on_log(5, b".", None)
        on_log(5, b"\n", None)  # an empty continuation: no record
    assert [(r.levelno, r.getMessage()[:20]) for r in caplog.records] == [
        (logging.INFO, "load: control-lookin"),
        (logging.WARNING, "llama_context: somet"),
        (logging.ERROR, "llama_model_load: er"),
        (logging.DEBUG, "print_info: file typ"),
        (logging.DEBUG, "."),
    ]


def test_the_cli_shows_llama_cpp_warnings_with_verbose_only(tmp_path, monkeypatch):
    llama_log = logging.getLogger("llama.cpp")
    monkeypatch.setattr(llama_log, "level", llama_log.level)  # restored after the test
    for verbose, level in ((False, logging.ERROR), (True, logging.INFO)):
        main(["-v"] * verbose + ["retrieve", "--document", str(tmp_path / "missing.txt"), "--question", "q"])
        assert llama_log.level == level


# ---------------------------------------------------------------- argparse mistakes


def _choice_arguments() -> list[tuple[str, list[str]]]:
    """(command, arguments with an invalid choice) for every subcommand that has an argument with choices."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    cases = []
    for name, sub in commands.choices.items():
        action = next((a for a in sub._actions if a.choices), None)
        if action is not None:
            cases.append((name, [action.option_strings[0], "fast"] if action.option_strings else ["fast"]))
    return cases


@pytest.mark.parametrize("command, arguments", _choice_arguments())
def test_an_invalid_choice_is_one_line(command, arguments, capsys):
    words = command.split("-")  # bench-serve is `rapidspec bench serve`
    with pytest.raises(SystemExit) as exit_info:
        main([*words, *arguments])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and "invalid choice: 'fast' (choose from" in err, err
    assert err.startswith(f"rapidspec {' '.join(words)}: error: argument ")


def test_an_unknown_command_and_a_missing_argument_are_one_line(capsys):
    for argv in (["fly"], ["generate", "--question", "q"]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error:" in err, err
