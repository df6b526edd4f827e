"""The ``torsh`` command line.

Every command behaves alike: an argument error is one line (``torsh CMD: error: ...``) and exit status 2,
so is any bad input a command finds later (a typed ``TorshKernelsError`` of the ValueError/TypeError kind);
a typed failure while running (a collective, a transport) is one line and exit status 1;
``--json [PATH]`` writes the command's JSON to PATH, or to stdout when no PATH is given (everything else
then goes to stderr); Ctrl-C stops the command and every rank it started, prints ``torsh CMD: interrupted``
and exits with status 130; ``torsh --version`` prints the version.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .. import cli_common
from ..errors import TorshKernelsError

_HARNESS_FLAGS = ("--compare", "--max-regression", "--full", "--args", "--ncu")

COMMANDS = {
    "providers": "which kernel providers can run here, and why not",
    "doctor": "providers, transports, CUDA/driver/NCCL, RDMA ports, namespaces: what runs here, why not, how to "
    "enable it",
    "demo": "DDP with every gradient compressor on local ranks: time, bytes, accuracy",
    "bench": "run benchmark suites: 'torsh bench [SUITE ...] [--json [PATH]] [--compare BASELINE]' (all through one "
    "harness) or 'torsh bench SUITE [its options]'",
    "tune": "autotune the kernels' providers and meta-parameters; cache the winners",
    "timeline": "terminal timeline of a torsh or torch.profiler trace (file or directory)",
    "report": "bottleneck report of a trace: time breakdown, overlap, stragglers, suggestions",
    "inspect": "every GPU kernel compiled for a GPU target (no GPU needed): registers, occupancy, access widths, "
    "a bandwidth bound beside a copy kernel",
    "top": "live view of a running job's ranks from its live metrics (directory or Prometheus endpoints), with alerts",
}


def _harness_mode(rest: list[str]) -> bool:
    """`torsh bench` runs the harness unless exactly one suite is named with its own options only."""
    leading = []
    for a in rest:
        if a.startswith("-"):
            break
        leading.append(a)
    if any(a in ("-h", "--help") for a in rest) and len(leading) == 1:
        return False  # `torsh bench SUITE --help`: the suite's own options
    return len(leading) != 1 or any(a.split("=")[0] in _HARNESS_FLAGS for a in rest)


def _version() -> str:
    from ..version import __version__  # reads the version only: imports no torch

    return f"torsh-kernels {__version__}"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``torsh`` parser with every command, and each benchmark suite's own parser by name."""
    from ..profiling import inspection, report, top, viewer
    from . import demo, doctor, tune_cli
    from .bench import harness

    parser = cli_common.Parser(prog="torsh", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {"providers": None, "doctor": doctor, "demo": demo, "bench": None, "tune": tune_cli,
               "timeline": viewer, "report": report, "inspect": inspection, "top": top}  # fmt: skip
    suite_parsers = {}
    for name, module in modules.items():
        p = sub.add_parser(name, help=COMMANDS[name], description=module.__doc__ if module else COMMANDS[name])
        if module is not None:
            module.add_arguments(p)
        if name == "bench":
            suites = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
            for suite, text in harness.SUITES.items():
                mod = harness.suite_module(suite)
                suite_parsers[suite] = suites.add_parser(suite, help=text, description=mod.__doc__)
                mod.add_arguments(suite_parsers[suite])
    return parser, suite_parsers


def harness_parser() -> argparse.ArgumentParser:
    """``torsh bench [SUITE ...] [--json] [--compare] ...``: the harness's parser."""
    from .bench import harness

    hp = cli_common.Parser(prog="torsh bench", description=harness.__doc__)
    harness.add_arguments(hp)
    return hp


def _parse(argv: list[str]) -> tuple[str, argparse.Namespace, Callable[[argparse.Namespace], int]]:
    """(the command's prog, its arguments, its handler); argparse's SystemExit on bad arguments or --help."""
    from .bench import harness

    if argv and argv[0] == "bench" and _harness_mode(argv[1:]):
        return "torsh bench", harness_parser().parse_args(argv[1:]), harness.run
    parser, suite_parsers = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"choose a command: {', '.join(COMMANDS)} (torsh --help says what each does)")
    prog = f"torsh {args.command}"
    if args.command == "providers":
        return prog, args, _providers
    if args.command == "bench":
        sp = suite_parsers[args.suite]
        args.options = cli_common.argv_of(
            sp, args, skip={"json"}
        )  # recorded in the suite's JSON (a baseline replays it)
        return sp.prog, args, harness.suite_module(args.suite).run
    from ..profiling import inspection, report, top, viewer
    from . import demo, doctor, tune_cli

    handlers = {"doctor": doctor.run, "demo": demo.run, "tune": tune_cli.run, "timeline": viewer.run,
                "report": report.run, "inspect": inspection.run, "top": top.run}  # fmt: skip
    return prog, args, handlers[args.command]


def _providers(args: argparse.Namespace) -> int:
    from .. import providers

    print(providers())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # answered before the parser, whose commands import torch (seconds)
        print(_version())
        return 0
    prog = "torsh"
    try:
        prog, args, handler = _parse(argv)
        with cli_common.json_to_stdout(getattr(args, "json", None) == "-"):
            return handler(args)
    except SystemExit as e:  # argparse: a one-line error (2), --help or --version (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except cli_common.UsageError as e:
        return cli_common.fail(prog, e)
    except TorshKernelsError as e:  # a typed error from below: one line, no traceback
        # bad input (a ValueError or TypeError kind: a value, a file, a trace) exits 2 like an argument error;
        # a failure while running (a collective, a transport, a provider that cannot run) exits 1
        code = cli_common.fail(prog, f"{e} ({type(e).__name__})")
        return code if isinstance(e, (ValueError, TypeError)) else 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
