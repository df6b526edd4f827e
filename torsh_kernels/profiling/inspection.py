"""``torsh inspect``: every GPU kernel variant compiled for a named target as its launcher specializes it,
its machine code read, and a bandwidth bound per benchmark case beside a plain copy kernel of the same bytes.

No GPU is needed. Each case of :mod:`torsh_kernels.ops.launch_cases` (an op family's provider implementation
called at benchmark size on aligned contiguous, unaligned or strided tensors) runs with its launches
captured (:mod:`.launches`); every distinct specialization is compiled once for the target (Triton's own
pipeline; Numba's PTX through ``ptxas``) and read (:mod:`.sass`): registers, spills, shared memory,
theoretical occupancy at the launched warp count, global memory instructions by width and the share of
bytes they move with 128-bit accesses, instructions per element, and the time a bandwidth bound allows on
the target's GPUs (H100 and H200 for sm_90), next to the same bound for the anchors (:mod:`.anchors`).

Goals for memory-bound kernels on aligned contiguous data (``GOALS``): at least 90% of global bytes moved
by 128-bit accesses, at most 64 registers per thread and at least 50% theoretical occupancy; no spills in
any kernel. Where the data type or layout does not allow 128-bit accesses, :data:`EXCEPTIONS` says why and
what the kernel is held to instead. Numba cannot express vector loads: its kernels are held to the register,
occupancy and spill goals only.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .. import cli_common
from ..errors import InvalidArgumentError, ProviderUnavailableError
from .sass import ARCHS, DIRECT, GPUS, Arch, SassStats, analyze, estimate, occupancy

if TYPE_CHECKING:
    from .launches import Launch

__all__ = ["EXCEPTIONS", "GOALS", "Exemption", "add_arguments", "check", "inspect_kernels", "run"]

PROVIDERS = ("triton", "numba")


@dataclass(frozen=True, slots=True)
class Goals:
    """The thresholds a memory-bound kernel is held to (aligned contiguous data; spills: every kernel)."""

    share_128: float = 0.90
    """Least share of global bytes moved by 128-bit accesses."""
    registers: int = 64
    """Most registers per thread."""
    occupancy: float = 0.5
    """Least theoretical occupancy at the launched warp count."""


GOALS = Goals()


@dataclass(frozen=True, slots=True)
class Exemption:
    """What a case's data type or layout allows instead of the 128-bit goal, and why."""

    floor: float
    """The least 128-bit share of its direct global bytes."""
    why: str


EXCEPTIONS: dict[str, Exemption] = {}
"""Case-name pattern (regular expression, matched from the start) -> what that case is held to instead of
``GOALS.share_128``. None is needed today: gathers and scatters (addresses read from memory, such as top-k's
compaction and the scatter into ``out[idx]``) are told apart by the machine-code reading itself and the goal
holds for the direct bytes (:data:`.sass.DIRECT`); each case reports its gathered and scattered share beside."""


def _exception(name: str) -> Exemption | None:
    for pat, v in EXCEPTIONS.items():
        if re.match(pat, name):
            return v
    return None


ANCHOR_ELEMENTS = 1 << 24
"""Elements of the anchors' launches (divisible by 16: the best case a plain kernel can be compiled for)."""


def _anchor_cases() -> list[tuple[str, Callable[[], object], int]]:
    """(name, the launch, bytes per element) of each anchor."""
    import torch

    from . import anchors

    n = ANCHOR_ELEMENTS
    x = torch.empty(n)
    return [("copy fp32", lambda: anchors.copy(x, torch.empty(n)), 8),
            ("cast fp32->bf16", lambda: anchors.cast(x, torch.empty(n, dtype=torch.bfloat16)), 6)]  # fmt: skip


class KernelReader:
    """Compiles and reads each distinct specialization once; names it ``provider:kernel#i``."""

    def __init__(self, arch: Arch, disassemble: Collection[str] = ("triton", "numba")) -> None:
        self.arch = arch
        self.disassemble = disassemble
        self.kernels: dict[str, dict[str, Any]] = {}  # kernel id -> its figures (the report's "kernels")
        self._seen: dict[str, tuple[str, SassStats]] = {}  # specialization key -> (kernel id, figures)

    def read(self, launch: Launch) -> tuple[str, SassStats]:
        from .launches import compile_launch

        key = launch.key()
        if key not in self._seen:
            stem = f"{launch.provider}:{launch.kernel}#"
            kid = stem + str(sum(k.startswith(stem) for k in self.kernels))
            compiled = compile_launch(launch, self.arch)
            st = analyze(compiled.cubin, compiled.shared_bytes, compiled.spill_bytes,
                         code=launch.provider in self.disassemble)  # fmt: skip
            blocks, occ = occupancy(st.registers, launch.warps, st.shared_bytes, self.arch)
            self.kernels[kid] = {**launch.describe(), **st.to_dict(), "occupancy": round(occ, 4),
                                 "blocks_per_sm": blocks}  # fmt: skip
            self._seen[key] = (kid, st)
        return self._seen[key]


def summarize(reader: KernelReader, launches: list[Launch], nbytes: int, elements: int) -> dict[str, Any]:
    """One case's figures from its launches. A launch's bytes count with its weight, programs x warps (each
    program runs the same code once); the case's ``nbytes`` are shared among launches in that proportion for
    the estimate."""
    arch = reader.arch
    parts = []
    for ln in launches:
        kid, st = reader.read(ln)
        parts.append((ln, kid, st, ln.programs * ln.warps))

    def share(kinds: tuple[str, ...]) -> float:
        lane: dict[int, float] = {}
        for _, _, st, w in parts:
            for width, b in st.widths(kinds).items():
                lane[width] = lane.get(width, 0.0) + b * w
        total = sum(lane.values())
        return round(lane.get(128, 0.0) / total, 4) if total else 1.0

    def indirect() -> float:
        tot = sum(sum(st.widths().values()) * w for _, _, st, w in parts)
        ind = sum(sum(st.widths(("gather", "scatter")).values()) * w for _, _, st, w in parts)
        return round(ind / tot, 4) if tot else 0.0

    dyn = [st.global_bytes_per_warp * w for _, _, st, w in parts]
    est = {}
    for g in arch.gpus if all(st.instructions for _, _, st, _ in parts) else ():  # (code not read: no bound)
        us = 0.0
        for (ln, _, st, _), d in zip(parts, dyn):
            part = nbytes * (d / sum(dyn) if sum(dyn) else 1 / len(parts))
            us += estimate(st, warps=ln.warps, programs=ln.programs, nbytes=int(part), arch=arch, gpu=GPUS[g])["us"]
        est[g] = {"us": round(us, 3)}
    instr = sum(st.instructions * w * 32 for _, _, st, w in parts)
    return {
        "launches": [{"kernel": kid, "grid": list(ln.grid), "warps": ln.warps} for ln, kid, _, _ in parts],
        "registers": max((st.registers for _, _, st, _ in parts), default=0),
        "local_bytes": max((st.local_bytes for _, _, st, _ in parts), default=0),
        "spill_bytes": max((st.spill_bytes for _, _, st, _ in parts), default=0),
        "occupancy": round(
            min((occupancy(st.registers, ln.warps, st.shared_bytes, arch)[1] for ln, _, st, _ in parts), default=1.0), 4
        ),
        "share_128": share(DIRECT),
        "indirect_share": indirect(),
        "instructions_per_element": round(instr / elements, 2) if elements else None,
        "estimate": est,
    }


def _copy_us(copy: tuple[Launch, SassStats], nbytes: int, arch: Arch, gpu: str) -> float:
    """The bound for the copy anchor moving ``nbytes`` (half read, half written), at its own launch geometry."""
    from . import anchors

    launch, st = copy
    programs = max(1, -(-nbytes // 8 // anchors.BLOCK))
    return estimate(st, warps=launch.warps, programs=programs, nbytes=nbytes, arch=arch, gpu=GPUS[gpu])["us"]


def check(case: dict[str, Any], goals: Goals = GOALS) -> list[str]:
    """The goals ``case`` (an entry of the report) misses, one line each naming the figure and the threshold."""
    out = []
    if case["spill_bytes"]:
        out.append(f"{case['spill_bytes']} bytes of register spills: the goal is none")
    if not case["memory_bound"]:
        return out
    if case["registers"] > goals.registers:
        out.append(f"{case['registers']} registers per thread: the goal is at most {goals.registers}")
    if case["occupancy"] < goals.occupancy:
        out.append(f"{case['occupancy']:.1%} theoretical occupancy: the goal is at least {goals.occupancy:.0%}")
    if case["provider"] == "triton" and case["layout"] == "aligned":
        ex = _exception(case["name"])
        floor = goals.share_128 if ex is None else ex.floor
        if case["share_128"] < floor:
            out.append(f"{case['share_128']:.1%} of direct global bytes by 128-bit accesses: the goal is at least "
                       f"{floor:.0%}" + (f" (exempt beyond that: {ex.why})" if ex else ""))  # fmt: skip
    return out


def inspect_kernels(
    arch: str = "sm_90",
    *,
    providers: Iterable[str] = PROVIDERS,
    families: Iterable[str] | None = None,
    match: str | None = None,
    names: Collection[str] | None = None,
    shard: tuple[int, int] | None = None,
    meta: dict[str, dict[str, int]] | None = None,
    disassemble: Collection[str] = PROVIDERS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The report (a JSON-able dict) of every kernel variant of ``families`` (default: all) on ``providers``,
    compiled for ``arch``; ``match`` keeps the cases whose name contains it, ``names`` those named (each must
    exist), ``shard=(i, n)`` every n-th case from the i-th (parallel processes share a run); ``meta`` forces
    meta-parameters per op (``{"flatten": {"BLOCK": 4096, "num_warps": 8}}``, as a tuned winner would set them)
    where the launchers would use their defaults. The code of ``disassemble``'s kernels is read (the others':
    registers, spills and occupancy only, no widths and no bound: nvdisasm costs a third of a second a kernel).

    Runs in a process where Triton compiles (``TRITON_INTERPRET`` unset) and Numba targets the GPU
    (``NUMBA_ENABLE_CUDASIM`` unset); raises :class:`ProviderUnavailableError` otherwise."""
    from ..ops import launch_cases
    from .launches import capture

    if arch not in ARCHS:
        raise InvalidArgumentError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    providers = tuple(providers)
    for p in providers:
        if p not in PROVIDERS:
            raise InvalidArgumentError(f"provider {p!r} is not one of {', '.join(PROVIDERS)}")
    fams = tuple(families) if families is not None else launch_cases.FAMILIES
    for f in fams:
        if f not in launch_cases.FAMILIES:
            raise InvalidArgumentError(f"family {f!r} is not one of {', '.join(launch_cases.FAMILIES)}")
    _check_modes(providers)
    a = ARCHS[arch]
    reader = KernelReader(a, tuple(disassemble))
    report: dict[str, Any] = {"arch": arch, "goals": asdict(GOALS), "gpus": {g: asdict(GPUS[g]) for g in a.gpus},
                              "versions": _versions(), "anchors": {}, "cases": [], "errors": []}  # fmt: skip
    copy = None
    with _meta_forced(meta):
        for name, fn, bpe in _anchor_cases():
            launches = capture("triton", a, fn)
            report["anchors"][name] = summarize(reader, launches, ANCHOR_ELEMENTS * bpe, ANCHOR_ELEMENTS)
            if copy is None:
                copy = (launches[0], reader.read(launches[0])[1])
        for case in _selected(launch_cases.cases(fams), match, names, shard):
            for p in providers:
                if progress:
                    progress(f"{p} {case.name}")
                try:
                    launches = capture(p, a, lambda c=case, p=p: c.run(p))
                    entry = {"name": case.name, "family": case.family, "provider": p, "layout": case.layout,
                             "memory_bound": case.memory_bound, "bytes": case.nbytes, "elements": case.elements,
                             **summarize(reader, launches, case.nbytes, case.elements)}  # fmt: skip
                except Exception as exc:  # a kernel that does not compile is a finding, not the end of the report
                    report["errors"].append({"name": case.name, "provider": p,
                                             "error": f"{type(exc).__name__}: {exc}"[:2000]})  # fmt: skip
                    continue
                for g, e in entry["estimate"].items():
                    e["copy_us"] = ref = round(_copy_us(copy, case.nbytes, a, g), 3)
                    e["vs_copy"] = round(e["us"] / ref, 3) if ref else None
                report["cases"].append(entry)
    for entry in report["cases"]:
        exc = _exception(entry["name"])
        if exc and entry["provider"] == "triton":
            entry["exemption"] = {"floor": exc.floor, "why": exc.why}
        entry["misses"] = check(entry)
    report["kernels"] = reader.kernels
    report["summary"] = _summary(report)
    return report


def _selected(cases: list, match: str | None, names: Collection[str] | None, shard: tuple[int, int] | None) -> list:
    if names is not None:
        unknown = set(names) - {c.name for c in cases}
        if unknown:
            raise InvalidArgumentError(f"no launch case named {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c.name in names]
    cases = [c for c in cases if not match or match in c.name]
    return cases[shard[0] :: shard[1]] if shard else cases


def _check_modes(providers: tuple[str, ...]) -> None:
    flags = {"triton": "TRITON_INTERPRET", "numba": "NUMBA_ENABLE_CUDASIM"}
    for p in providers:
        if os.environ.get(flags[p], "0").strip().lower() in ("1", "true", "on", "yes"):
            raise ProviderUnavailableError(
                f"torsh inspect compiles the {p} kernels for a GPU, but {flags[p]} is set here (the kernels then "
                f"run in {'Triton' if p == 'triton' else 'Numba'}'s {'interpreter' if p == 'triton' else 'simulator'}"
                f"): run it with {flags[p]} unset (env -u {flags[p]} torsh inspect ...)"
            )


@contextmanager
def _meta_forced(meta: dict[str, dict[str, int]] | None) -> Iterator[None]:
    from ..ops.registry import forced_meta

    with ExitStack() as stack:
        for op, m in (meta or {}).items():
            stack.enter_context(forced_meta(op, m))
        yield


def _versions() -> dict[str, str | None]:
    from ..env import package_version

    return {p: package_version(p) for p in ("torch", "triton", "numba", "torsh-kernels")}


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in report["cases"]:
        s = out.setdefault(
            f"{c['provider']} {c['family']}",
            {"cases": 0, "memory_bound": 0, "meeting_goals": 0, "registers": [1 << 30, 0], "share_128": [1.0, 0.0]},
        )
        s["cases"] += 1
        s["registers"] = [min(s["registers"][0], c["registers"]), max(s["registers"][1], c["registers"])]
        if c["memory_bound"]:
            s["memory_bound"] += 1
            s["meeting_goals"] += not c["misses"]
            if c["layout"] == "aligned":
                s["share_128"] = [min(s["share_128"][0], c["share_128"]), max(s["share_128"][1], c["share_128"])]
    return out


# --------------------------------------------------------------------------------------------------
# The command


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from ..ops.launch_cases import FAMILIES

    ap.add_argument("--arch", default="sm_90", choices=list(ARCHS), help="the GPU target (default sm_90)")
    ap.add_argument("--provider", dest="providers", type=cli_common.choice_list(PROVIDERS, "provider"),
                    default=list(PROVIDERS), help="comma-separated providers (default: triton,numba)")  # fmt: skip
    ap.add_argument("--family", dest="families", type=cli_common.choice_list(FAMILIES, "family"), default=None,
                    help=f"comma-separated op families (default: all of {', '.join(FAMILIES)})")  # fmt: skip
    ap.add_argument("--match", default=None, help="only the cases whose name contains this text")
    ap.add_argument("--meta", action="append", type=_meta_arg, default=[], metavar="OP:NAME=V[,NAME=V]",
                    help="launch OP's Triton kernels with these meta-parameters (values from its tuning space, "
                    "e.g. flatten:BLOCK=4096,num_warps=8: what a tuned winner would set); repeatable")  # fmt: skip
    ap.add_argument("--check", action="store_true", help="exit 1 if a kernel misses a goal")
    cli_common.add_json(ap, "the report")
    ap.add_argument("--width", type=cli_common.int_at_least(40), default=None, help="columns (default: the terminal's)")


def _meta_arg(text: str) -> tuple[str, dict[str, int]]:
    """``OP:NAME=V,...`` -> (op, {name: value}), checked against the op's tuning space."""
    from ..ops import tuning

    op, sep, rest = text.partition(":")
    space = tuning.spaces().get(op)
    if not sep or space is None:
        ops = ", ".join(sorted(tuning.spaces()))
        raise argparse.ArgumentTypeError(f"expected OP:NAME=V[,NAME=V] with OP one of {ops}, got {text!r}")
    allowed = space.meta.get("triton", {})
    out = {}
    for item in rest.split(","):
        name, eq, v = item.partition("=")
        if not eq or name not in allowed or not v.strip().lstrip("-").isdigit() or int(v) not in allowed[name]:
            choices = "; ".join(f"{k} in {list(vs)}" for k, vs in allowed.items()) or "none"
            raise argparse.ArgumentTypeError(f"{item!r}: {op}'s Triton meta-parameters are {choices}")
        out[name] = int(v)
    return op, out


def run(a: argparse.Namespace) -> int:
    import sys

    quiet = a.json == "-"
    con = cli_common.console(width=a.width, stderr=quiet)
    rep = inspect_kernels(a.arch, providers=a.providers, families=a.families, match=a.match, meta=dict(a.meta),
                          progress=(lambda s: print(f"  {s}", file=sys.stderr, flush=True)) if con.is_terminal
                          else None)  # fmt: skip
    print_report(rep, con)
    cli_common.write_json(a.json, rep)
    missed = sum(bool(c["misses"]) for c in rep["cases"])
    return 1 if (a.check and (missed or rep["errors"])) else 0


def print_report(rep: dict[str, Any], con) -> None:
    gpus = list(rep["gpus"])
    cols = ["case", "prov", "layout", "regs", "occ", "spill B", "128-bit", "gather/scatter", "instr/elem",
            *(f"{g.split('-')[0]} us" for g in gpus), "vs copy", "goals"]  # fmt: skip
    t = cli_common.table(f"torsh inspect: {rep['arch']} (versions: {rep['versions']})", cols,
                   text=("case", "prov", "layout", "goals"))  # fmt: skip
    for name, an in rep["anchors"].items():
        t.add_row(f"anchor: {name}", "triton", "aligned", str(an["registers"]), f"{an['occupancy']:.0%}",
                  str(an["spill_bytes"]), f"{an['share_128']:.0%}", f"{an['indirect_share']:.0%}",
                  f"{an['instructions_per_element']}",
                  *("" for _ in gpus), "", "")  # fmt: skip
    for c in rep["cases"]:
        est = [f"{c['estimate'][g]['us']:.1f}" if g in c["estimate"] else "" for g in gpus]
        vs = c["estimate"].get(gpus[0], {}).get("vs_copy")
        goals = "-" if not c["memory_bound"] and not c["misses"] else ("ok" if not c["misses"] else
                                                                         "; ".join(c["misses"]))  # fmt: skip
        t.add_row(c["name"], c["provider"], c["layout"], str(c["registers"]), f"{c['occupancy']:.0%}",
                  str(c["spill_bytes"]), f"{c['share_128']:.0%}" if c["provider"] == "triton" else "n/a",
                  f"{c['indirect_share']:.0%}",
                  str(c["instructions_per_element"]), *est, f"{vs:.2f}x" if vs else "", goals)  # fmt: skip
    con.print(t)
    for e in rep["errors"]:
        con.print(f"[{e['provider']}] {e['name']}: {e['error']}", markup=False)
    n = len(rep["cases"])
    mb = [c for c in rep["cases"] if c["memory_bound"]]
    ok = sum(not c["misses"] for c in mb)
    con.print(f"{ok} of {len(mb)} memory-bound cases meet the goals ({n} cases, {len(rep['kernels'])} kernels "
              f"compiled for {rep['arch']}); estimates are bandwidth bounds (no caches, contention or launch "
              "overhead)", markup=False)  # fmt: skip
