"""The documentation's code runs: every ```python block of README.md and docs/*.md is executed.

The convention (docs/testing.md#the-documentations-code):

- each ```python block runs on its own, as a user who copies it into a file runs it: in a fresh process
  (tests/docs_runner.py) with none of the other blocks' names, on the CPU, in an empty temporary directory,
  with ``TORSH_TRACE`` unset and a time limit per process; the process gets torchrun's environment for one
  process (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``init_from_env()`` and
  ``DDP(model)`` work there as under ``torchrun --nproc-per-node 1``;
- a block directly preceded by ``<!-- continues: NAME -->`` runs after the block named ``NAME`` (``<!-- block:
  NAME -->`` above that block's fence), in the same process and namespace, after that block's own
  predecessors: a chain runs once per block that ends it; a name is defined once per file, before it is continued;
- a block directly preceded by a line ``<!-- not run: REASON -->`` is not run (a reason is required);
  each such block is reported here as a skipped test with its reason; a block that continues one not run
  is not run either (it must say so);
- marker lines stack: the comment lines directly above a fence (no blank line between) are its markers;
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
"""Per process (a block, or a chain of continued blocks): one slower than this on the 2-core CPU machine should
shrink its examples' sizes."""
RUN = ("python", "py", "python3")
"""Info strings of the blocks that run."""

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not run|block|continues)\b(?P<rest>.*?)-->\s*$")
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class Block:
    line: int
    """Line number (1-based) of the block's first line of code (the one after the opening fence)."""
    lang: str
    code: str
    not_run: str | None = None
    """The reason given by a ``<!-- not run: REASON -->`` line directly above the fence."""
    name: str | None = None
    """``<!-- block: NAME -->``: the name a later block continues."""
    continues: str | None = None
    """``<!-- continues: NAME -->``: the named block this one runs after, in its namespace."""


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _label(kind: str) -> str:
    return kind.replace(" ", "-")


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown file, and the problems with its markers (``not run`` needs a reason,
    ``block`` and ``continues`` a name; markers are the comment lines directly above a ```python fence; lines
    inside blocks are not markers; a name is defined once and continued only after it is defined)."""
    name = _rel(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    markers: dict[str, tuple[int, str]] = {}  # kind -> (line number, argument) of the lines directly above
    i = 0

    def dangling() -> None:
        for kind, (line, _) in markers.items():
            problems.append(f"{name}:{line}: a {_label(kind)} marker must be directly above a ```python fence")

    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            mk = _MARKER.match(lines[i])
            if not mk:
                dangling()
                markers = {}
                i += 1
                continue
            kind, rest = mk.group("kind"), mk.group("rest").strip()
            arg = rest[1:].strip() if rest.startswith(":") else ""
            if kind in markers:
                problems.append(f"{name}:{i + 1}: a second {kind} marker for one block")
            if kind == "not run" and not arg:
                problems.append(f"{name}:{i + 1}: a not-run marker needs a reason: <!-- not run: REASON -->")
            if kind != "not run" and not _NAME.match(arg):
                problems.append(f"{name}:{i + 1}: a {kind} marker needs a name: <!-- {kind}: NAME --> (\\w.-)")
            markers[kind] = (i + 1, arg)
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        lang = m.group("info").split()[0].lower() if m.group("info") else ""
        body = []
        j = i + 1
        while j < len(lines):
            t = lines[j]
            if t.strip().startswith(fence[0] * len(fence)) and not t.strip().strip(fence[0]):
                break
            body.append(t[indent:] if t[:indent].strip() == "" else t.lstrip())
            j += 1
        if markers and lang not in RUN:
            for kind, (line, _) in markers.items():
                problems.append(
                    f"{name}:{line}: a {_label(kind)} marker above a {lang or 'plain'} block (those never run)"
                )
        get = lambda kind: markers[kind][1] if kind in markers else None  # noqa: B023
        blocks.append(Block(i + 2, lang, "\n".join(body) + "\n", get("not run"), get("block"), get("continues")))
        markers = {}
        i = j + 1
    dangling()
    named: dict[str, Block] = {}
    for b in blocks:
        if b.lang not in RUN:
            continue
        if b.continues is not None and _NAME.match(b.continues):
            parent = named.get(b.continues)
            if parent is None:
                problems.append(
                    f"{name}:{b.line}: continues {b.continues!r}, which no earlier block names (<!-- block: "
                    f"{b.continues} --> above its fence)"
                )
            elif parent.not_run is not None and b.not_run is None:
                problems.append(
                    f"{name}:{b.line}: continues {b.continues!r}, which is not run; mark this block not run too"
                )
        if b.name is not None and _NAME.match(b.name):
            if b.name in named:
                problems.append(f"{name}:{b.line}: the block name {b.name!r} is used twice (line {named[b.name].line})")
            named[b.name] = b
    return blocks, problems


def chains(blocks: list[Block]) -> list[list[Block]]:
    """What runs, one list per process: each run block that no run block continues, after the blocks it
    continues (a parsed file without problems). A block continued by several runs once in each of their chains."""
    run = [b for b in blocks if b.lang in RUN and b.not_run is None]
    named = {b.name: b for b in run if b.name is not None}
    continued = {b.continues for b in run if b.continues is not None}
    out = []
    for b in run:
        if b.name is not None and b.name in continued:
            continue  # it runs at the head of the chains that continue it
        chain = [b]
        while chain[0].continues is not None and chain[0].continues in named:
            chain.insert(0, named[chain[0].continues])
        if chain[0].continues is None:  # else it continues a block not run (a problem parse reports)
            out.append(chain)
    return out


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


_DISTRIBUTED = re.compile(
    r"init_from_env|init_process_group|run_local|make_communicator|DistributedDataParallel|fully_shard|"
    r"init_device_mesh|torch\.distributed|multiprocessing|subprocess"
)
"""Code that touches a process group or starts processes: its chain gets a process of its own."""


def local(chain: list[Block]) -> bool:
    """Whether ``chain`` may run in a process shared with other such chains (each in a fresh namespace, working
    directory and environment): it touches no process group and starts no process."""
    return not any(_DISTRIBUTED.search(b.code) for b in chain)


def run_blocks(doc: Path, blocks: list[Block], tmp: Path, limit_s: float = TIME_LIMIT_S) -> str | None:
    """Run ``blocks`` of ``doc`` (one chain) in order, in one fresh process and namespace; None if they all ran,
    else what went wrong (the file and first line of the block, the traceback)."""
    return run_chains(doc, [blocks], tmp, limit_s)


def run_chains(doc: Path, runs: list[list[Block]], tmp: Path, limit_s: float = TIME_LIMIT_S) -> str | None:
    """Run the chains ``runs`` of ``doc`` in one fresh process, each in a namespace of its own (several: only
    chains that are ``local``); None if they all ran, else what went wrong (the file and first line of the
    first block that failed, the traceback)."""
    work = tmp / "cwd"
    work.mkdir(parents=True)
    spec = tmp / "blocks.json"
    spec.write_text(
        json.dumps([[{"path": str(doc), "name": _rel(doc), "line": b.line, "code": b.code} for b in c] for c in runs])
    )
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
        return f"{where}: the block did not finish: its process ran past {limit_s} s\n{err[-4000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode == 0:
        return None
    failed = re.findall(r"^SNIPPET-FAILED (.*)$", err, re.M)
    where = failed[0] if failed else f"{_rel(doc)} (exit code {proc.returncode})"
    return f"{where}: the block failed\n--- stderr ---\n{err[-8000:]}\n--- stdout ---\n{out[-2000:]}"


def _processes(doc: Path) -> list[list[list[Block]]]:
    """``doc``'s chains (a parsed file without problems), grouped by process: the local ones together, each
    other one alone."""
    runs = chains(parse(doc)[0])
    shared = [c for c in runs if local(c)]
    return ([shared] if shared else []) + [[c] for c in runs if not local(c)]


def run_doc(doc: Path, tmp: Path, pool=None, limit_s: float = TIME_LIMIT_S) -> list[str]:
    """Every chain of ``doc`` (a parsed file without problems), in processes as ``_processes`` groups them
    (submitted to ``pool``, a ``concurrent.futures`` executor, if given); the failures."""
    args = [(doc, group, tmp / str(k), limit_s) for k, group in enumerate(_processes(doc))]
    results = (
        [r.result() for r in [pool.submit(run_chains, *a) for a in args]] if pool else [run_chains(*a) for a in args]
    )
    return [r for r in results if r]


_PARSED = {doc: parse(doc) for doc in DOCS}
WITH_CODE = [doc for doc, (blocks, _) in _PARSED.items() if any(b.lang in RUN for b in blocks)]
"""The files with a ```python block: each is one test, so a new page's code runs without a change here."""
NOT_RUN = [
    pytest.param(doc, b, id=f"{_rel(doc)}:{b.line}") for doc in WITH_CODE for b in _PARSED[doc][0]
    if b.lang in RUN and b.not_run
]  # fmt: skip


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every chain's process, started when the first file's test runs, two at a time (this machine's two
    cores: most of a process's time is its interpreter importing torch, single-threaded); each test then
    waits for its own file's. The time limit counts from each process's own start."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for doc in WITH_CODE:
        blocks, problems = parse(doc)
        if chains(blocks) and not problems:
            tmp = tmp_path_factory.mktemp("snippets")
            runs[doc] = [pool.submit(run_chains, doc, g, tmp / str(k)) for k, g in enumerate(_processes(doc))]
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow  # every page's code, a process per block: the runner's own tests below stay in the fast tier
@pytest.mark.parametrize("doc", WITH_CODE, ids=_rel)
def test_snippets_run(doc: Path, started) -> None:
    problems = parse(doc)[1]
    assert not problems, "\n".join(problems)
    if doc not in started:
        pytest.skip(f"{_rel(doc)}: every ```python block is marked not run")
    failures = [f for f in (run.result() for run in started[doc]) if f]
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


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
        "x.md:25: a not-run marker must be directly above a ```python fence",
    ]


def test_each_block_runs_alone_unless_it_continues_a_named_one(tmp_path: Path) -> None:
    """A name from one block is not there in the next (its own process), unless the next says it continues it."""
    body = "```python\ndef half(x):\n    return x / 2\n```\n\ntext\n\n{}```python\nprint(half(4))\n```\n"
    alone = tmp_path / "alone.md"
    alone.write_text(body.format(""))
    assert [[b.line for b in c] for c in chains(parse(alone)[0])] == [[2], [9]]
    (failure,) = run_doc(alone, tmp_path / "a")
    assert failure.startswith("alone.md:9: the block failed"), failure
    assert "NameError: name 'half' is not defined" in failure and 'alone.md", line 9, in <module>' in failure
    marked = tmp_path / "marked.md"
    marked.write_text("<!-- block: half -->\n" + body.format("<!-- continues: half -->\n"))
    assert [[b.line for b in c] for c in chains(parse(marked)[0])] == [[3, 11]]
    assert run_doc(marked, tmp_path / "b") == []


def test_continuation_markers_and_their_problems(tmp_path: Path) -> None:
    md = tmp_path / "c.md"
    md.write_text(
        "<!-- block: a -->\n```python\nx = 1\n```\n<!-- continues: a -->\n<!-- block: b -->\n```python\ny = x\n```\n"
        "<!-- continues: a -->\n```python\nz = x\n```\n<!-- continues: b -->\n```python\nw = y\n```\n"
        "```python\nv = 0\n```\n<!-- continues: nowhere -->\n```python\nu = 0\n```\n"
        "<!-- block: a -->\n<!-- block: c -->\n```python\nt = 0\n```\n<!-- continues: -->\n```bash\nls\n```\n"
        "<!-- block: n -->\n<!-- not run: a GPU -->\n```python\ns = 0\n```\n"
        "<!-- continues: n -->\n```python\nr = s\n```\n"
    )
    blocks, problems = parse(md)
    by_line = {b.line: b for b in blocks}
    assert (by_line[8].name, by_line[8].continues, by_line[3].name) == ("b", "a", "a")
    assert problems == [
        "c.md:26: a second block marker for one block",
        "c.md:30: a continues marker needs a name: <!-- continues: NAME --> (\\w.-)",
        "c.md:30: a continues marker above a bash block (those never run)",
        "c.md:23: continues 'nowhere', which no earlier block names (<!-- block: nowhere --> above its fence)",
        "c.md:41: continues 'n', which is not run; mark this block not run too",
    ]
    # the chains: a's block heads each chain that continues it; a block continued twice runs in both chains
    runs = [[b.line for b in c] for c in chains([b for b in blocks if b.line != 23])]
    assert runs == [[3, 12], [3, 8, 16], [19], [28]]  # in the order of their last blocks; 41's head is not run


def test_blocks_sharing_a_process_share_no_names_files_or_environment(tmp_path: Path) -> None:
    """Blocks that touch no process group run in one process, each as if alone; the others in their own."""
    md = tmp_path / "p.md"
    md.write_text(
        "```python\nimport os\nopen('x.txt', 'w').close()\nos.environ['TORSH_DOC_A'] = '1'\nv = 1\n```\n\n"
        "```python\nimport os\nassert not os.path.exists('x.txt') and 'TORSH_DOC_A' not in os.environ\n"
        "print(v)\n```\n\n```python\nimport torsh_kernels.collectives as tc\ncomm = tc.init_from_env()\n```\n"
    )
    assert [[[b.line for b in c] for c in g] for g in _processes(md)] == [[[2], [9]], [[15]]]
    (failure,) = run_doc(md, tmp_path / "a")
    assert failure.startswith("p.md:9: the block failed"), failure
    assert 'p.md", line 11, in <module>' in failure and "NameError: name 'v' is not defined" in failure


def test_a_block_sharing_a_process_is_its_own_main_module(tmp_path: Path) -> None:
    """As a script, a block's classes belong to __main__ and pickle: a block sharing a process with others runs
    in a module of its own installed as __main__ (a plain dict namespace made pickle.dumps(C()) fail)."""
    md = tmp_path / "p.md"
    block = "```python\nimport pickle, sys\nclass C:\n    pass\npickle.loads(pickle.dumps(C()))\n{}\n```\n\n"
    md.write_text(block.format("x = 1") + block.format("assert 'x' not in vars(sys.modules['__main__'])"))
    assert [[[b.line for b in c] for c in g] for g in _processes(md)] == [[[2], [10]]]
    assert run_doc(md, tmp_path / "a") == []
