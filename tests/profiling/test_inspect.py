"""`torsh inspect`: reading SASS (access widths, thread-dependent addresses, spills), occupancy, the bound, and
the command end to end (compiling real kernels for sm_80, sm_90 and sm_100 in a process without the
interpreter). The goals themselves are held by tests/ops/test_gpu_compile.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torsh_kernels.profiling.sass import ARCHS, GPUS, SassStats, estimate, occupancy, read

RES = "Resource usage:\n Function k:\n  REG:40 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0\n"

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   S2UR UR4, SR_CTAID.X ;
        /*0030*/                   LDC.64 R2, c[0x0][0x210] ;
        /*0040*/                   IMAD.WIDE R4, R0, 0x10, R2 ;
        /*0050*/                   LDG.E.64 R6, desc[UR6][R2.64] ;
        /*0060*/                   LDG.E.128 R8, desc[UR6][R4.64] ;
        /*0070*/                   STG.E.U16 desc[UR6][R4.64+0x10], R8 ;
        /*0080*/              @!P0 STL [R1], R9 ;
        /*0090*/                   ATOMG.E.ADD.64.STRONG.GPU PT, R10, desc[UR6][R2.64], R6 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
        /*00c0*/                   NOP;
"""

# A loop: R20 is copied from R12 before R12 is made from the thread index further down; only the back edge makes
# the load's address thread-dependent (a single pass would call it uniform).
LOOP = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   LDC.64 R12, c[0x0][0x210] ;
.L_x_0:
        /*0020*/                   MOV R20, R12 ;
        /*0030*/                   MOV R21, R13 ;
        /*0040*/                   LDG.E R22, desc[UR6][R20.64] ;
        /*0050*/                   IMAD.WIDE R12, R0, 0x4, R12 ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
"""

# Register reuse: R4 holds a per-thread address, then (written again from a constant) a table's address: the
# second load is uniform. And a branch on a thread-dependent predicate: R8 is the same for the threads that skip
# the MOV and for those that run it, but not between them, so after the join the load through R8 is per thread.
REUSE = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD.WIDE R4, R0, 0x4, RZ ;
        /*0020*/                   LDG.E.128 R12, desc[UR6][R4.64] ;
        /*0030*/                   LDC.64 R4, c[0x0][0x218] ;
        /*0040*/                   LDG.E.64 R16, desc[UR6][R4.64] ;
        /*0050*/                   LDC.64 R8, c[0x0][0x220] ;
        /*0060*/                   ISETP.NE.AND P1, PT, R0, RZ, PT ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   LDC.64 R8, c[0x0][0x228] ;
        /*0090*/                   STG.E.64 desc[UR6][R8.64], R16 ;
.L_x_1:
        /*00a0*/                   LDG.E R18, desc[UR6][R8.64] ;
        /*00b0*/                   EXIT ;
"""


def test_read_counts_widths_lanes_and_local_memory():
    st = read(RES, SASS)
    assert (st.registers, st.local_bytes, st.spill_bytes, st.spill_instructions) == (40, 16, 16, 1)
    assert st.accesses == {"uniform.load.64": 1, "load.128": 1, "store.16": 1, "uniform.atomic.64": 1}
    # per warp: a thread-dependent access moves 32 lanes, a uniform one a single lane
    assert st.lane_bytes == {"load": {64: 8, 128: 16 * 32}, "store": {16: 2 * 32}, "atomic": {64: 8}}
    assert st.share_128 == pytest.approx(512 / (512 + 64 + 16))
    assert st.load_bytes_per_thread == 16  # the uniform table load is not in flight per thread
    assert st.instructions == 11  # NOPs and the closing self-branch left out
    assert read(RES, SASS, spill_bytes=0).spill_bytes == 0  # ptxas -v said: local arrays, not spills


def test_thread_dependence_follows_loops_to_a_fixed_point():
    st = read(RES, LOOP)
    assert st.accesses == {"load.32": 1}


def test_thread_dependence_is_per_point_and_joins_divergent_branches():
    st = read(RES, REUSE)
    assert st.accesses == {"load.128": 1, "uniform.load.64": 1, "uniform.store.64": 1, "load.32": 1}


# A gather and a scatter: each thread loads an index (contiguous, 128-bit), then reads and writes out[index]: the
# addresses come from memory, one element each. A warp-shared index (uniform load) does not make an access indirect.
GATHER = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD.WIDE R2, R0, 0x10, RZ ;
        /*0020*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0030*/                   IMAD.WIDE R8, R4, 0x4, RZ ;
        /*0040*/                   LDG.E R10, desc[UR6][R8.64] ;
        /*0050*/                   STG.E desc[UR6][R8.64], R10 ;
        /*0060*/                   LDC.64 R12, c[0x0][0x210] ;
        /*0070*/                   LDG.E R14, desc[UR6][R12.64] ;
        /*0080*/                   IMAD.WIDE R16, R14, 0x4, R2 ;
        /*0090*/                   STG.E.128 desc[UR6][R16.64], R4 ;
        /*00a0*/                   FSETP.GT.AND P1, PT, R10, RZ, PT ;
        /*00b0*/                   IADD3 R18, P0, P1, R2, UR7, RZ ;
        /*00c0*/                   IADD3.X R19, R3, UR5, RZ, P0, P1 ;
        /*00d0*/                   STG.E.128 desc[UR6][R18.64], R4 ;
        /*00e0*/                   EXIT ;
"""


def test_gathers_and_scatters_are_told_from_direct_accesses():
    st = read(RES, GATHER)
    # (the last store's address is R2 plus a constant: IADD3's second carry-out P1 overwrites the data-dependent
    # predicate, it does not read it)
    assert st.accesses == {"load.128": 1, "gather.32": 1, "scatter.32": 1, "uniform.load.32": 1, "store.128": 2}
    assert st.share_128 == pytest.approx(1536 / (1536 + 4))  # direct bytes only: the uniform index load and three
    assert st.widths(("gather", "scatter")) == {32: 256}  # 128-bit accesses; the gather and scatter apart


def test_read_refuses_text_that_is_not_cuobjdump_output():
    with pytest.raises(RuntimeError, match="no resource usage"):
        read("nothing here", SASS)


@pytest.mark.parametrize(("regs", "warps", "shared", "blocks", "occ"), [
    (254, 4, 0, 2, 0.125),    # the old flatten kernel: 8192 registers a warp
    (64, 4, 0, 8, 0.5),
    (32, 8, 0, 8, 1.0),
    (24, 4, 0, 16, 1.0),
    (33, 4, 0, 12, 0.75),     # 33 x 32 rounds up to 1280 registers a warp
    (32, 4, 100_000, 2, 0.125),  # shared memory: 101,376 bytes a block (with the 1 KiB reserved) fit twice
])  # fmt: skip
def test_occupancy(regs, warps, shared, blocks, occ):
    assert occupancy(regs, warps, shared, ARCHS["sm_90"]) == (blocks, pytest.approx(occ))


def test_estimate_is_the_bandwidth_bound_when_enough_is_in_flight():
    st = SassStats(registers=24, local_bytes=0, spill_bytes=0, spill_instructions=0, shared_bytes=0, instructions=30,
                   load_bytes_per_thread=64)  # fmt: skip
    gpu = GPUS["H100-SXM5-80GB"]
    e = estimate(st, warps=4, programs=100_000, nbytes=335_000_000, arch=ARCHS["sm_90"], gpu=gpu)
    assert e == {"us": pytest.approx(100.0), "bandwidth_share": 1.0, "bound": "memory"}
    # one program cannot keep HBM busy: 128 threads x 64 bytes in flight against 3350 GB/s x 800 ns
    small = estimate(st, warps=4, programs=1, nbytes=8192, arch=ARCHS["sm_90"], gpu=gpu)
    assert small["bandwidth_share"] == pytest.approx(128 * 64 / (3350 * 800), rel=0.02)  # (rounded to 4 places)
    assert small["us"] > 8192 / 3350e3
    # a kernel that mostly stores (sign_unpack: a byte of signs read for 32 bytes written) needs only its loads'
    # share of the traffic in flight: 4 bytes a thread at full occupancy keep 1/33 of HBM's demand busy
    unpack = SassStats(registers=32, local_bytes=0, spill_bytes=0, spill_instructions=0, shared_bytes=0,
                       instructions=60, load_bytes_per_thread=4,
                       lane_bytes={"load": {32: 128}, "store": {128: 4096}})  # fmt: skip
    e = estimate(unpack, warps=8, programs=8192, nbytes=69_000_000, arch=ARCHS["sm_90"], gpu=gpu)
    assert e["bandwidth_share"] == 1.0 and e["bound"] == "memory"


# ---------------------------------------------------------------------------------------------- the command


def _inspect(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "torsh_kernels.apps.cli", "inspect", *args], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip


@pytest.mark.slow  # compiles real kernels with ptxas (the whole set: tests/ops/test_gpu_compile.py)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_the_command_compiles_and_reads_real_kernels(arch):
    pytest.importorskip("triton")
    r = _inspect("--arch", arch, "--family", "error_feedback", "--match", "error_update fp32->bf16 out", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["arch"] == arch and set(rep["gpus"]) == set(ARCHS[arch].gpus)
    assert set(rep["anchors"]) == {"copy fp32", "cast fp32->bf16"}
    assert rep["anchors"]["copy fp32"]["share_128"] == 1.0
    by = {c["provider"]: c for c in rep["cases"]}
    tri = by["triton"]
    assert tri["name"] == "error_update fp32->bf16 out" and tri["memory_bound"]
    # the bulk launch and the one-program tail (16 Mi + 3 elements), each a kernel with its figures
    assert [ln["grid"][0] for ln in tri["launches"]] == [(1 << 24) // 2048, 1]
    k = rep["kernels"][tri["launches"][0]["kernel"]]
    assert k["constexprs"]["HAS_OUT"] is True and k["args"]["end"].endswith(" D") and k["num_warps"] == 8
    assert tri["share_128"] >= 0.9 and tri["registers"] <= 64 and not tri["misses"]
    for g, e in tri["estimate"].items():
        assert e["copy_us"] > 0 and 0.9 < e["vs_copy"] < 1.5, (g, e)
    if "numba" in by:  # (where NVVM is found)
        assert by["numba"]["registers"] > 0 and by["numba"]["share_128"] == 0.0


@pytest.mark.slow  # a fresh `torsh inspect` process per bad argument
def test_the_command_refuses_bad_input_in_one_line():
    bad = [(["--arch", "sm_75"], "invalid choice"), (["--family", "nope"], "family"),
           (["--meta", "flatten:BLOCK=3"], "BLOCK in"), (["--meta", "nope:BLOCK=4096"], "OP one of")]  # fmt: skip
    for args, text in bad:
        r = _inspect(*args)
        assert r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    r = _inspect("--family", "sign", env_extra={"TRITON_INTERPRET": "1"})
    assert r.returncode == 1 and "TRITON_INTERPRET is set" in r.stderr


PTX = """
.version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 p)
{
    .reg .b64 %rd<4>;
    .reg .b32 %r<3>;
    .reg .f32 %f<2>;
    ld.param.u64 %rd1, [p];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd2, %rd2, %rd3;
    ld.global.f32 %f1, [%rd2];
    st.global.f32 [%rd2], %f1;
    ret;
}
"""


def test_disassembly_is_kept_in_the_cache(tmp_path, monkeypatch):
    """nvdisasm costs a third of a second a cubin: the second reading of one comes from the cache directory."""
    from torsh_kernels.profiling import sass

    cubin, spills = sass.ptx_to_cubin(PTX, ARCHS["sm_90"])
    monkeypatch.setenv("TORSH_KERNELS_CACHE_DIR", str(tmp_path))
    calls = []
    real = sass._run
    monkeypatch.setattr(sass, "_run", lambda args, what: calls.append(what) or real(args, what))
    first = sass.analyze(cubin, spill_bytes=spills)
    assert calls == ["cuobjdump", "nvdisasm"] and len(list((tmp_path / "sass").iterdir())) == 1
    second = sass.analyze(cubin, spill_bytes=spills)
    assert calls == ["cuobjdump", "nvdisasm"] and second == first
    assert first.accesses == {"load.32": 1, "store.32": 1} and spills == 0
    (next((tmp_path / "sass").iterdir())).write_bytes(b"not gzip")  # a damaged entry is read again, not trusted
    assert sass.analyze(cubin, spill_bytes=spills) == first and calls[-1] == "nvdisasm"
