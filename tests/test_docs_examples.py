"""The README's and docs' examples as a reader meets them: the marked ones run, the rest parse, the links resolve.

A fenced ``bash`` or ``python`` block in README.md or docs/*.md is *runnable*
when the line before its fence is an HTML comment that GitHub does not show:

* ``<!-- runnable -->``: run as written, in order with the page's other
  runnable blocks, in one scratch folder per page that links to the
  repository's top-level files (so ``. .venv/bin/activate`` and
  ``open("README.md")`` work and what a block writes, e.g. ``report.txt``,
  is there for the next block). Python blocks run with the venv's Python,
  shell blocks through bash with ``.venv/bin`` first on PATH; stdin is empty
  (so ``rapidspec chat`` ends at once), each block has a time limit.
* ``<!-- runnable: server -->``: a block that starts ``rapidspec serve``: it
  runs in the background until ``/health`` answers on its ``--port`` (8000
  without one); the page's later blocks call it; it is stopped after the page.
* ``<!-- expect: TEXT -->`` on the lines right after a runnable block's
  closing fence: what the block prints must contain TEXT (the result the page
  promises, such as the answer to the built-in document's question).

Every other ``bash``/``python`` block must at least parse (``bash -n``,
``compile``). A block that reads a file the reader supplies is told apart:
``$DATA`` only after the page's prose has said what ``$DATA`` is, and a
``--data``/``--document`` file that neither the repository holds nor an
earlier runnable block of the page writes only when the page's prose names
it in backticks. Relative links must point to files that exist and
``#anchors`` to headings that exist (GitHub's slugs).

The runnable examples load the built-in model, so that test is ``slow``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests.server_harness import HTTP, wait_until

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = ROOT / ".venv" / "bin" if (ROOT / ".venv" / "bin" / "rapidspec").exists() else Path(sys.executable).parent
LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
BLOCK_TIMEOUT_S = 300
SERVER_START_S = 240
PORT_WAIT_S = 300
FENCE = re.compile(r"^(\s*)```(\w*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*runnable(?::\s*(\w+))?\s*-->\s*$")
EXPECT = re.compile(r"^\s*<!--\s*expect:\s*(.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "bash" or "python"; "" for other blocks
    code: str
    marker: str | None  # None, "run" or "server"
    expect: tuple[str, ...] = ()  # what its output must contain (``<!-- expect: ... -->`` after its fence)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, indentation removed, each with the marker on the line before its fence."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).lower()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end])
        marker = MARKER.match(lines[i - 1]) if i else None
        expect, after = [], end + 1
        while after < len(lines) and (m := EXPECT.match(lines[after])):
            expect.append(m.group(1))
            after += 1
        found.append(Block(page, i + 1, LANGS.get(info, ""), code + "\n",
                           None if marker is None else (marker.group(1) or "run"), tuple(expect)))
        i = end + 1
    return found


def prose(page: Path) -> str:
    """The page's text outside fenced blocks."""
    inside, kept = False, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


ALL = [b for page in PAGES for b in blocks(page)]
SHELL_AND_PYTHON = [b for b in ALL if b.lang]
PAGES_WITH_RUNNABLE = sorted({b.page for b in ALL if b.marker}, key=PAGES.index)
# pages whose examples start a server on a fixed port run on one pytest-xdist worker, one after the other
PAGES_WITH_SERVERS = {b.page for b in ALL if b.marker == "server"}
RUNNABLE_PARAMS = [pytest.param(page, marks=[pytest.mark.xdist_group("docs-servers")] if page in PAGES_WITH_SERVERS
                                else []) for page in PAGES_WITH_RUNNABLE]


def test_markers_sit_on_shell_or_python_blocks():
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if "runnable" in line and line.strip().startswith("<!--"):
                assert MARKER.match(line), f"{page.name}:{n + 1}: unknown marker {line.strip()!r}"
                fence = FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
                assert fence and fence.group(2) in LANGS, f"{page.name}:{n + 1}: the marker is not on a bash/python fence"
    servers = [b for b in ALL if b.marker == "server"]
    assert all(b.lang == "bash" and "rapidspec serve" in b.code for b in servers), [b.where for b in servers]
    expecting = [b for b in ALL if b.expect]
    assert all(b.marker == "run" for b in expecting), [b.where for b in expecting if b.marker != "run"]
    for page in PAGES:  # an expect comment anywhere else would be silently ignored
        text = page.read_text(encoding="utf-8")
        assert text.count("<!-- expect:") == sum(len(b.expect) for b in ALL if b.page == page), page.name
    assert any(b.marker == "run" for b in ALL if b.page.name == "README.md"), "the README has no runnable example"


@pytest.mark.parametrize("block", [b for b in SHELL_AND_PYTHON if not b.marker], ids=lambda b: b.where)
def test_unmarked_blocks_parse(block):
    if block.lang == "python":
        compile(block.code, block.where, "exec")
    else:
        done = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True, timeout=30)
        assert done.returncode == 0, f"{block.where}: {done.stderr}"


def _files_written(code: str) -> set[str]:
    """Files a shell or Python block writes: ``> FILE``, ``--out FILE``, ``--results FILE``, ``open(FILE, "w")``."""
    return set(re.findall(r"(?:>|--out|--results|--result-file)\s+([\w./-]+)", code)) | set(
        re.findall(r"open\(\"([\w./-]+)\",\s*\"w", code))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_files_the_reader_supplies_are_named(page):
    text, written, problems = prose(page), set(), []
    for block in (b for b in blocks(page) if b.lang):
        if block.marker:
            written |= _files_written(block.code)
            continue
        if "$DATA" in block.code and not re.search(r"`\$DATA` is\s", text):
            problems.append(f"{block.where}: uses $DATA, and the page never says what $DATA is")
        code = re.sub(r"(^|\s)#.*$", "", block.code, flags=re.M)  # comments
        for path in sorted(set(re.findall(r"--(?:data|document|dataset)[ =]([^\s$\\]+)", code))):
            if path in {"-", "PATH", "FILE"} or (ROOT / path).exists() or path in written:
                continue
            if f"`{path}`" not in text:
                problems.append(f"{block.where}: reads {path}, which the page does not name as the reader's file")
    assert not problems, "\n".join(problems)


# --- links and anchors --------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            continue
        m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


def test_github_slug_rules():
    assert github_slug("Self-speculation on QuALITY (n = 112, 2026-11-25)") == "self-speculation-on-quality-n--112-2026-11-25"
    assert github_slug("The first token: rapid against `lc`") == "the-first-token-rapid-against-lc"
    assert github_slug("snake_case [a link](x.md)") == "snake_case-a-link"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)) + IMAGE.findall(prose(page)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


# --- running the marked examples ----------------------------------------------------------------------------------


def _scratch(tmp_path: Path) -> Path:
    """A folder that looks like the repository root (its top-level entries linked) and keeps what examples write."""
    work = tmp_path / "clone"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git"}:
            (work / entry.name).symlink_to(entry)
    return work


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


def _port_of(code: str) -> int:
    m = re.search(r"--port[ =](\d+)", code)
    return int(m.group(1)) if m else 8000


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start_server(block: Block, work: Path, env: dict[str, str]) -> subprocess.Popen:
    """The block's server, once ``/health`` answers from it (its pid in our process group: another server on the
    port, another worker's or anyone's, does not count); started again, bounded, when the port was taken first."""
    port = _port_of(block.code)
    log_path = work / f"server_{block.line}.log"
    deadline = time.monotonic() + PORT_WAIT_S + SERVER_START_S
    while time.monotonic() < deadline:
        # another worker's test may hold the port for a while (pytest-xdist): wait for it, bounded
        if not wait_until(lambda: not _port_taken(port), timeout=PORT_WAIT_S, every=1.0):
            pytest.skip(f"{block.where} serves on port {port}, which something else held for {PORT_WAIT_S} s")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(["bash", "-c", block.code], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() < deadline and proc.poll() is None:
            if _ours(port, proc):
                return proc
            time.sleep(0.5)
        if proc.poll() is None:
            break
        output = log_path.read_text()
        if "address already in use" not in output:
            pytest.fail(f"{block.where} exited ({proc.returncode}):\n{output[-3000:]}")
    _stop(proc)
    pytest.fail(f"{block.where}: no /health of its own on port {port} within {PORT_WAIT_S + SERVER_START_S} s")


def _ours(port: int, proc: subprocess.Popen) -> bool:
    """``/health`` on ``port`` answers, from a process of ``proc``'s group."""
    try:
        response = HTTP.get(f"http://127.0.0.1:{port}/health", timeout=2)
        return response.status_code == 200 and os.getpgid(int(response.json()["pid"])) == proc.pid
    except (httpx.HTTPError, ValueError, KeyError, TypeError, ProcessLookupError, PermissionError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(block: Block, work: Path, env: dict[str, str]) -> float:
    """Run the block as a reader would; its seconds. What it prints must contain each of ``block.expect``."""
    start = time.monotonic()
    if block.lang == "python":
        script = work / f"example_{block.page.stem}_{block.line}.py"
        script.write_text(block.code)
        command = [str(VENV_BIN / "python"), script.name]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    try:
        done = subprocess.run(command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{block.where} ran past {BLOCK_TIMEOUT_S} s; output:\n{(err.stdout or '')[-2000:]}")
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    missing = [text for text in block.expect if text not in done.stdout]
    assert not missing, f"{block.where} printed none of {missing}:\n{done.stdout[-3000:]}"
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PARAMS, ids=lambda p: p.name)
def test_runnable_examples_run_as_written(page, tmp_path, tmp_path_factory):
    work, env, servers = _scratch(tmp_path), _environment(), []
    # the pages share one key/value cache on disk, as a user's examples share ~/.cache/rapidspec/kv: the built-in
    # document is read once in the run, not once per example (the workers of one run share the folder)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    env["RAPIDSPEC_KV_CACHE"] = str(base.parent / f"docs-kv-{run}" if run else base / "docs-kv")
    try:
        for block in (b for b in blocks(page) if b.marker):
            if block.marker == "server":
                servers.append(_start_server(block, work, env))
            else:
                print(f"{block.where}: {_run(block, work, env):.1f} s")
    finally:
        for proc in servers:
            _stop(proc)


def test_a_block_that_does_not_print_what_its_page_expects_fails(tmp_path):
    block = Block(ROOT / "README.md", 1, "bash", "echo 'closes at 4:30 pm'\n", "run", ("4:30",))
    assert _run(block, tmp_path, _environment()) >= 0
    with pytest.raises(AssertionError, match="printed none of"):
        _run(Block(ROOT / "README.md", 1, "bash", "echo 'closes at noon'\n", "run", ("4:30",)), tmp_path, _environment())
