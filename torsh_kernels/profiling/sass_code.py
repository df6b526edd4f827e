"""Reading the SASS ``nvdisasm -c`` prints: its instructions and labels, the control flow between them, and
which registers and predicates may differ between the threads of a warp before each instruction (a fixed point
over the code, so loops are covered). :mod:`~torsh_kernels.profiling.sass` counts global memory accesses with
it: an access whose address depends on the thread moves 32 lanes' bytes per warp, one that does not moves one.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass

__all__ = ["GLOBAL_KINDS", "Instr", "access_width", "parse", "src_regs", "thread_dependent"]

_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_REG = re.compile(r"\b(U?R)(\d+)(\.64)?\b")
_PRED = re.compile(r"^@!?(U?P\d|U?PT)\s+")
_LABEL = re.compile(r"^\s*([\w.$]+):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")
GLOBAL_KINDS = {"LDG": "load", "LD": "load", "LDGSTS": "load", "STG": "store", "ST": "store", "ATOMG": "atomic",
           "ATOM": "atomic", "RED": "atomic", "REDG": "atomic"}  # fmt: skip
_NO_DEST = {"STG", "ST", "STS", "STL", "RED", "REDG", "BAR", "BRA", "BRX", "EXIT", "RET", "CALL", "BSYNC", "BSSY",
            "WARPSYNC", "NOP", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "DEPBAR", "YIELD", "LDGSTS", "LDGDEPBAR",
            "ARRIVES", "SYNCS", "BPT", "KILL", "JMP", "RPCMOV", "UTMALDG", "UTMASTG", "UBLKCP"}  # fmt: skip
_WIDE = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX")
_LOADS = {"LDG", "LD", "LDS", "LDSM", "ATOMG", "ATOM", "ATOMS"}  # (their sources are their address operands)


def access_width(op: str) -> int:
    """Access width in bits of a memory opcode (``LDG.E.128`` -> 128, ``STG.E.U16`` -> 16, ``LDG.E`` -> 32)."""
    parts = op.split(".")[1:]
    for p in parts:
        if p == "128":
            return 128
        if p in ("64", "U64", "S64", "F64"):
            return 64
        if p in ("U16", "S16"):
            return 16
        if p in ("U8", "S8"):
            return 8
    return 32


@dataclass(frozen=True, slots=True)
class Instr:
    """One SASS instruction: its guard, opcode, operands and branch target."""

    guard: str | None
    """The guarding predicate (``P0`` for ``@P0`` and ``@!P0``), or None."""
    op: str
    operands: tuple[str, ...]
    target: str | None
    """A branch's or call's target label."""

    @property
    def base(self) -> str:
        return self.op.split(".")[0]

    @property
    def unconditional(self) -> bool:
        return self.guard is None or self.guard == "PT"


def _dests_and_sources(ins: Instr) -> tuple[list[str], str]:
    """(registers and predicates the instruction writes, the text of its source operands): the first operand (and
    the register after a leading predicate, as in ``SHFL PT, R3, ...``; the carry-out predicates right after it,
    as in ``IADD3 R16, P0, P1, ...``). A destination that is a register pair or quad (``.64``, ``.128``, ``.WIDE``, fp64
    arithmetic) names each of its registers."""
    ops = ins.operands
    if ins.base in _NO_DEST or not ops:
        return [], " ".join(ops)
    n = 4 if ".128" in ins.op else 2 if (".64" in ins.op or ".WIDE" in ins.op or ".F64" in ins.op or
                                           ins.base in _WIDE or ins.base == "CS2R") else 1  # fmt: skip
    out: list[str] = []
    used = 1
    if ops[0] == "PR":  # R2P: every predicate
        return [f"P{i}" for i in range(7)], " ".join(ops[1:])
    m = re.fullmatch(r"(U?R)(\d+)(\.64)?", ops[0])
    if m:
        if m.group(1) == "R":
            out += [f"R{int(m.group(2)) + i}" for i in range(n)]
        while ins.base != "VOTE" and used < len(ops) and re.fullmatch(r"U?P(\d|T)", ops[used]):
            if ops[used] != "PT":  # carry-outs: IADD3 R16, P0, P1, ... writes both
                out.append(ops[used])
            used += 1
    elif re.fullmatch(r"U?P(\d|T)", ops[0]):
        if ops[0] != "PT":
            out.append(ops[0])
        if len(ops) > 1:
            m2 = re.fullmatch(r"R(\d+)(\.64)?", ops[1])
            if m2:
                out += [f"R{int(m2.group(1)) + i}" for i in range(n)]
            used = 2
    return out, " ".join(ops[used:])


def src_regs(text: str) -> set[str]:
    """The registers (a ``.64`` pair: both) and predicates that operand text reads (``PR``: every predicate)."""
    regs = set()
    for kind, num, wide in _REG.findall(text):
        if kind == "R":
            regs.add(f"R{num}")
            if wide:
                regs.add(f"R{int(num) + 1}")
    regs.update(re.findall(r"\bP\d\b", text))
    if re.search(r"\bPR\b", text):  # P2R / R2P read or write every predicate at once
        regs.add("PR")
    return regs


def parse(sass: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions, and each label's instruction index."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        lab = _LABEL.match(line)
        if lab:
            labels[lab.group(1)] = len(instrs)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        text = m.group(1)
        guard = None
        g = _PRED.match(text)
        if g:
            guard = g.group(1)
            text = text[g.end() :]
        op, _, rest = text.partition(" ")
        t = _TARGET.search(rest)
        operands = tuple(o.strip() for o in rest.split(",")) if rest.strip() else ()
        instrs.append(Instr(guard, op, operands, t.group(1) if t else None))
    return instrs, labels


def _successors(instrs: list[Instr], labels: dict[str, int]) -> list[list[int]]:
    n = len(instrs)
    returns = [i + 1 for i, ins in enumerate(instrs) if ins.base == "CALL" and i + 1 < n]
    out = []
    for i, ins in enumerate(instrs):
        nxt = [i + 1] if i + 1 < n else []
        tgt = labels.get(ins.target) if ins.target else None
        if ins.base in ("BRA", "JMP"):
            s = ([tgt] if tgt is not None else nxt) + ([] if ins.unconditional else nxt)
        elif ins.base == "EXIT":
            s = [] if ins.unconditional else nxt
        elif ins.base == "RET":
            s = returns
        elif ins.base == "CALL":
            s = [tgt] if tgt is not None else nxt  # (back through RET)
        elif ins.base in ("BRX", "JMX"):  # an indirect branch: anywhere labelled
            s = sorted(set(labels.values()) | set(nxt))
        else:
            s = nxt
        out.append(sorted(set(j for j in s if j < n)))
    return out


def _flow(steps: list[_Step], succ: list[list[int]], joins: dict[int, set[str]]) -> list[frozenset[str] | None]:
    """The registers and predicates that may differ between the threads of a warp before each instruction (None:
    unreachable). Sources: ``S2R ..., SR_TID.*``/``SR_LANEID``; a write of a value computed from a
    thread-dependent one (or under a thread-dependent guard) makes its destination thread-dependent, an
    unguarded write of a uniform value makes it uniform again; ``joins`` adds what divergent branches leave
    thread-dependent where they reconverge. Forward over the control flow graph to a fixed point (loops).

    The same state also holds ``@R5`` for a register whose value comes from memory each thread read at its own
    address (a per-thread load, and what is computed from it): an access through such an address is a gather or
    a scatter (an index table, a compaction), which no vector instruction can do."""
    before: list[frozenset[str] | None] = [None] * len(steps)
    if not steps:
        return before
    before[0] = frozenset(joins.get(0, ()))
    work, pending = [0], {0}  # in program order: a loop's body settles before what follows it
    while work:
        i = heapq.heappop(work)
        pending.discard(i)
        state = set(before[i] or ())
        dests, at_dests, src, at_src, reads_pr, tid, guard, strong, load = steps[i]
        if dests:
            dependent = tid or not src.isdisjoint(state) or (guard is not None and guard in state) or (
                reads_pr and any(r[0] == "P" for r in state))  # fmt: skip
            loaded = not at_src.isdisjoint(state) or (guard is not None and "@" + guard in state) or (
                load and not src.isdisjoint(state)) or (reads_pr and any(r[:2] == "@P" for r in state))  # fmt: skip
            if dependent:
                state |= dests
            elif strong:
                state -= dests
            if loaded:
                state |= at_dests
            elif strong:
                state -= at_dests
        out = frozenset(state)
        for j in succ[i]:
            new = (out if before[j] is None else before[j] | out) | joins.get(j, frozenset())
            if new != before[j]:
                before[j] = new
                if j not in pending:
                    pending.add(j)
                    heapq.heappush(work, j)
    return before


_Step = tuple  # (dests, @dests, sources, @sources, reads PR, reads the thread index, guard, unguarded, a load)


def _steps(instrs: list[Instr]) -> list[_Step]:
    """Each instruction's part in :func:`_flow`, worked out once."""
    out = []
    for ins in instrs:
        dests, srcs = _dests_and_sources(ins)
        src = src_regs(srcs)
        out.append((frozenset(dests), frozenset("@" + d for d in dests), frozenset(src - {"PR"}),
                    frozenset("@" + r for r in src), "PR" in src,
                    ins.base == "S2R" and ("SR_TID" in srcs or "SR_LANEID" in srcs), ins.guard, ins.unconditional,
                    ins.base in _LOADS))  # fmt: skip
    return out


def _divergent_joins(instrs: list[Instr], labels: dict[str, int], before: list) -> dict[int, set[str]]:
    """Where a branch taken by some threads of a warp and not others reconverges, what its arms wrote differs
    between threads: for a forward branch, the writes it skips (and an else arm's, ended by a branch past it),
    at its target (and past the else arm); for a backward branch (a loop the threads leave at different
    iterations), the loop's writes, after it."""
    joins: dict[int, set[str]] = {}

    def writes(a: int, b: int) -> set[str]:
        return {r for k in range(a, b) for r in _dests_and_sources(instrs[k])[0]}

    for i, ins in enumerate(instrs):
        t = labels.get(ins.target) if ins.target else None
        if ins.base != "BRA" or t is None or ins.unconditional or before[i] is None or ins.guard not in before[i]:
            continue
        if t > i:
            w = writes(i + 1, t)
            joins.setdefault(t, set()).update(w)
            last = instrs[t - 1]
            u = labels.get(last.target) if last.target else None
            if last.base == "BRA" and last.unconditional and u is not None and u > t:
                joins.setdefault(u, set()).update(w | writes(t, u))
        elif i + 1 < len(instrs):
            joins.setdefault(i + 1, set()).update(writes(t, i + 1))
    return joins


def thread_dependent(instrs: list[Instr], labels: dict[str, int]) -> list[frozenset[str] | None]:
    """:func:`_flow` with the divergent branches' joins, to a fixed point (which branches diverge depends on
    what is thread-dependent)."""
    succ = _successors(instrs, labels)
    steps = _steps(instrs)
    joins: dict[int, set[str]] = {}
    for _ in range(16):
        before = _flow(steps, succ, joins)
        new = _divergent_joins(instrs, labels, before)
        if new == joins:
            break
        joins = new
    return before
