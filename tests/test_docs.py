"""The documentation's code runs: every ```python block of README.md and docs/*.md is executed.

The convention (docs/testing.md#the-documentations-code):

- the ```python blocks of one file run in order, in one namespace, in a fresh process per file
  (tests/docs_runner.py), on the CPU, in an empty temporary directory, with ``TORSH_TRACE`` unset and a
  time limit per file; the process gets torchrun's environment for one process (``RANK=0``,
  ``WORLD_SIZE=1``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``init_from_env()`` and ``DDP(model)`` work
  there as under ``torchrun --nproc-per-node 1``;
- a block directly preceded by a line ``<!-- not run: REASON -->`` is not run (a reason is required);
  each such block is reported here as a skipped test with its reason;
- blocks in other languages (bash, console, json, text, none) are not run;
- a failure names the file and the first line of the block, and shows the traceback, whose lines point
  into the Markdown file.

``run_local`` works in a block: each rank it spawns runs that block again, alone, with ``__name__ !=
"__main__"`` (as it would re-import the block saved as a script), so a block that spawns processes must
stand on its own (its own imports) and keep the spawning call under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "docs_runner.py"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIME_LIMIT_S = 120
"""Per file: a file slower than this on the 2-core CPU machine should shrink its examples' sizes."""
RUN = ("python", "py", "python3")
"""Info strings of the blocks that run."""

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*not run\b(?P<rest>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int
    """Line number (1-based) of the block's first line of code (the one after the opening fence)."""
    lang: str
    code: str
    not_run: str | None = None
    """The reason given by a ``<!-- not run: REASON -->`` line directly above the fence."""


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown file, and the problems with its ``not run`` markers (a marker needs a
    reason and must be the line directly above a ```python fence; lines inside blocks are not markers)."""
    name = _rel(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    marker: tuple[int, str] | None = None  # (line number, reason) of a marker on the line before
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if marker is not None:
                problems.append(
                    f"{name}:{marker[0]}: a not-run marker must be the line directly above a ```python fence"
                )
            marker = None
            mk = _MARKER.match(lines[i])
            if mk:
                rest = mk.group("rest").strip()
                reason = rest[1:].strip() if rest.startswith(":") else ""
                if not reason:
                    problems.append(f"{name}:{i + 1}: a not-run marker needs a reason: <!-- not run: REASON -->")
                marker = (i + 1, reason)
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        lang = m.group("info").split()[0].lower() if m.group("info") else ""
        body = []
        j = i + 1
        while j < len(lines):
            s = lines[j]
            if s.strip().startswith(fence[0] * len(fence)) and not s.strip().strip(fence[0]):
                break
            body.append(s[indent:] if s[:indent].strip() == "" else s.lstrip())
            j += 1
        if marker is not None and lang not in RUN:
            problems.append(f"{name}:{marker[0]}: a not-run marker above a {lang or 'plain'} block (those never run)")
        blocks.append(Block(i + 2, lang, "\n".join(body) + "\n", marker[1] if marker is not None else None))
        marker = None
        i = j + 1
    if marker is not None:
        problems.append(f"{name}:{marker[0]}: a not-run marker must be the line directly above a ```python fence")
    return blocks, problems


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path, blocks_json: Path) -> dict:
    env = dict(os.environ)
    # a user's environment on a CPU machine: no trace, no provider forced, none of the tests' interpreter
    # switches (tests/conftest.py); a tuning cache of its own
    for k in ("TORSH_TRACE", "TORSH_KERNELS_PROVIDER", "TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM",
              "TORSH_TEST_INTERPRET", "TORSH_SNIPPET_BLOCK"):  # fmt: skip
        env.pop(k, None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        TORSH_KERNELS_CACHE_DIR=str(tmp / "torsh-cache"),
        TORSH_SNIPPETS=str(blocks_json),
        CUDA_VISIBLE_DEVICES="",
        # torchrun --nproc-per-node 1
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )  # fmt: skip
    return env


def run_blocks(doc: Path, blocks: list[Block], tmp: Path, limit_s: float = TIME_LIMIT_S) -> str | None:
    """Run ``blocks`` of ``doc`` as the convention says; None if they all ran, else what went wrong (the file
    and first line of the block, the traceback)."""
    work = tmp / "cwd"
    work.mkdir()
    spec = tmp / "blocks.json"
    spec.write_text(json.dumps([{"path": str(doc), "name": _rel(doc), "line": b.line, "code": b.code} for b in blocks]))
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER)], cwd=work, env=_env(tmp, spec), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks a block spawned too
        out, err = proc.communicate()
        started = re.findall(r"^SNIPPET-START (.*)$", err, re.M)
        where = started[-1] if started else _rel(doc)
        return f"{where}: the block did not finish: the file's blocks ran past {limit_s} s\n{err[-4000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode == 0:
        return None
    failed = re.findall(r"^SNIPPET-FAILED (.*)$", err, re.M)
    where = failed[-1] if failed else f"{_rel(doc)} (exit code {proc.returncode})"
    return f"{where}: the block failed\n--- stderr ---\n{err[-8000:]}\n--- stdout ---\n{out[-2000:]}"


_PARSED = {doc: parse(doc) for doc in DOCS}
WITH_CODE = [doc for doc, (blocks, _) in _PARSED.items() if any(b.lang in RUN for b in blocks)]
"""The files with a ```python block: each is one test, so a new page's code runs without a change here."""
NOT_RUN = [
    pytest.param(doc, b, id=f"{_rel(doc)}:{b.line}") for doc in WITH_CODE for b in _PARSED[doc][0]
    if b.lang in RUN and b.not_run
]  # fmt: skip


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every file's process, started when the first file's test runs, two at a time (this machine's two
    cores: most of a file's time is its interpreter importing torch, single-threaded); each test then waits
    for its own file. The per-file time limit counts from that file's own start."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for doc in WITH_CODE:
        blocks, problems = parse(doc)
        run = [b for b in blocks if b.lang in RUN and not b.not_run]
        if run and not problems:
            runs[doc] = pool.submit(run_blocks, doc, run, tmp_path_factory.mktemp("snippets"))
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow  # every page's code, in a process per page: the runner's own tests below stay in the fast tier
@pytest.mark.parametrize("doc", WITH_CODE, ids=_rel)
def test_snippets_run(doc: Path, started) -> None:
    problems = parse(doc)[1]
    assert not problems, "\n".join(problems)
    if doc not in started:
        pytest.skip(f"{_rel(doc)}: every ```python block is marked not run")
    failure = started[doc].result()
    if failure:
        pytest.fail(failure, pytrace=False)


if NOT_RUN:

    @pytest.mark.parametrize(("doc", "block"), NOT_RUN)
    def test_snippet_not_run(doc: Path, block: Block) -> None:
        """One skipped test per block marked not run, so the report lists them with their reasons."""
        pytest.skip(f"{_rel(doc)}:{block.line}: not run: {block.not_run}")


def test_the_runner_names_the_block_and_shows_its_traceback(tmp_path: Path) -> None:
    md = tmp_path / "page.md"
    md.write_text(
        "# p\n\n```python\ndef half(x):\n    return x / 0\n```\n\ntext\n\n```python\nimport os\n"
        "y = half(int(os.environ['WORLD_SIZE']))\n```\n"
    )
    blocks = [b for b in parse(md)[0] if b.lang in RUN]
    (tmp_path / "a").mkdir()
    failure = run_blocks(md, blocks, tmp_path / "a")
    assert failure is not None and failure.startswith("page.md:11: the block failed"), failure
    assert 'page.md", line 12, in <module>' in failure and "y = half(int(os.environ['WORLD_SIZE']))" in failure
    assert 'page.md", line 5, in half' in failure and "ZeroDivisionError" in failure
    assert "docs_runner.py" not in failure  # the traceback starts in the block
    (tmp_path / "b").mkdir()
    slow = [*blocks[:1], Block(11, "python", "import time\ntime.sleep(60)\n")]
    failure = run_blocks(md, slow, tmp_path / "b", limit_s=3)
    assert failure is not None and failure.startswith("page.md:11: the block did not finish"), failure


def test_parse_reads_the_convention(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text(
        "# t\n\n```python\na = 1\n```\n\n<!-- not run: needs two GPUs -->\n```python\nb = 2\n```\n"
        "```bash\nls\n```\n- item\n\n  ```python\n  if a:\n      c = 3\n  ```\n"
        "<!-- not run: -->\n```py\nd = 4\n```\n\n<!-- not run: dangling -->\n\ntext\n"
        "```markdown\n<!-- not run: an example inside a block is no marker -->\n```\n"
    )
    blocks, problems = parse(md)
    assert [(b.line, b.lang, b.not_run) for b in blocks] == [
        (4, "python", None), (9, "python", "needs two GPUs"), (12, "bash", None), (17, "python", None),
        (22, "py", ""), (29, "markdown", None),
    ]  # fmt: skip
    assert blocks[3].code == "if a:\n    c = 3\n"
    assert problems == [
        "x.md:20: a not-run marker needs a reason: <!-- not run: REASON -->",
        "x.md:25: a not-run marker must be the line directly above a ```python fence",
    ]
