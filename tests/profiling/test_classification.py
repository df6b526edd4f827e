"""How spans are classified (torsh's op table in torsh and Kineto traces, torsh span categories carried in
Kineto metadata, plain compute nested in torsh spans, GPU kernels by their launching op), unrecorded time,
and the report's suggestions: consistent with each other and with what the trace shows the job does."""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys

import pytest
import torch

from torsh_kernels.profiling import analysis as A
from torsh_kernels.profiling.report import Thresholds, build
from torsh_kernels.profiling.traces import TORSH_OPS, classify, load


def test_the_table_covers_every_torsh_op():
    """Every ``torsh::`` custom op and every name the provider registry records launches under has a class:
    an op added without one fails here."""
    import torsh_kernels.ops.moe
    import torsh_kernels.ops.offload  # noqa: F401 - every op module registers its ops on import

    custom = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("torsh::")}
    assert {"flatten", "unflatten", "orthogonalize", "quantize", "topk_compress", "moe_route"} <= custom
    assert custom - set(TORSH_OPS) == set()
    # the registry's names as the package alone makes them (in this process other tests and benchmarks add
    # their own)
    code = ("import torsh_kernels.ops.moe, torsh_kernels.ops.offload, torsh_kernels.ops.bucket, "
            "torsh_kernels.ops.topk, torsh_kernels.ops.quantize, torsh_kernels.ops.sign, "
            "torsh_kernels.ops.orthogonalize, torsh_kernels.ops.error_feedback; "
            "from torsh_kernels.ops import registry; print(sorted(registry._OPS))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = set(ast.literal_eval(out.stdout.strip()))
    assert {"flatten", "topk_compress", "moe_route"} <= names
    assert names - set(TORSH_OPS) == set()
    assert set(TORSH_OPS.values()) <= {"compression", "memory", "communication", "compute"}
    for name, cls in (("orthogonalize", "compression"), ("flatten", "memory"), ("wire_cast", "compression"),
                      ("moe_permute", "memory"), ("error_update", "compression")):  # fmt: skip
        assert classify("cpu_op", f"torsh::{name}", "kineto") == cls
        assert classify("op", name, "torsh") == cls
    assert classify("cpu_op", "aten::mm", "kineto") == "compute"


# -- a hand-made Kineto trace: torsh ops, torsh spans (with their categories in the metadata), GPU kernels


def _x(name, cat, a, b, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": 1000.0 + a * 1e3, "dur": (b - a) * 1e3, "pid": 0, "tid": tid,
            "args": args}  # fmt: skip


def _kineto_trace(with_metadata: bool = True) -> dict:
    ev = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "python"}},
        _x("ProfilerStep#1", "user_annotation", 0, 100),
        _x("torsh::orthogonalize", "cpu_op", 10, 30, **{"External id": 1}),
        _x("aten::mm", "cpu_op", 12, 20, **{"External id": 2}),
        _x("torsh::flatten", "cpu_op", 30, 40, **{"External id": 3}),
        _x("aten::cat", "cpu_op", 31, 39, **{"External id": 4}),
        _x("PowerSGD round 1", "user_annotation", 40, 60),
        _x("hooks.py(420): _start", "python_function", 40.5, 45.5),  # with_stack=True: Python frames between
        _x("aten::mul", "cpu_op", 41, 45, **{"External id": 5}),
        _x("c10d::allreduce_", "cpu_op", 45, 50, **{"External id": 6}),
        _x("forward", "user_annotation", 60, 72),
        _x("aten::relu", "cpu_op", 60, 70, **{"External id": 7}),
        # stream 7 of GPU 0: the kernels those ops launched, and NCCL's
        _x("mm_kernel", "kernel", 12, 19, tid=7, **{"External id": 2, "stream": 7}),
        _x("cat_kernel", "kernel", 31, 38, tid=7, **{"External id": 4, "stream": 7}),
        _x("mul_kernel", "kernel", 41, 44, tid=7, **{"External id": 5, "stream": 7}),
        _x("relu_kernel", "kernel", 60, 70, tid=7, **{"External id": 7, "stream": 7}),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 46, 80, tid=8, **{"External id": 6, "stream": 8}),
    ]
    data = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU"}],
            "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1}, "traceEvents": ev}  # fmt: skip
    if with_metadata:
        data["torsh"] = {"schema": "torsh-kineto/1",
                         "categories": {"PowerSGD round 1": "compression", "forward": "module"}}  # fmt: skip
    return data


def test_kineto_torsh_ops_spans_and_kernels(tmp_path):
    f = tmp_path / "k.json"
    f.write_text(json.dumps(_kineto_trace()))
    tr = load(f)
    cls = {s.name: s.cls for s in tr.spans}
    assert cls["torsh::orthogonalize"] == "compression" and cls["aten::mm"] == "compression"  # nested: inherited
    assert cls["torsh::flatten"] == "memory" and cls["aten::cat"] == "memory"
    # (through the Python frame between them)
    assert cls["PowerSGD round 1"] == "compression" and cls["aten::mul"] == "compression"
    assert cls["c10d::allreduce_"] == "communication"  # a collective inside a compression round stays one
    assert cls["forward"] == "compute" and cls["aten::relu"] == "compute"
    # kernels take the class of the op that launched them (External id)
    assert (cls["mm_kernel"], cls["cat_kernel"], cls["mul_kernel"], cls["relu_kernel"]) == (
        "compression", "memory", "compression", "compute")  # fmt: skip
    # measured on the GPU lanes: compute 10 (relu), compression 7 + 3, memory 7, NCCL in flight [46, 80] of which
    # [60, 70] under compute: exposed 24; the rest (100 - 51) no kernel ran: GPU idle
    b = A.breakdown(tr, 0, A.windows(tr, 0))
    assert b.measured_on == "device" and b.window_ms == pytest.approx(100)
    got = (b.compute_ms, b.compression_ms, b.memory_ms, b.communication_ms, b.unrecorded_ms)
    assert got == pytest.approx((10, 10, 7, 24, 49))
    rep = build(tr, thresholds=Thresholds(idle=0.3))
    ids = [g["id"] for g in rep["suggestions"]]
    assert "idle" in ids and "unrecorded" not in ids  # GPU idle: host stalls are the right advice here
    assert "host stalls" in next(g["message"] for g in rep["suggestions"] if g["id"] == "idle")
    assert rep["facts"]["compressors"] == ["PowerSGD"] and rep["facts"]["compressing"]
    comm = next(g["message"] for g in rep["suggestions"] if g["id"] == "communication")
    assert "compression_hook" not in comm and "already compresses (PowerSGD)" in comm
    # without torsh's metadata the range is an unknown annotation, but the torsh:: ops still say compression
    f.write_text(json.dumps(_kineto_trace(with_metadata=False)))
    cls = {s.name: s.cls for s in load(f).spans}
    assert cls["PowerSGD round 1"] == "other" and cls["aten::mul"] == "compute" and cls["aten::mm"] == "compression"


def _torsh_trace(xs: list[tuple], world: int = 1) -> dict:
    """A one-rank torsh trace from (name, cat, start ms, end ms, lane name, args) tuples."""
    lanes = sorted({x[4] for x in xs})
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}}]
    ev += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i + 1, "args": {"name": n}} for i, n in enumerate(lanes)]
    for name, cat, a, b, lane, args in xs:
        ev.append({"ph": "X", "name": name, "cat": cat, "ts": a * 1e3, "dur": (b - a) * 1e3, "pid": 0,
                   "tid": lanes.index(lane) + 1, "args": args})  # fmt: skip
    return {"distributedInfo": {"backend": None, "rank": 0, "world_size": world}, "traceEvents": ev,
            "otherData": {"schema": "torsh-trace/1", "rank": 0, "world_size": world, "device": "cpu", "versions": {},
                          "clock": {"base_unix_us": 0}}}  # fmt: skip


def test_torsh_ops_in_torsh_traces(tmp_path):
    xs = [("step 0", "step", 0, 100, "main", {"step": 0}),
          ("TopK round 1", "compression", 0, 10, "main", {"compressor": "TopK"}),
          ("flatten", "op", 1, 3, "main", {"provider": "torch"}),
          ("some_new_op", "op", 4, 6, "main", {"provider": "torch"}),
          ("topk_compress", "compression", 6, 8, "main", {"provider": "torch"}),
          ("forward", "module", 20, 30, "main", {"module": "MLP"}),
          ("moe_route", "op", 21, 25, "main", {}),
          ("issue all_reduce", "issue", 40, 50, "main", {}),
          ("flatten", "op", 41, 43, "main", {}),
          ("another_op", "op", 44, 45, "main", {})]  # fmt: skip
    (tmp_path / "rank0.json").write_text(json.dumps(_torsh_trace(xs)))
    tr = load(tmp_path)
    got = [(s.name, s.cls) for s in sorted(tr.spans, key=lambda s: s.start) if s.cls != "step"]
    assert got == [("TopK round 1", "compression"), ("flatten", "memory"), ("some_new_op", "compression"),
                   ("topk_compress", "compression"), ("forward", "compute"), ("moe_route", "compute"),
                   ("issue all_reduce", "communication"), ("flatten", "memory"),
                   ("another_op", "communication")]  # fmt: skip
    b = A.breakdown(tr, 0, A.windows(tr, 0))
    # compute 10 (forward, moe_route inside), compression 10 - 2 (flatten: memory), memory 2 + 2, exposed
    # communication 10 - 2 (issuing counts whole, less the flatten it nests), unrecorded 100 - 30
    got = (b.compute_ms, b.compression_ms, b.memory_ms, b.communication_ms, b.unrecorded_ms)
    assert got == pytest.approx((10, 8, 4, 8, 70)) and b.measured_on == "host"


# -- suggestions: never contradictory, never what the job already does -------------------------------------


def _job(compress_ms: float, exposed_ms: float, compressor: str | None, comm_in_backward: bool | None,
         memory_ms: float) -> dict:  # fmt: skip
    """One 200 ms step: forward [0, 20], then (maybe) backward [20, 50], compression, a collective in flight
    (exposed), copies; ``comm_in_backward``: the collective starts inside backward (True), after it
    (False), or backward is not recorded (None)."""
    xs = [("step 0", "step", 0, 200, "main", {"step": 0}), ("forward", "user", 0, 20, "main", {})]
    if comm_in_backward is not None:
        xs.append(("backward", "module", 20, 50, "main", {}))
    t = 50.0
    if compress_ms:
        args = {"compressor": compressor} if compressor else {}
        xs.append((f"{compressor or 'X'} round 1", "compression", t, t + compress_ms, "main", args))
        t += compress_ms
    c0 = 30.0 if comm_in_backward else t
    end = max(t, c0) + exposed_ms
    if exposed_ms:
        args = {"op": "all_reduce", "group": "0", "seq": 1, **({"compressor": compressor} if compressor else {})}
        xs.append(("all_reduce", "collective", c0, end, "comm 0", args))
    if memory_ms:
        xs.append(("offload grads to host", "offload", end, end + memory_ms, "main", {}))
    return _torsh_trace(xs)


CASES = list(itertools.product((0.0, 5.0, 30.0), (0.0, 10.0, 40.0), (None, "TopK", "FP16"), (None, False, True),
                               (0.0, 25.0)))  # fmt: skip


PHRASES = ("raise the compression rate", "cheaper compressor", "would not pay", "already start during backward",
           "backward is not recorded")  # fmt: skip


def test_suggestions_are_consistent(tmp_path):
    th = Thresholds(comm_share=0.01, overlap=0.99, overlap_min_comm=0.0, compression=0.01, idle=0.0, unrecorded=0.01,
                    memory=0.01)  # fmt: skip
    seen = set()
    for i, (c, x, comp, bw, m) in enumerate(CASES):
        d = tmp_path / f"c{i}"
        d.mkdir()
        (d / "rank0.json").write_text(json.dumps(_job(c, x, comp, bw, m)))
        rep = build(load(d), thresholds=th)
        msgs = {g["id"]: g["message"] for g in rep["suggestions"]}
        text = " ".join(msgs.values())
        seen |= set(msgs) | {p for p in PHRASES if p in text}
        where = (c, x, comp, bw, m, msgs)
        compressing = bool(c) or (comp is not None and bool(x))  # seen in a round or a collective's args
        assert rep["facts"]["compressing"] == compressing, where
        if compressing:  # never propose what the job does
            assert "compression_hook" not in text, where
        elif x:
            assert "compress gradients with compression_hook" in msgs["communication"], where
        # compress harder and compress more cheaply exclude each other
        assert not ("raise the compression rate" in text and "cheaper compressor" in text), where
        if "cheaper compressor" in text and comp is not None:
            assert comp not in text.split("cheaper compressor")[1].split(")")[0], where
        # the host-measured time no span covers is unrecorded: never host stalls, never "idle"
        assert "stall" not in text and "idle" not in msgs, where
        if bw:
            assert "GradientSynchronizer(overlap=True)" not in msgs.get("overlap", ""), where
        if m:
            assert "prefetch offloaded state" in msgs["memory"], where
    # the rules did fire across the cases (the checks above are not vacuous)
    assert {"communication", "overlap", "compression", "unrecorded", "memory", *PHRASES} <= seen
