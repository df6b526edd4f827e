"""The ``torsh`` command line."""

from __future__ import annotations

import argparse
import sys

_HARNESS_FLAGS = ("--compare", "--max-regression", "--full", "--args", "--ncu")


def _harness_mode(rest: list[str]) -> bool:
    """`torsh bench` runs the harness unless exactly one suite is named with its own options only."""
    leading = []
    for a in rest:
        if a.startswith("-"):
            break
        leading.append(a)
    return len(leading) != 1 or any(a.split("=")[0] in _HARNESS_FLAGS for a in rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench" and _harness_mode(argv[1:]):
        from .bench import harness

        hp = argparse.ArgumentParser(prog="torsh bench", description=harness.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        harness.add_arguments(hp)
        return harness.run(hp.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="torsh", description="torsh-kernels: fused kernels for distributed training")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("providers", help="which kernel providers can run here, and why not")
    from . import doctor

    doctor.add_arguments(
        sub.add_parser("doctor", help="providers, transports, CUDA/driver/NCCL, RDMA ports, namespaces: what runs "
                       "here, why not, how to enable it", description=doctor.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    )  # fmt: skip
    from . import demo

    demo.add_arguments(
        sub.add_parser("demo", help="DDP with every gradient compressor on local ranks: time, bytes, accuracy",
                       description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    )  # fmt: skip

    bench = sub.add_parser(
        "bench", help="run benchmark suites: `torsh bench [SUITE ...] [--json P] [--compare B]` (all through one "
        "harness) or `torsh bench SUITE [its options]`")  # fmt: skip
    suites = bench.add_subparsers(dest="suite", required=True)
    from .bench import harness

    for name, text in harness.SUITES.items():
        mod = harness.suite_module(name)
        mod.add_arguments(suites.add_parser(name, help=text, description=mod.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))  # fmt: skip

    from . import tune_cli

    tune_cli.add_arguments(
        sub.add_parser("tune", help="autotune the kernels' providers and meta-parameters; cache the winners",
                       description=tune_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    )  # fmt: skip

    from ..profiling import report, viewer

    viewer.add_arguments(
        sub.add_parser("timeline", help="terminal timeline of a torsh or torch.profiler trace (file or directory)",
                       description=viewer.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    )  # fmt: skip
    report.add_arguments(
        sub.add_parser("report", help="bottleneck report of a trace: time breakdown, overlap, stragglers, suggestions",
                       description=report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    )  # fmt: skip

    args = parser.parse_args(argv)
    if args.command == "providers":
        from .. import providers

        print(providers())
        return 0
    if args.command == "doctor":
        return doctor.run(args)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "tune":
        return tune_cli.run(args)
    if args.command == "timeline":
        return viewer.run(args)
    if args.command == "report":
        return report.run(args)
    if args.command == "bench":
        return harness.suite_module(args.suite).run(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
