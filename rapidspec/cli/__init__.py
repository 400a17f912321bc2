"""The ``rapidspec`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``handler(args) -> int`` returning the exit code. Two-word commands
(``rapidspec bench serve``) are parsers named with a dash (``bench-serve``);
``main`` joins the words before parsing. User mistakes raise
:class:`rapidspec.errors.RapidspecError`; ``main`` prints them as one line and
exits with code 2. Mistakes argparse finds (an invalid choice, an unknown
option) are one line too (:class:`Parser`), without the usage block.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from rapidspec.errors import RapidspecError

# Subcommand modules, in the order `rapidspec --help` lists them.
COMMANDS = ("generate", "chat", "serve", "demo", "retrieve", "bench", "bench_serve", "eval", "report", "models", "cache", "calibrate")
# `rapidspec bench serve ...` is the parser `bench-serve` (`rapidspec bench` takes no positional argument).
TWO_WORD_COMMANDS = {("bench", "serve"): "bench-serve"}


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as ``main`` prints a RapidspecError: the usage block of a
    command runs to 30 lines, above the one that says what is wrong (``--help`` still shows it). Its
    subcommands' parsers are of this class too (``add_subparsers`` makes them of their parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rapidspec",
        description="Long-context inference with retrieval-augmented speculative decoding (RAPID).",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress at INFO level, with transformers' model-loading bars and llama.cpp's warnings")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"rapidspec.cli.{name}").register(subparsers)
    return parser


def join_two_word_command(argv: list[str]) -> list[str]:
    """``argv`` with a two-word command (the first two words that are not options) as one word."""
    first = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if first is not None and tuple(argv[first:first + 2]) in TWO_WORD_COMMANDS:
        return [*argv[:first], TWO_WORD_COMMANDS[tuple(argv[first:first + 2])], *argv[first + 2:]]
    return argv


#: Options whose value is other options, as one string (``--serve-args '--gamma 6'``): argparse would read a
#: value starting with ``-`` as an option of its own, so it is joined to its option first.
OPTIONS_STRING_OPTIONS = ("--serve-args", "--peer-args")


def join_options_strings(argv: list[str]) -> list[str]:
    """``argv`` with ``--serve-args VALUE`` as ``--serve-args=VALUE`` (see :data:`OPTIONS_STRING_OPTIONS`)."""
    out, index = [], 0
    while index < len(argv):
        if argv[index] in OPTIONS_STRING_OPTIONS and index + 1 < len(argv):
            out.append(f"{argv[index]}={argv[index + 1]}")
            index += 2
        else:
            out.append(argv[index])
            index += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_options_strings(join_two_word_command(list(sys.argv[1:] if argv is None else argv))))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # llama.cpp's own warnings are about the model file, not about what the user asked (rapidspec.runtime.llama_log).
    logging.getLogger("llama.cpp").setLevel(logging.INFO if args.verbose else logging.ERROR)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except RapidspecError as err:
        print(f"rapidspec {getattr(args, 'command_name', args.command)}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rapidspec generate ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush does not fail again
        return 141  # as a process killed by SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
