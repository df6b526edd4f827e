"""What every ``torsh`` command shares: an argument parser whose errors are one line, help texts in plain
words, ``--json [PATH]``, typed option values, and a console whose tables keep their numbers at any width.

A neutral module (floor 0) because the profiling layer's viewer and report use it as much as the apps do.
Imports only the standard library at import time; rich and torch load on first use.

- **Errors.** :class:`Parser` prints ``torsh CMD: error: MESSAGE`` on one line and exits with status 2 (no
  usage block). A bad value found after parsing raises :class:`UsageError`; ``torsh`` prints it the same way.
- **Help.** :class:`HelpFormatter` turns reST in descriptions and help strings into plain text
  (``:func:`~a.b` `` -> ``b``, double and single backquotes dropped) and keeps the docstring's paragraphs.
- **JSON.** :func:`add_json` adds ``--json [PATH]``: the document goes to PATH, or to stdout when no PATH is
  given. While stdout carries JSON (:func:`json_to_stdout`), everything else printed, by this process or by
  the ranks it starts, goes to stderr, so stdout is exactly one JSON document.
- **Tables.** :func:`table` makes a table whose number columns never wrap and are never cut, whose text
  columns fold, and whose cells are literal text (no rich markup: ``torsh[cpu]`` stays ``torsh[cpu]``).
  :func:`console` prints it: on a terminal, text columns are narrowed to fit (numbers keep their width;
  when even that is wider than the terminal, the table is printed wider, never cut); elsewhere (pipes,
  files, logs) tables and lines are printed at their full width, never wrapped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError

__all__ = [
    "HelpFormatter",
    "Parser",
    "UsageError",
    "add_json",
    "argv_of",
    "choice_list",
    "console",
    "device",
    "fail",
    "int_at_least",
    "json_to_stdout",
    "plain",
    "release_stdout",
    "table",
    "write_json",
]

PLAIN_WIDTH = 4096
"""Width of a console that is not a terminal: wide enough that nothing wraps."""


class UsageError(InvalidArgumentError):
    """A command-line value that cannot be used, found after parsing (e.g. a provider that cannot run here,
    a category the trace does not have). ``torsh`` prints it as ``torsh CMD: error: MESSAGE`` and exits 2."""


def one_line(message: object) -> str:
    """``message`` on one line (line breaks and runs of blanks become one space)."""
    return " ".join(str(message).split())


def fail(prog: str, message: object) -> int:
    """Print ``PROG: error: MESSAGE`` on one line to stderr; return 2 (the status of an argument error)."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 2


# -- help texts -------------------------------------------------------------------------------------------

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_TICKS = re.compile(r"(?<![`\w])`([^`]+)`(?![`\w])")


def _role(m: re.Match) -> str:
    target = m.group(1)
    named = re.fullmatch(r"(.+?)\s*<[^>]+>", target)  # :ref:`text <target>`
    if named:
        return named.group(1)
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target


def plain(text: str | None) -> str | None:
    """reST roles and literals as plain words: ``:func:`~torsh_kernels.parallel.compression_hook` `` ->
    ``compression_hook``, ``:data:`QUICK` `` -> ``QUICK``, double and single backquotes dropped."""
    if not text:
        return text
    text = _ROLE.sub(_role, text)
    text = _LITERAL.sub(r"\1", text)
    return _TICKS.sub(r"\1", text)


_LISTISH = re.compile(r"^(\s|[-*] |\d+[.)] |\w[\w /.-]*:\s{2,})")  # indented, bullets, aligned "key:   text"


def reflow(text: str, width: int) -> str:
    """Paragraphs of plain prose refilled to ``width``; indented blocks, lists and tables kept as written."""
    import textwrap

    out = []
    for para in re.split(r"\n\s*\n", text.strip("\n")):
        lines = para.splitlines()
        if any(_LISTISH.match(line) for line in lines):
            out.append(para)
        else:
            out.append(textwrap.fill(" ".join(line.strip() for line in lines), width, break_on_hyphens=False))
    return "\n\n".join(out) + "\n"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions are docstrings: reST becomes plain text, prose is refilled, lists keep their lines."""

    def _format_text(self, text: str) -> str:
        if "%(prog)" in text:
            text = text % {"prog": self._prog}
        return reflow(plain(text) or "", max(40, self._width - self._current_indent)) + "\n"

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return plain(super()._get_help_string(action))

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``PROG: error: MESSAGE``, exit status 2) and whose help
    is plain text. Sub-parsers made with ``add_subparsers().add_parser`` are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


# -- option values ----------------------------------------------------------------------------------------


INT_MOST = 2**31 - 1
"""The largest count an option takes: no count a command uses comes near it, so a larger one is a typo
(``--reps 99999999999999999999`` would otherwise run for ever)."""


def int_at_least(low: int, high: int = INT_MOST) -> Callable[[str], int]:
    """An argparse type: an integer in [``low``, ``high``]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        if v > high:
            raise argparse.ArgumentTypeError(f"expected an integer <= {high}, got {v}")
        return v

    parse.__name__ = f"integer >= {low}"
    return parse


def choice_list(valid: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of values from ``valid`` (in the order given, without
    repeats); an unknown value is an error that lists the valid ones."""
    valid = tuple(valid)

    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        if not items:
            raise argparse.ArgumentTypeError(f"expected one or more {what}s from {', '.join(valid)}; got {text!r}")
        bad = [s for s in items if s not in valid]
        if bad:
            names = ", ".join(map(repr, bad))
            raise argparse.ArgumentTypeError(
                f"unknown {what}{'s' * (len(bad) > 1)} {names}; choose from {', '.join(valid)}"
            )
        return items

    parse.__name__ = f"{what} list"
    return parse


def device(text: str):
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``, refused where this machine cannot run it."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "torch finds no usable CUDA GPU"
            raise argparse.ArgumentTypeError(f"{text}: {why} here (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _json_target(text: str) -> str:
    """An argparse type: '-' (stdout) or a path a file can be written to (its folders are made later)."""
    if text == "-":
        return text
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a writable directory")
    return text


def add_json(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json [PATH]`` (dest ``json``): write ``what`` as JSON to PATH, or to stdout when no PATH is given
    (``args.json == '-'``; the human output then goes to stderr)."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", type=_json_target,
                        help=f"write {what} as JSON to PATH; with no PATH, to stdout (everything else then goes "
                        "to stderr)")  # fmt: skip


def argv_of(parser: argparse.ArgumentParser, args: argparse.Namespace, *, skip: Collection[str] = ()) -> list[str]:
    """The options that reproduce ``args`` with ``parser`` (those different from their default), e.g. to
    record in a result how it was measured and to run it again. Positionals and ``skip`` (dests) left out."""
    out: list[str] = []
    for a in parser._actions:
        if not a.option_strings or a.dest in skip or a.dest == "help" or not hasattr(args, a.dest):
            continue
        v, default = getattr(args, a.dest), a.default
        if isinstance(default, str) and a.type is not None:
            default = a.type(default)  # what argparse made of a string default
        if v == default:
            continue
        opt = next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            out.append(opt)
        elif isinstance(a, argparse._AppendAction):
            for item in v:
                out += [opt, str(item)]
        elif isinstance(v, list):
            out += [opt, ",".join(map(str, v))]
        else:
            out += [opt, str(v)]
    return out


# -- JSON output --------------------------------------------------------------------------------------------

_pending: list[Any] | None = None  # documents for stdout while json_to_stdout is active
_restore: tuple[Any, int | None] | None = None  # (the stdout object, a saved copy of fd 1 or None)


@contextlib.contextmanager
def json_to_stdout(active: bool = True) -> Iterator[None]:
    """While active, stdout is reserved for the JSON document: whatever else is printed (by Python code, by
    C code, by child processes started meanwhile) goes to stderr; :func:`write_json` with ``'-'`` keeps
    the document and it is written to stdout on exit. Nothing changes when ``active`` is false."""
    global _pending, _restore
    if not active or _pending is not None:
        yield
        return
    out = sys.stdout
    out.flush()
    saved = None
    with contextlib.suppress(AttributeError, OSError, ValueError, io.UnsupportedOperation):
        if out.fileno() == 1:  # a real stdout (not a test's capture): children inherit fd 1, move it too
            saved = os.dup(1)
            os.dup2(2, 1)
    _pending, _restore = [], (out, saved)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        release_stdout()


def release_stdout() -> None:
    """End :func:`json_to_stdout` now (for a process about to leave through ``os._exit``): stdout is given
    back and the documents kept for it are written. Nothing happens when it is not active."""
    global _pending, _restore
    if _restore is None:
        return
    (out, saved), docs = _restore, _pending or []
    _pending = _restore = None
    sys.stdout = out
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        out.flush()
    if saved is not None:
        os.dup2(saved, 1)
        os.close(saved)
    for doc in docs:
        out.write(json.dumps(doc, indent=1) + "\n")
    out.flush()


def write_json(path: str | os.PathLike | None, doc: Any, *, announce: bool = True) -> None:
    """Write ``doc`` as JSON: to ``path`` (folders made; ``wrote PATH`` printed unless ``announce`` is
    false), or to stdout when ``path`` is ``'-'``; nothing when ``path`` is None."""
    if path is None:
        return
    if str(path) == "-":
        if _pending is not None:
            _pending.append(doc)
        else:
            print(json.dumps(doc, indent=1), flush=True)
        return
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as e:
        raise UsageError(f"cannot write {p}: {e}") from e
    if announce:
        print(f"wrote {p}")


# -- console and tables -------------------------------------------------------------------------------------

_TEXT_FLOOR = 10  # a text column is not folded narrower than this (or its natural width, if smaller)


def _fit(con, table) -> int | None:
    """Give ``table``'s columns widths that fit ``con``: number columns keep their cells whole (their headers
    may fold between words), text columns fold. Returns the width to print at when that is wider than the
    console (None: it fits)."""
    from rich.measure import Measurement

    wide = con.options.update_width(1_000_000)
    total = Measurement.get(con, wide, table).maximum
    if not con.is_terminal:
        return total if total > con.width else None
    if total <= con.width:
        return None
    cols = table.columns
    natural, floor, tight = [], [], []
    for c in cols:
        cells = max((Measurement.get(con, wide, x).maximum for x in c._cells), default=0)
        header = Measurement.get(con, wide, c.header)
        natural.append(max(cells, header.maximum, 1))
        if getattr(c, "_numeric", c.no_wrap):
            floor.append(max(cells, header.minimum, 1))  # every cell whole; the header folds between words
            tight.append(max(cells, 1))  # ... or, on a very narrow terminal, inside them
        else:
            floor.append(min(natural[-1], _TEXT_FLOOR))
            tight.append(floor[-1])
    overhead = total - sum(natural)
    budget = con.width - overhead
    if sum(floor) > budget:
        floor = tight
    widths = list(floor)
    if budget > sum(floor):
        lo, hi = 0, max(natural)
        while lo < hi:  # the highest level L at which min(natural, max(floor, L)) fits the budget
            mid = (lo + hi + 1) // 2
            if sum(min(n, max(f, mid)) for n, f in zip(natural, floor)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        widths = [min(n, max(f, lo)) for n, f in zip(natural, floor)]
        spare = budget - sum(widths)
        for i, n in enumerate(natural):  # what rounding left, to the columns still below their natural width
            add = min(spare, n - widths[i])
            widths[i] += add
            spare -= add
    for c, w, n in zip(cols, widths, natural):
        c.width = w
        if w < n:  # a text column, or a number column's header: folds
            c.no_wrap, c.overflow = False, "fold"
    need = overhead + sum(widths)
    return need if need > con.width else None


def _console_class():
    from rich.console import Console
    from rich.table import Table

    class TorshConsole(Console):
        """A rich console that prints tables with their numbers whole (see :func:`console`)."""

        def print(self, *objects: Any, **kwargs: Any) -> None:
            if len(objects) == 1 and isinstance(objects[0], Table):
                need = _fit(self, objects[0])
                if need is not None:
                    old = self._width
                    self._width = need
                    try:
                        return super().print(*objects, crop=False, **kwargs)
                    finally:
                        self._width = old
            return super().print(*objects, **kwargs)

    return TorshConsole


_CONSOLE_CLASS = None


def console(width: int | None = None, *, stderr: bool = False, **kwargs: Any):
    """A rich console for a command's output: on a terminal, the terminal's width; elsewhere (pipes,
    files, logs) :data:`PLAIN_WIDTH`, so that no line or table wraps. ``width`` fixes the width. Tables
    printed on it keep every number whole (:func:`table`)."""
    global _CONSOLE_CLASS
    if _CONSOLE_CLASS is None:
        _CONSOLE_CLASS = _console_class()
    con = _CONSOLE_CLASS(stderr=stderr, width=width, **kwargs)
    if width is None and not con.is_terminal:
        con.width = PLAIN_WIDTH
    return con


def table(title: str | None, columns: Iterable[str], *, text: Collection[str] = (), **kwargs: Any):
    """A rich table: columns named in ``text`` hold words (left-aligned, folded when the terminal is
    narrow), every other column numbers (right-aligned, never wrapped or cut). Cells and the title are
    literal text: brackets are not rich markup. ``kwargs`` go to ``rich.table.Table``."""
    from rich.table import Table
    from rich.text import Text

    class LiteralTable(Table):
        def add_row(self, *cells: Any, **kw: Any) -> None:
            super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kw)

    kwargs.setdefault("title_justify", "left")
    t = LiteralTable(title=Text(title) if isinstance(title, str) else title, **kwargs)
    for name in columns:
        if name in text:
            t.add_column(name, justify="left", overflow="fold")
        else:
            t.add_column(name, justify="right", no_wrap=True)
            t.columns[-1]._numeric = True  # its cells are never wrapped or cut (see _fit)
    return t
