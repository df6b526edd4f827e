"""Benchmark of offload packing and of the offloaded optimizer.

Part 1, per format (bf16, fp16, int8) and size (fp32 tensors of --sizes MiB, default 64 and 256):

- ``to host``: ours = ``pack(x, fmt, out=host)`` (one fused pass; on CUDA only the packed bytes cross
  the bus into pinned memory); peers = ``host_fp32.copy_(x, non_blocking=True)`` (the plain
  ``.to("cpu", non_blocking=True)`` of the fp32 tensor, into a preallocated pinned buffer) and a
  torch cast then copy (``x.to(bf16)``, or torch-ops blockwise int8 quantization, then the copy);
- ``from host``: ours = ``unpack(packed_host, out=x_dev)``; peers = ``x_dev.copy_(host_fp32)`` and the
  copy of the cast tensor then ``.to(fp32)`` on the device.

The baseline (``copy``) is a host copy of the packed bytes alone, so "of copy" tells how close packing
comes to moving just its output (the GPU target: >= 90%). GB/s counts the fp32 source bytes (what the
user moves), so a format's GB/s can exceed the link's.

Part 2, an optimizer step on an MLP stack of --layers x [--width x --width] (the 1B-parameter class
scaled to the machine: the defaults give 0.2B on CUDA and 17M on the CPU): forward + backward + step with
plain AdamW against ``OffloadedOptimizer`` (bf16 state; gradients moved at the step, or during
backward) and, on CUDA where torchao is installed, torchao's ``CPUOffloadOptimizer``; step time and
the peak memory of the device (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the optimizer state
bytes, since host and device are the same memory there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ... import cli_common
from ...ops import FORMATS, pack, packed_nbytes, quantize_ref, unpack
from ...parallel import OffloadedOptimizer
from . import (
    Case,
    Result,
    add_device,
    emit,
    environment,
    fmt_bytes,
    print_tables,
    resolve_device,
    result_doc,
)

MIB = 1 << 20


def run_pack_case(fmt: str, mib: float, device: torch.device, reps: int) -> list[Result]:
    pin = device.type == "cuda"
    n = int(mib * MIB) // 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g).to(device)
    nbytes = packed_nbytes(n, fmt)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host_fp32 = torch.empty(n, dtype=torch.float32, pin_memory=pin)
    low = torch.float16 if fmt == "fp16" else torch.bfloat16
    host_low = torch.empty(n, dtype=low if fmt != "int8" else torch.int8, pin_memory=pin)
    host_scales = torch.empty(-(-n // 256), dtype=torch.float32, pin_memory=pin)
    dev_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
    back = torch.empty_like(x)
    case = Case(f"{fmt}: fp32 [{n}] ({fmt_bytes(n * 4)}) -> {fmt_bytes(nbytes)}", device)
    add = case.add
    add("copy", "copy of the packed bytes to host", "copy", lambda: host.copy_(dev_bytes, non_blocking=True),
        2 * nbytes)  # fmt: skip
    packed = pack(x, fmt, out=host)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ratio = packed.compression_ratio
    add("to host", f"torsh pack ({ratio:.2f}x smaller)", "ours", lambda: pack(x, fmt, out=host), 2 * n * 4)
    add("to host", 'x.to("cpu", non_blocking=True) fp32', "peer", lambda: host_fp32.copy_(x, non_blocking=True),
        2 * n * 4)  # fmt: skip
    if fmt == "int8":

        def cast_copy() -> None:
            q, s = quantize_ref(x, bits=8)
            host_low.copy_(q, non_blocking=True)
            host_scales.copy_(s, non_blocking=True)

        add("to host", "torch-ops int8 quantize + copy", "peer", cast_copy, 2 * n * 4)
    else:
        add("to host", f"x.to({fmt}) + copy", "peer", lambda: host_low.copy_(x.to(low), non_blocking=True), 2 * n * 4)
    add("from host", "torsh unpack", "ours", lambda: unpack(packed, out=back), 2 * n * 4)
    add("from host", "copy_(host fp32)", "peer", lambda: back.copy_(host_fp32, non_blocking=True), 2 * n * 4)
    if fmt != "int8":
        add("from host", f"copy of {fmt} + .to(fp32)", "peer",
            lambda: back.copy_(host_low.to(device, non_blocking=True)), 2 * n * 4)  # fmt: skip
    results = case.time(reps)
    for r in results:
        r.extra.update({"format": fmt, "numel": n, "packed_bytes": nbytes, "compression_ratio": ratio})
    return results


TORCHAO = "torchao CPUOffloadOptimizer"


def torchao_offload(device: torch.device) -> tuple[type | None, str]:
    """torchao's ``CPUOffloadOptimizer`` (the peer of :class:`OffloadedOptimizer`: AdamW's step on the host
    with fp32 host copies of each parameter and gradient), or None and why it cannot run here: torchao is
    not a dependency (it is in the ``cuda`` extra), and its optimizer asserts a CUDA or XPU device."""
    if device.type != "cuda":  # checked first: installed or not, it cannot run here
        return None, "torchao's CPUOffloadOptimizer runs on CUDA or XPU only (it asserts so on the CPU)"
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as e:
        return None, f"torchao is not installed ({e}); pip install torchao (in the cuda extra)"
    return CPUOffloadOptimizer, ""


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors (local shards of DTensors), torchao's per-parameter host
    optimizers and its on-device one included."""
    if isinstance(opt, OffloadedOptimizer):
        return opt.stats["state_bytes"]
    opts = [opt]
    if hasattr(opt, "optim_dict"):  # torchao: one host optimizer per offloaded parameter, d_opt for the small
        opts = list(opt.optim_dict.values()) + ([opt.d_opt] if opt.d_opt is not None else [])
    tensors = [v for o in opts for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes for v in tensors)


def _mlp(width: int, layers: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(device)


def run_optimizer(width: int, layers: int, batch: int, steps: int, device: torch.device) -> list[dict]:
    out = []
    ao, why = torchao_offload(device)
    names = ["AdamW", "OffloadedOptimizer(bf16)", "OffloadedOptimizer(bf16, grads in backward)"]
    if ao is None:
        print(f"{TORCHAO}: not run: {why}")
    else:
        names.append(TORCHAO)
    for name in names:
        model = _mlp(width, layers, device)
        n = sum(p.numel() for p in model.parameters())
        if name == "AdamW":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        elif name == TORCHAO:
            opt = ao(model.parameters(), torch.optim.AdamW, lr=1e-4)
        else:
            grads = "backward" if "backward" in name else "step"
            opt = OffloadedOptimizer(model.parameters(), state_format="bf16", lr=1e-4, offload_gradients=grads)
        x = torch.randn(batch, width, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, step_times = [], []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            if i >= 2:
                times.append((t2 - t0) * 1e3)
                step_times.append((t2 - t1) * 1e3)
        # on the CPU host = device: what the optimizer's state occupies
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else optimizer_state_bytes(opt)
        out.append({"optimizer": name, "params": n, "train_step_ms": statistics.median(times),
                    "optimizer_step_ms": statistics.median(step_times), "peak_bytes": peak,
                    "peak_kind": "device memory" if device.type == "cuda" else "optimizer state"})  # fmt: skip
        del model, opt
    return out


def _mib_text(text: str) -> str:
    try:
        ok = all(0 < float(v) <= 65536 for v in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected sizes in MiB like 64,256, got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument("--sizes", default="64,256", type=_mib_text,
                   help="comma-separated fp32 tensor sizes in MiB (default 64,256)")  # fmt: skip
    p.add_argument("--formats", default=list(FORMATS), type=cli_common.choice_list(FORMATS, "format"),
                   help=f"comma-separated formats from {', '.join(FORMATS)} (default: all)")  # fmt: skip
    p.add_argument("--width", type=cli_common.int_at_least(1), default=None,
                   help="MLP width (default 4096 on CUDA, 1024 on CPU)")  # fmt: skip
    p.add_argument("--layers", type=cli_common.int_at_least(1), default=None,
                   help="MLP layers (default 12 on CUDA, 16 on CPU)")  # fmt: skip
    p.add_argument("--batch", type=cli_common.int_at_least(1), default=64,
                   help="batch rows for the optimizer part (default 64)")  # fmt: skip
    p.add_argument("--steps", type=cli_common.int_at_least(1), default=5,
                   help="timed training steps per optimizer (default 5)")  # fmt: skip
    p.add_argument("--reps", type=cli_common.int_at_least(1), default=None,
                   help="timed repetitions per measurement (default 20 GPU, 5 CPU)")  # fmt: skip
    cli_common.add_json(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    env = environment(device)
    results: list[Result] = []
    for fmt in args.formats:
        for mib in (float(s) for s in args.sizes.split(",")):
            results += run_pack_case(fmt, mib, device, reps)
    print_tables(results, "torsh bench offload", env)
    width = args.width or (4096 if device.type == "cuda" else 1024)
    layers = args.layers or (12 if device.type == "cuda" else 16)
    opt_rows = run_optimizer(width, layers, args.batch, args.steps, device)
    t = cli_common.table(f"optimizer: MLP {layers} x [{width} x {width}], batch {args.batch}",
                   ["optimizer", "params", "train step", "optimizer step", "peak", "vs AdamW"],
                   text=("optimizer",))  # fmt: skip
    base = opt_rows[0]
    for r in opt_rows:
        t.add_row(r["optimizer"], f"{r['params'] / 1e6:.1f}M", f"{r['train_step_ms']:.1f} ms",
                  f"{r['optimizer_step_ms']:.1f} ms", f"{fmt_bytes(r['peak_bytes'])} ({r['peak_kind']})",
                  f"time {r['train_step_ms'] / base['train_step_ms']:.2f}x, "
                  f"memory {r['peak_bytes'] / max(base['peak_bytes'], 1):.2f}x")  # fmt: skip
    cli_common.console().print(t)
    config = {"sizes_mib": args.sizes, "formats": ",".join(args.formats), "reps": reps, "width": width,
              "layers": layers, "batch": args.batch, "steps": args.steps}  # fmt: skip
    emit(args, result_doc("offload", env, results, {**config, "optimizer": opt_rows}))
    return 0
