"""``rapidspec chat``: an interactive terminal chat whose history is the long context.

Each answer streams as it is generated, then one dim line of statistics.
The conversation goes through :meth:`rapidspec.Rapid.stream_chat`, as the
server's does: without ``--document`` the earlier turns are the drafter's
retrieval corpus, and the target's cache of the history is reused turn after
turn. Commands: ``/reset``, ``/stats``, ``/save FILE``, ``/help``, ``/exit``.
Ctrl-C stops the current answer (what was shown is kept); Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from rapidspec.cli.options import (
    CHAT_FREQUENCY_PENALTY,
    add_decode_options,
    add_model_options,
    add_kv_cache_options,
    add_prefix_cache_option,
    add_retrieval_options,
    decode_config,
    load_engine,
)
from rapidspec.cli.prefill_bar import prefill_bar
from rapidspec.cli.render import stats_table
from rapidspec.config import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import DEFAULT_RECENT_MESSAGES
from rapidspec.prompting.textio import read_text

HELP = "/reset  start over   /stats  last answer's statistics   /save FILE  write the conversation as JSON   /exit  leave"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat in the terminal; the history (or a document) is the long context",
        description=f"{__doc__.split(chr(10) + chr(10))[1]} Commands: {HELP}.",
    )
    parser.add_argument("--document", action="append", default=[], help="a document to chat about (repeatable; - for stdin)")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--recent-messages", type=int, default=DEFAULT_RECENT_MESSAGES,
                        help="earlier messages the drafter always reads verbatim (default: %(default)s)")
    add_prefix_cache_option(parser)
    add_kv_cache_options(parser)
    add_model_options(parser)
    add_decode_options(parser)
    add_retrieval_options(parser)
    parser.set_defaults(handler=run, frequency_penalty=CHAT_FREQUENCY_PENALTY)  # answers loop less (options.py)


def run(args: argparse.Namespace) -> int:
    config = decode_config(args)
    if args.recent_messages < 0:
        raise RapidspecError(f"--recent-messages must be >= 0, got {args.recent_messages}")
    documents = [read_text(path) for path in args.document]
    for path, text in zip(args.document, documents):
        if not text.strip():
            raise RapidspecError(f"the document {path} is empty")
    console = Console(highlight=False)
    with console.status("loading the models..."):
        engine = load_engine(args)
    ChatSession(engine, config, console, documents, args.system, args.recent_messages,
                prefill_progress=prefill_bar(args.quiet)).loop()
    return 0


class ChatSession:
    """The conversation and the read-answer loop; ``read`` is the prompt function (``console.input``)."""

    def __init__(
        self,
        engine,
        config: DecodeConfig,
        console: Console,
        documents: list[str] = (),
        system: str | None = None,
        recent_messages: int = DEFAULT_RECENT_MESSAGES,
        read: Callable[[str], str] | None = None,
        prefill_progress=None,
    ) -> None:
        self.engine, self.config, self.console = engine, config, console
        self.prefill_progress = prefill_progress
        self.documents, self.system, self.recent_messages = list(documents), system, recent_messages
        self.read = read or console.input
        self.messages: list[dict[str, str]] = []
        self.last_stats = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last_stats = None

    def loop(self) -> None:
        source = f"{len(self.documents)} document(s)" if self.documents else "the conversation"
        self.console.print(f"[dim]rapidspec chat, mode {self.config.mode}; the long context is {source}. {HELP}[/]")
        while True:
            try:
                line = self.read("[bold green]you>[/] ")
            except EOFError:
                self.console.print()
                return
            except KeyboardInterrupt:
                self.console.print("\n[dim](Ctrl-D or /exit to leave)[/]")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.answer(line)

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, argument = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.reset()
            self.console.print("[dim]conversation cleared[/]")
        elif name == "/stats":
            if self.last_stats is None:
                self.console.print("[dim]no answer yet[/]")
            else:
                self.console.print(stats_table([(self.last_stats.mode, self.last_stats)]))
        elif name == "/save":
            self.save(argument.strip())
        elif name == "/help":
            self.console.print(f"[dim]{HELP}[/]")
        else:
            self.console.print(f"[red]unknown command {escape(name)}[/] [dim]{HELP}[/]")
        return True

    def save(self, path: str) -> None:
        if not path:
            self.console.print("[red]usage: /save FILE[/]")
            return
        body = {"messages": self.messages, "documents": self.documents}
        try:
            Path(path).write_text(json.dumps(body, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            self.console.print(f"[red]cannot write {escape(path)}: {escape(err.strerror or str(err))}[/]")
            return
        self.console.print(f"[dim]saved {len(self.messages)} messages to {escape(path)}[/]")

    def answer(self, question: str) -> None:
        self.messages.append({"role": "user", "content": question})
        shown, output, stopped = [], None, False
        stream = self.engine.stream_chat(self.messages, documents=self.documents or None,
                                         recent_messages=self.recent_messages, config=self.config,
                                         prefill_progress=self.prefill_progress)
        try:
            for chunk in stream:
                if chunk.text:
                    shown.append(chunk.text)
                    self.console.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
                output = chunk.output or output
        except KeyboardInterrupt:
            stream.close()
            stopped = True
        except RapidspecError as err:
            self.messages.pop()
            self.console.print(f"[red]error: {escape(str(err))}[/]")
            return
        text = output.text if output is not None else "".join(shown)
        if stopped and not text:  # stopped during the prefill: no answer, so the question leaves the history too
            self.messages.pop()
            self.console.print("\n[dim](stopped before the answer began; the question was not kept)[/]")
            return
        self.messages.append({"role": "assistant", "content": text})
        self.console.print()
        if stopped:
            self.console.print("[dim](stopped)[/]")
        if output is not None:
            self.last_stats = output.stats
            self.console.print(f"[dim]{stats_line(output.stats)}[/]")


def stats_line(stats) -> str:
    parts = [f"{stats.new_tokens} tokens", f"{stats.decode_tokens_per_second or 0:.1f} tok/s"]
    if stats.acceptance_rate is not None:
        parts.append(f"acceptance {stats.acceptance_rate:.0%}, mean accepted {stats.mean_accepted_length:.2f}")
    parts.append(f"prefill {stats.target_prefill_seconds:.2f} s, reused {stats.target_prefill_reused_tokens}"
                 f"/{stats.prompt_tokens_target} tokens")
    if stats.retrieved_chunks:
        parts.append(f"drafter read {stats.prompt_tokens_drafter} tokens ({stats.retrieved_chunks} chunks retrieved)")
    return " · ".join(parts)
