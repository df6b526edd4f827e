"""Machine code of a GPU kernel, read without a GPU: resource usage, global memory accesses by width,
theoretical occupancy and a bandwidth-bound time estimate.

A kernel compiled to a cubin for a named target (Triton's own pipeline, or Numba's PTX through ``ptxas``)
is read with the CUDA binary utilities that Triton's wheel ships (``triton/backends/nvidia/bin``:
``ptxas``, ``cuobjdump``, ``nvdisasm``; a CUDA toolkit's, on ``PATH`` or under ``CUDA_HOME``, otherwise):

- ``cuobjdump --dump-resource-usage``: registers per thread, local memory (spills and stack), shared memory;
- ``nvdisasm``: the SASS. Every global memory instruction (``LDG``, ``STG``, ``LD``/``ST``, ``ATOMG``,
  ``RED``, ``LDGSTS``) is counted by access width (8 to 128 bits). An access whose address does not depend
  on the thread (a table entry, a scalar argument every thread reads) moves one lane's bytes per warp; one
  whose address does moves 32 lanes' bytes. Which addresses depend on the thread is found by following
  ``SR_TID``/``SR_LANEID`` through the registers they flow into (a fixed point over the code, so loops are
  covered). The share of bytes moved by 128-bit accesses is the headline figure: a memory-bound kernel
  reaches the hardware's bandwidth with fewer instructions in flight when each moves 16 bytes.

The counts are static: each instruction once, whichever paths run and however often a loop turns. Each
kernel variant of torsh-kernels is one path for its data (the host picks the variant), so for them the
static share is the share of the bytes the kernel moves, up to loop trip counts.

The time estimate is a bound, not a prediction: bytes / (HBM bandwidth x the fraction of it the launch
can keep in flight). Little's law gives that fraction: at full bandwidth a GPU needs about
bandwidth x latency bytes of loads outstanding; a launch has at most (resident threads) x (bytes each
thread loads before it must wait) in flight. An instruction-issue bound (SASS instructions x warps / the
SMs' issue rate) is taken too, whichever is slower. It does not see caches, DRAM page effects, contention
with other kernels, or launch overhead.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ProviderUnavailableError
from .sass_code import GLOBAL_KINDS, access_width, parse, src_regs, thread_dependent

__all__ = ["ARCHS", "DIRECT", "GPUS", "KINDS", "Arch", "Gpu", "SassStats", "analyze", "estimate", "occupancy",
           "ptx_to_cubin", "read", "tools"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Arch:
    """A compile target and the per-SM limits theoretical occupancy is computed from."""

    name: str
    """``sm_80``, ``sm_90``, ``sm_100``."""
    capability: int
    """Compute capability as Triton writes it (80, 90, 100)."""
    max_warps: int
    """Resident warps per SM."""
    max_blocks: int
    """Resident thread blocks per SM."""
    registers: int
    """32-bit registers per SM."""
    shared: int
    """Shared memory per SM usable by blocks, in bytes."""
    block_reserved_shared: int
    """Shared memory the system reserves per block, in bytes."""
    gpus: tuple[str, ...]
    """The GPUs (keys of :data:`GPUS`) whose time the report estimates for this target."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU model's figures for the bandwidth-bound estimate (vendor datasheet values)."""

    name: str
    sms: int
    """Streaming multiprocessors."""
    hbm_gbps: float
    """Peak HBM bandwidth, GB/s (10^9 bytes per second)."""
    clock_ghz: float
    """SM clock under sustained load, GHz (the issue bound)."""
    latency_ns: float = 800.0
    """DRAM latency under load assumed by Little's law, ns (microbenchmarks put an idle HBM access at 500-600 ns
    on Hopper; queues at full bandwidth add to it). The estimate's in-flight term scales with it."""


# sm_80: A100 (164 KiB shared per SM); sm_90 / sm_100: 228 KiB. 64 warps, 32 blocks, 64 Ki registers per SM.
ARCHS: dict[str, Arch] = {
    "sm_80": Arch("sm_80", 80, 64, 32, 65536, 167936, 1024, ("A100-SXM4-80GB",)),
    "sm_90": Arch("sm_90", 90, 64, 32, 65536, 233472, 1024, ("H100-SXM5-80GB", "H200-SXM-141GB")),
    "sm_100": Arch("sm_100", 100, 64, 32, 65536, 233472, 1024, ("B200",)),
}

GPUS: dict[str, Gpu] = {
    "A100-SXM4-80GB": Gpu("A100-SXM4-80GB", 108, 2039.0, 1.41),
    "H100-SXM5-80GB": Gpu("H100-SXM5-80GB", 132, 3350.0, 1.755),
    "H200-SXM-141GB": Gpu("H200-SXM-141GB", 132, 4800.0, 1.755),
    "B200": Gpu("B200", 148, 8000.0, 1.85),
}

_TOOLS = ("ptxas", "cuobjdump", "nvdisasm")
DIRECT = ("load", "store", "atomic")
"""The access kinds at addresses computed from the thread index and the arguments (vectorizable in principle)."""
KINDS = (*DIRECT, "gather", "scatter")


def _dirs() -> list[Path]:
    dirs = []
    try:
        import triton

        dirs.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin")
    except Exception:  # no Triton: a toolkit's tools still serve Numba's PTX
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "bin")
    return dirs


def _found(name: str) -> list[str]:
    """Every executable ``name`` in :func:`_dirs`, then on ``PATH`` (no duplicates)."""
    out = [str(d / name) for d in _dirs() if (d / name).is_file() and os.access(d / name, os.X_OK)]
    p = shutil.which(name)
    if p and p not in out:
        out.append(p)
    return out


def tools() -> dict[str, str]:
    """Paths of ``ptxas``, ``cuobjdump`` and ``nvdisasm`` (and ``ptxas-blackwell`` where Triton ships it).

    Looked for in Triton's wheel first (the versions its compiler uses), then under ``CUDA_HOME`` /
    ``CUDA_PATH``, then on ``PATH``. Raises :class:`ProviderUnavailableError` naming what is missing and how
    to get it."""
    found = {name: paths[0] for name in (*_TOOLS, "ptxas-blackwell") if (paths := _found(name))}
    missing = [t for t in _TOOLS if t not in found]
    if missing:
        raise ProviderUnavailableError(
            f"torsh inspect needs {', '.join(missing)} (CUDA binary utilities) and found none in Triton's wheel, "
            f"CUDA_HOME/CUDA_PATH or PATH. Install Triton (pip install triton: its wheel ships them) or a CUDA "
            f"toolkit (its bin/ on PATH, or CUDA_HOME set)"
        )
    return found


def _run(args: list[str], what: str) -> str:
    p = subprocess.run(args, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(args[:2])} ...): {p.stderr.strip()[:2000]}")
    return p.stdout


def _run_log(args: list[str], what: str) -> str:
    """Like :func:`_run`, returning what the tool printed on both streams (``ptxas -v`` logs to stderr)."""
    p = subprocess.run(args, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(args[:2])} ...): {p.stderr.strip()[:2000]}")
    return p.stdout + p.stderr


def ptx_to_cubin(ptx: str, arch: Arch) -> tuple[bytes, int]:
    """(cubin, spill bytes: what ``ptxas -v`` reports as spill stores): PTX assembled for ``arch`` at
    ``ptxas``'s default optimisation level (-O3, as the driver's JIT does when a Numba kernel is loaded).

    Every ``ptxas`` found is tried in turn (Triton's first): a PTX file names the ISA version it needs and an
    older ``ptxas`` refuses a newer one (Numba emits the version of the NVVM it found, which may be a newer
    toolkit's than Triton's)."""
    tools()
    names = ("ptxas-blackwell", "ptxas") if arch.capability >= 100 else ("ptxas",)
    candidates = [p for n in names for p in _found(n)]
    errors = []
    with tempfile.TemporaryDirectory(prefix="torsh-sass-") as d:
        src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        for ptxas in candidates:
            try:
                log = _run_log([ptxas, "-v", f"-arch={arch.name}", "-o", str(out), str(src)], "ptxas")
                spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", log))
                return out.read_bytes(), spills
            except RuntimeError as e:
                errors.append(str(e))
    raise RuntimeError("no ptxas here assembles this PTX: " + " | ".join(errors))


# --------------------------------------------------------------------------------------------------
# Reading the cubin


@dataclass(slots=True)
class SassStats:
    """What the machine code of one kernel says."""

    registers: int
    local_bytes: int
    """Local memory per thread (stack frame: spill slots and local arrays), bytes."""
    spill_bytes: int
    """Of that, bytes of register spills (``ptxas -v``'s spill stores; Triton kernels have no local arrays, so
    all their local memory is spills)."""
    spill_instructions: int
    """``LDL``/``STL`` instructions (spills and local arrays)."""
    shared_bytes: int
    """Static shared memory per block (Triton reports its dynamic share separately; added by the caller)."""
    instructions: int
    """SASS instructions (NOPs and the closing self-branch left out)."""
    accesses: dict[str, int] = field(default_factory=dict)
    """Global memory instructions by kind and width, e.g. ``"load.128": 4``, ``"store.32": 2``,
    ``"atomic.64": 1``; an access whose address is the same for every thread is counted under ``"uniform"``
    (``"uniform.load.64"``)."""
    lane_bytes: dict[str, dict[int, int]] = field(default_factory=dict)
    """Bytes one warp moves through global memory, by kind and access width in bits (a thread-independent address
    counts one lane). Kinds: ``load``, ``store``, ``atomic`` at addresses computed from the thread and the
    arguments; ``gather`` (loads) and ``scatter`` (stores, atomics) at addresses computed from what each thread
    read from memory (an index, a compaction's position): one element each, which no vector access can do."""
    load_bytes_per_thread: int = 0
    """Bytes one thread loads from thread-dependent global addresses (the loads a thread has in flight)."""

    def widths(self, kinds: tuple[str, ...] = KINDS) -> dict[int, int]:
        """Warp bytes by access width over ``kinds``."""
        out: dict[int, int] = {}
        for k in kinds:
            for w, b in self.lane_bytes.get(k, {}).items():
                out[w] = out.get(w, 0) + b
        return out

    @property
    def global_bytes_per_warp(self) -> int:
        return sum(self.widths().values())

    @property
    def share_128(self) -> float:
        """Share of the direct (not gathered or scattered) global bytes moved by 128-bit accesses (1.0 for a kernel
        that moves none)."""
        w = self.widths(DIRECT)
        return w.get(128, 0) / sum(w.values()) if w else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lane_bytes"] = {k: {str(w): b for w, b in sorted(v.items())} for k, v in sorted(self.lane_bytes.items())}
        d["share_128"] = round(self.share_128, 4)
        return d


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def analyze(cubin: bytes, shared_extra: int = 0, spill_bytes: int | None = None, *, code: bool = True) -> SassStats:
    """Resource usage and global memory accesses of the (single) kernel in ``cubin``; ``spill_bytes`` as
    ``ptxas -v`` reported it (None: all local memory counts as spills). ``code=False``: the resource usage
    alone (registers, local and shared memory: what occupancy needs), without disassembling the code."""
    if not code:
        with tempfile.TemporaryDirectory(prefix="torsh-sass-") as d:
            (Path(d) / "k.cubin").write_bytes(cubin)
            res = _run([tools()["cuobjdump"], "--dump-resource-usage", str(Path(d) / "k.cubin")], "cuobjdump")
        return read(res, "", shared_extra, spill_bytes)
    res, sass = _disassembled(cubin)
    return read(res, sass, shared_extra, spill_bytes)


def _disassembled(cubin: bytes) -> tuple[str, str]:
    """What ``cuobjdump --dump-resource-usage`` and ``nvdisasm -c`` print for ``cubin``. ``nvdisasm`` takes a
    third of a second a cubin whatever its size, so the text is kept in the tuning cache's directory
    (``sass/``, compressed, keyed by the cubin's and the tools' identity): a second report, or the suite's
    full compile check after its gate, reads it back. A cache that cannot be read or written is skipped."""
    import gzip
    import hashlib

    from ..files import write_atomic
    from ..ops.tuning import cache_dir

    t = tools()
    ident = hashlib.sha256(cubin + "|".join((t["cuobjdump"], t["nvdisasm"])).encode()).hexdigest()
    path = cache_dir() / "sass" / f"{ident}.txt.gz"
    try:
        res, _, sass = gzip.decompress(path.read_bytes()).decode().partition("\0")
        if sass:
            return res, sass
    except (OSError, ValueError, EOFError):
        pass
    with tempfile.TemporaryDirectory(prefix="torsh-sass-") as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        res = _run([t["cuobjdump"], "--dump-resource-usage", str(f)], "cuobjdump")
        sass = _run([t["nvdisasm"], "-c", str(f)], "nvdisasm")
    with contextlib.suppress(Exception):  # (a read-only or full cache directory costs time, never the report)
        write_atomic(path, gzip.compress(f"{res}\0{sass}".encode()), fsync=False, what="SASS cache entry")
    return res, sass


def read(resource_usage: str, sass: str, shared_extra: int = 0, spill_bytes: int | None = None) -> SassStats:
    """What :func:`analyze` reads, from the text ``cuobjdump --dump-resource-usage`` and ``nvdisasm -c`` printed."""
    m = _RES.search(resource_usage)
    if not m:
        raise RuntimeError(f"cuobjdump printed no resource usage: {resource_usage[:500]}")
    regs, stack, shared, local = map(int, m.groups())
    instrs, labels = parse(sass)
    while instrs and instrs[-1].base in ("NOP", "BRA") and instrs[-1].unconditional:  # the closing `BRA self`
        instrs.pop()
    before = thread_dependent(instrs, labels)
    everything = frozenset(f"R{i}" for i in range(256))
    stats = SassStats(registers=regs, local_bytes=stack + local,
                      spill_bytes=stack + local if spill_bytes is None else spill_bytes, spill_instructions=0,
                      shared_bytes=shared + shared_extra, instructions=0)  # fmt: skip
    for i, ins in enumerate(instrs):
        if ins.base == "NOP":
            continue
        stats.instructions += 1
        if ins.base in ("LDL", "STL"):
            stats.spill_instructions += 1
            continue
        kind = GLOBAL_KINDS.get(ins.base)
        if kind is None:
            continue
        addr = next((o for o in reversed(ins.operands) if "[" in o), "")
        dependent = before[i] if before[i] is not None else everything  # (unreachable: counted as per thread)
        regs = src_regs(re.sub(r"desc\[[^\]]*\]", "", addr))
        per_thread = bool(regs & dependent)
        if per_thread and any("@" + r in dependent for r in regs):
            kind = "gather" if kind == "load" else "scatter"
        w = access_width(ins.op)
        key = f"{kind}.{w}" if per_thread else f"uniform.{kind}.{w}"
        stats.accesses[key] = stats.accesses.get(key, 0) + 1
        by = stats.lane_bytes.setdefault(kind, {})
        by[w] = by.get(w, 0) + (w // 8) * (32 if per_thread else 1)
        if per_thread and kind in ("load", "gather"):
            stats.load_bytes_per_thread += w // 8
    return stats


# --------------------------------------------------------------------------------------------------
# Occupancy and the estimate


def occupancy(registers: int, warps: int, shared_bytes: int, arch: Arch) -> tuple[int, float]:
    """(resident blocks per SM, theoretical occupancy: resident warps / the SM's maximum)."""
    per_warp_regs = -(-max(registers, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    limits = [arch.max_blocks, arch.max_warps // max(warps, 1), arch.registers // (per_warp_regs * max(warps, 1))]
    if shared_bytes:
        limits.append(arch.shared // (-(-(shared_bytes + arch.block_reserved_shared) // 128) * 128))
    blocks = max(0, min(limits))
    return blocks, blocks * warps / arch.max_warps


def estimate(stats: SassStats, *, warps: int, programs: int, nbytes: int, arch: Arch, gpu: Gpu) -> dict:
    """Bandwidth-bound time of one launch of ``programs`` programs moving ``nbytes`` bytes in all on ``gpu``:
    ``{"us": ..., "bandwidth_share": ..., "bound": "memory"|"issue"}`` (see the module docstring)."""
    blocks, _ = occupancy(stats.registers, warps, stats.shared_bytes, arch)
    resident = min(programs, blocks * gpu.sms) if blocks else 0
    in_flight = resident * warps * 32 * stats.load_bytes_per_thread
    # a thread waits for its loads, not its stores: the loads need to keep their share of the traffic in flight
    total = stats.global_bytes_per_warp
    reads = sum(stats.widths(("load", "gather")).values()) / total if total else 1.0
    needed = gpu.hbm_gbps * gpu.latency_ns * reads  # bytes (GB/s x ns)
    share = min(1.0, in_flight / needed) if needed else 1.0
    t_mem = nbytes / (gpu.hbm_gbps * 1e3 * share) if share > 0 else float("inf")  # us
    # issue: every warp of every program runs the kernel's instructions once; 4 schedulers per SM, 1 per clock
    warp_instr = programs * warps * stats.instructions
    t_issue = warp_instr / (gpu.sms * 4 * gpu.clock_ghz * 1e3)  # us
    return {
        "us": round(max(t_mem, t_issue), 3),
        "bandwidth_share": round(share, 4),
        "bound": "memory" if t_mem >= t_issue else "issue",
    }
