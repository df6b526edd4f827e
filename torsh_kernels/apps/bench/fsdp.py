"""FSDP2 step time and bytes on the wire: plain ``fully_shard`` against torsh's quantized comms.

One model (``--layers`` Linear layers of ``--width`` x ``--width``, ReLU between, each layer and the root
under ``fully_shard``; by default 8 x [2048 x 2048], 33.6 M parameters, 134 MB in fp32: comm-bound on a
slow link), the same batches, every case in turn on the same ranks:

- ``plain``: FSDP2's own all-gather and reduce-scatter (its default implementations, with a byte
  counter added around their one call);
- ``int8 weights``: :class:`~torsh_kernels.parallel.fsdp.QuantizedAllGather`;
- ``int4 grads`` (or ``--grads int8``): :class:`~torsh_kernels.parallel.fsdp.QuantizedReduceScatter`
  with error feedback;
- ``int8 weights + int4 grads``: both (:func:`~torsh_kernels.parallel.fsdp.apply_quantized_comm`).

``--fp8`` runs FP8 cases instead, against torchao's float8 all-gather (issue 43): ``plain``, ``fp8 weights``
(e4m3 codes with an fp32 scale per 128 elements, :func:`~torsh_kernels.parallel.fsdp.apply_quantized_comm`),
``fp8 weights + fp8 grads`` (the gradients too, with error feedback) and ``torchao float8 all-gather``
(``torchao.float8.convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True`` before
``fully_shard``: every Linear becomes a ``Float8Linear`` whose weight is cast to e4m3 with one scale per tensor
before FSDP2's all-gather; torchao also runs the matmuls in fp8, which torsh's cases do not). torchao is a
benchmark-only dependency (``pip install torchao``, the ``bench`` extra); where it is missing its case is
reported as not run, with why.

``--offload`` measures instead what the optimizer holds per rank under ZeRO-3 (the same model): AdamW on
FSDP2's shards (fp32 state, 8 bytes per parameter), the same with FSDP2's ``CPUOffloadPolicy``,
:class:`~torsh_kernels.parallel.OffloadedOptimizer` with bf16 and int8 state, and on a GPU with torchao
installed torchao's ``CPUOffloadOptimizer`` (written for one GPU: where it fails on FSDP2's shards, its
error is the result); for the host optimizers also the fp32 masters and gradient buffers they keep on
the host (8 bytes per parameter, the price of keeping the device free of them); the step time; the peak
of each rank's resident host memory above where the case started (``/proc/self/clear_refs``); and on a
GPU the peak device memory.

Per case: median step time (forward, backward with FSDP2's collectives, SGD step) of the slowest rank
over ``--steps`` steps after ``--warmup``, p20-p80, the bytes this rank sends per step by the ring formula
(``bytes_per_step``: ring all-gathers and reduce-scatters and our all-to-all, ``world_size - 1`` segments per
call, which is what NCCL's ring algorithms send), on the emulated hosts also what this rank's network interface
carried per step (``wire_sent_per_step``, the kernel's counters: gloo's own algorithms, whose reduce-scatter
sends more than a ring's, and the TCP/IP headers and ACKs), each as ratios to plain FSDP2, and the last loss.
``--repeat R`` interleaves the cases R times and reports medians with the spread of the runs. Launch like
``bench ddp``: local ranks on their own, one rank per process under torchrun or ``benchmarks/emulated_hosts.sh``.

python benchmarks/bench_fsdp.py [--width 2048] [--layers 8] [--batch 64] [--steps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

from ... import cli_common
from ...collectives import TorchCommunicator, init_from_env, run_local
from . import emit, environment, quantile
from .harness import run_spread as _spread

CASES = {
    "plain": (None, None),
    "int8 weights": ("int8", None),
    "{g} grads": (None, "{g}"),
    "int8 weights + {g} grads": ("int8", "{g}"),
}
TORCHAO_FP8 = "torchao float8 all-gather"
FP8_CASES = {"plain": (None, None), "fp8 weights": ("fp8", None), "fp8 weights + fp8 grads": ("fp8", "fp8"),
             TORCHAO_FP8: (None, None)}  # fmt: skip
"""``--fp8``: torsh's fp8 (e4m3) weights, then weights and gradients, against torchao's float8 all-gather."""


def _cases(grads: str, fp8: bool = False) -> list[tuple[str, str | None, str | None]]:
    if fp8:
        return [(k, w, g) for k, (w, g) in FP8_CASES.items()]
    return [(k.format(g=grads), w, g if g is None else g.format(g=grads)) for k, (w, g) in CASES.items()]


def torchao_float8() -> tuple[object | None, str]:
    """torchao's ``convert_to_float8_training`` and ``Float8LinearConfig``, or None and why not (torchao is a
    benchmark-only dependency: the ``bench`` extra)."""
    try:
        import logging

        logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA-only extensions fail to load on the CPU
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        return None, f"torchao is not installed ({e}); pip install torchao (the bench extra)"
    return (convert_to_float8_training, Float8LinearConfig), ""


def _model(cfg: dict, mesh, torchao_fp8: bool = False, **shard_kw) -> torch.nn.Module:
    """The comm-bound MLP, each linear and the whole under ``fully_shard(mesh=mesh, **shard_kw)``; with
    ``torchao_fp8`` its Linears made torchao ``Float8Linear`` s with the float8 all-gather first."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for i in range(cfg["layers"]):
        mods.append(torch.nn.Linear(cfg["width"], cfg["width"]))
        if i + 1 < cfg["layers"]:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    if torchao_fp8:
        convert, config = torchao_float8()[0]
        convert(model, config=config(enable_fsdp_float8_all_gather=True))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **shard_kw)
    fully_shard(model, mesh=mesh, **shard_kw)
    return model


def _case(comm: TorchCommunicator, mesh, cfg: dict, name: str, weights, grads) -> dict:
    from ...parallel.fsdp import apply_quantized_comm, count_traffic
    from .emulated import per_rank, wire_counter

    counter = wire_counter()
    model = _model(cfg, mesh, torchao_fp8=name == TORCHAO_FP8)
    comms = count_traffic(model, apply_quantized_comm(model, weights=weights, grads=grads))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 1e-3))
    g = torch.Generator().manual_seed(1 + comm.rank)
    target = torch.randn(cfg["width"], 16, generator=torch.Generator().manual_seed(7)) / cfg["width"] ** 0.5
    times, sent, loss = [], [], None
    for step in range(cfg["warmup"] + cfg["steps"]):
        x = torch.randn(cfg["batch"], cfg["width"], generator=g)
        before = sum(c.bytes_sent for c in comms)
        comm.barrier()
        if step == cfg["warmup"] and counter is not None:
            counter.start()
        t0 = time.perf_counter()
        out = model(x)
        loss = torch.nn.functional.mse_loss(out[:, :16], torch.tanh(x @ target))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
            sent.append(sum(c.bytes_sent for c in comms) - before)
    wire = None
    if counter is not None:  # after a barrier: the peer has received everything this rank sent
        comm.barrier()
        wire = [counter.read()["sent"] / cfg["steps"]]
    ranks = per_rank(comm, wire)
    by_rank = [r[0] for r in ranks] if ranks is not None else None
    with torch.no_grad():  # a held-out batch, the same on every rank and in every case
        x = torch.randn(256, cfg["width"], generator=torch.Generator().manual_seed(12345))
        held_out = torch.nn.functional.mse_loss(model(x)[:, :16], torch.tanh(x @ target)).item()
    t = torch.tensor(times, dtype=torch.float64)
    comm.all_reduce(t, "max")  # the slowest rank's time per step
    ts = t.tolist()
    return {"case": name, "setting": _setting(name, weights, grads), "weights": weights, "grads": grads,
            "step_ms": 1e3 * statistics.median(ts),
            "p20_ms": 1e3 * quantile(ts, 0.2), "p80_ms": 1e3 * quantile(ts, 0.8),
            "bytes_per_step": statistics.median(sent),
            "wire_sent_per_step": statistics.median(by_rank) if by_rank else None,
            "wire_sent_per_step_by_rank": by_rank, "loss": loss.item(), "held_out_loss": held_out,
            "steps_trained": cfg["warmup"] + cfg["steps"]}  # fmt: skip


def _setting(name: str, weights, grads) -> str:
    """The case's implementation and settings in words (the peers with their defaults but for what is named)."""
    base = ("FSDP2 fully_shard on each Linear and the root, its defaults (reshard_after_forward=True, fp32 "
            "parameters and reduction, no mixed precision)")  # fmt: skip
    if name == TORCHAO_FP8:
        return ("torchao convert_to_float8_training(config=Float8LinearConfig(enable_fsdp_float8_all_gather=True)) "
                "before fully_shard: e4m3 weights with one scale per tensor on the all-gather, fp8 matmuls; "
                + base)  # fmt: skip
    if weights is None and grads is None:
        return base + ", its own all-gather and reduce-scatter"
    return base + f"; torsh apply_quantized_comm(weights={weights!r}, grads={grads!r})"


OFFLOAD_CASES = ("AdamW", "AdamW + CPUOffloadPolicy", "OffloadedOptimizer bf16", "OffloadedOptimizer int8")


def _host_peak_reset() -> int | None:
    """Reset this process's peak resident set (Linux: ``/proc/self/clear_refs``) after handing freed
    memory back (``malloc_trim``); returns the resident bytes now, or None where that cannot be done."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return 1024 * int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


def _offload_case(comm: TorchCommunicator, mesh, cfg: dict, name: str) -> dict:
    """ZeRO-3 with the optimizer's memory counted: what each rank's optimizer holds (its state, and for the
    host optimizers the fp32 masters and gradient buffers they keep on the host), the step time, the peak
    of this rank's resident host memory above where the case started, and on a GPU the peak device
    memory. A peer that fails on FSDP2's shards reports its error instead."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from ...parallel import OffloadedOptimizer
    from .offload import TORCHAO, optimizer_state_bytes, torchao_offload

    rss0 = _host_peak_reset()
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if "CPUOffload" in name else {}
    model = _model(cfg, mesh, **kw)
    if name.startswith("OffloadedOptimizer"):
        opt = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, name.split()[-1], lr=1e-4)
    elif name == TORCHAO:
        try:  # written for one GPU; FSDP2's DTensor parameters may not suit it
            opt = torchao_offload(comm.device)[0](model.parameters(), torch.optim.AdamW, lr=1e-4)
        except Exception as e:  # a peer's failure is a result to report
            return {"case": name, "error": f"{type(e).__name__}: {e}"}
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = comm.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(comm.device)
    g = torch.Generator().manual_seed(1 + comm.rank)
    times = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(comm.device)
        comm.barrier()
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(comm.device)
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    copies = 0
    if isinstance(opt, OffloadedOptimizer):
        copies = sum(c.master_flat.nbytes + c.grad_flat.nbytes for c in opt._chunks)  # fp32, on the host
    elif hasattr(opt, "param_d2h_map"):  # torchao: an fp32 host copy of each parameter and of its gradient
        copies = sum(h.nbytes + h.grad.nbytes for h in opt.param_d2h_map.values())
    state = optimizer_state_bytes(opt)
    params = sum(p.to_local().numel() for p in model.parameters())
    t = torch.tensor(times, dtype=torch.float64)
    comm.all_reduce(t, "max")
    return {"case": name, "step_ms": 1e3 * statistics.median(t.tolist()), "state_bytes": state,
            "host_copy_bytes": copies, "state_bytes_per_parameter": state / params,
            "host_copy_bytes_per_parameter": copies / params,
            "peak_host_bytes": _proc_status("VmHWM") - rss0 if rss0 is not None else None,
            "peak_device_bytes": torch.cuda.max_memory_allocated(comm.device) if cuda else None}  # fmt: skip


def _offload_cases(comm: TorchCommunicator) -> tuple[list[str], dict[str, str]]:
    """The offload cases that can run here, and why the others cannot."""
    from .offload import TORCHAO, torchao_offload

    ao, why = torchao_offload(comm.device)
    return list(OFFLOAD_CASES) + ([TORCHAO] if ao is not None else []), ({} if ao is not None else {TORCHAO: why})


def _worker(comm: TorchCommunicator, cfg: dict) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(cfg["threads"])
    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    if cfg["offload"]:
        names, skipped = _offload_cases(comm)
        cases = [(n, lambda n=n: _offload_case(comm, mesh, cfg, n)) for n in names]
        cases[0][1]()  # once unrecorded: the first case would also count what any first run allocates for good
        rows = _repeat(comm, cfg, cases, lambda r: r.get("error") or f"{r['state_bytes_per_parameter']:6.2f} B/param")
        if comm.rank != 0:
            return None
        res = {"offload_rows": rows, "skipped": skipped, "world_size": comm.world_size, "backend": comm.backend}
        return _report_offload(res, cfg, names)
    names = _cases(cfg["grads"], cfg.get("fp8", False))
    skipped = {}
    if cfg.get("fp8") and torchao_float8()[0] is None:
        skipped[TORCHAO_FP8] = torchao_float8()[1]
        names = [c for c in names if c[0] != TORCHAO_FP8]
    cases = [(n, lambda n=n, w=w, gq=gq: _case(comm, mesh, cfg, n, w, gq)) for n, w, gq in names]
    rows = _repeat(comm, cfg, cases, lambda r: f"{r['bytes_per_step'] / 1e6:8.2f} MB/step  loss {r['loss']:.5f}")
    if comm.rank != 0:
        return None
    res = {"rows": rows, "world_size": comm.world_size, "backend": comm.backend}
    if cfg.get("fp8"):
        res["skipped"] = skipped
    return _report(res, cfg, [n for n, _, _ in names])


def _repeat(comm: TorchCommunicator, cfg: dict, cases: list, detail) -> list[dict]:
    """Every case ``cfg["repeat"]`` times, interleaved; rank 0 prints a progress line per case."""
    rows = []
    for rep in range(cfg["repeat"]):
        for name, run in cases:
            r = run()
            r["repeat"] = rep
            rows.append(r)
            if comm.rank == 0 and cfg["progress"]:
                ms = f"{r['step_ms']:9.1f} ms/step" if "step_ms" in r else ""
                print(f"  {name:<28} {ms} {detail(r)}", file=sys.stderr, flush=True)
    return rows


def _report(res: dict, cfg: dict, names: list[str]) -> dict:
    env = environment(torch.device("cuda" if res["backend"] == "nccl" else "cpu"))
    env["network"] = os.environ.get("TORSH_BENCH_NETWORK", "loopback" if res["backend"] == "gloo" else "local GPUs")
    rows = res["rows"]
    summary = []
    for name in names:
        rs = [r for r in rows if r["case"] == name]
        ratios_t, ratios_b, ratios_w = [], [], []
        for r in rs:
            base = next(b for b in rows if b["case"] == "plain" and b["repeat"] == r["repeat"])
            ratios_t.append(base["step_ms"] / r["step_ms"])
            ratios_b.append(r["bytes_per_step"] / base["bytes_per_step"])
            if r.get("wire_sent_per_step") and base.get("wire_sent_per_step"):
                ratios_w.append(r["wire_sent_per_step"] / base["wire_sent_per_step"])
        wires = [r["wire_sent_per_step"] for r in rs if r.get("wire_sent_per_step")]
        summary.append({"case": name, "step_ms": _spread([r["step_ms"] for r in rs]),
                        "bytes_per_step": _spread([r["bytes_per_step"] for r in rs]),
                        "speedup_vs_plain": _spread(ratios_t), "bytes_vs_plain": _spread(ratios_b),
                        "wire_sent_per_step": _spread(wires), "wire_vs_plain": _spread(ratios_w),
                        "loss": _spread([r["loss"] for r in rs]),
                        "held_out_loss": _spread([r["held_out_loss"] for r in rs])})  # fmt: skip
    res["summary"] = summary
    _print(res, env, cfg)
    return _write(res, env, cfg)


def _write(res: dict, env: dict, cfg: dict) -> dict:
    """The suite's JSON document (the parent process writes it where ``--json`` says)."""
    sys.stdout.flush()
    return {"suite": "fsdp", "environment": env, "config": cfg, **res}


def _report_offload(res: dict, cfg: dict, names: list[str]) -> dict:
    env = environment(torch.device("cuda" if res["backend"] == "nccl" else "cpu"))
    rows = res["offload_rows"]
    res["offload_summary"] = summary = []
    keys = ("state_bytes", "host_copy_bytes", "state_bytes_per_parameter", "host_copy_bytes_per_parameter")
    for name in names:
        rs = [r for r in rows if r["case"] == name]
        if "error" in rs[0]:
            summary.append({"case": name, "error": rs[0]["error"]})
            continue
        hosts = [r["peak_host_bytes"] for r in rs if r["peak_host_bytes"] is not None]
        devs = [r["peak_device_bytes"] for r in rs if r["peak_device_bytes"] is not None]
        summary.append({"case": name, "step_ms": _spread([r["step_ms"] for r in rs]), **{k: rs[0][k] for k in keys},
                        "peak_host_bytes": _spread(hosts) if hosts else None,
                        "peak_device_bytes": _spread(devs) if devs else None})  # fmt: skip
    t = cli_common.table((f"ZeRO-3 optimizer memory, {res['world_size']} ranks ({res['backend']}), {cfg['layers']} x "
                    f"[{cfg['width']} x {cfg['width']}] linears under fully_shard; per rank; medians over "
                    f"{cfg['repeat']} run(s)"),
                   ["case", "step (ms)", "optimizer state (MB)", "state B/param", "fp32 host copies B/param",
                    "peak host above start (MB)", "peak device (MB)"], text=("case",))  # fmt: skip

    def mb(d: dict | None) -> str:
        return "-" if d is None else f"{d['median'] / 1e6:.1f}"

    for s in summary:
        if "error" in s:
            t.add_row(f"{s['case']}: failed: {s['error'][:100]}", *["-"] * 6)
            continue
        st = s["step_ms"]
        t.add_row(s["case"], f"{st['median']:.1f} [{st['min']:.1f}-{st['max']:.1f}]",
                  f"{s['state_bytes'] / 1e6:.2f}", f"{s['state_bytes_per_parameter']:.2f}",
                  f"{s['host_copy_bytes_per_parameter']:.2f}", mb(s["peak_host_bytes"]),
                  mb(s["peak_device_bytes"]))  # fmt: skip
    for name, why in res["skipped"].items():
        t.add_row(f"{name}: not run: {why}", *["-"] * 6)
    cli_common.console().print(t)
    return _write(res, env, cfg)


def _print(res: dict, env: dict, cfg: dict) -> None:
    params = cfg["layers"] * (cfg["width"] ** 2 + cfg["width"])
    t = cli_common.table((f"FSDP2 step time, {res['world_size']} ranks ({res['backend']}, {env.get('network')}), "
                    f"{cfg['layers']} x [{cfg['width']} x {cfg['width']}] linears ({params / 1e6:.1f}M parameters, "
                    f"{4 * params / 1e6:.0f} MB of fp32 gradients), "
                    f"batch {cfg['batch']}/rank; medians over {cfg['repeat']} run(s) [min-max]"),
                   ["case", "step (ms)", "speedup vs plain", "MB/step, ring formula", "vs plain",
                    "MB/step, interface", "vs plain", f"loss after {cfg['warmup'] + cfg['steps']} steps",
                    "held-out loss"], text=("case",))  # fmt: skip

    def f(d, digits=1, unit=""):
        if d["n"] == 1:
            return f"{d['median']:.{digits}f}{unit}"
        return f"{d['median']:.{digits}f}{unit} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"

    for s in res["summary"]:
        mb = {k: v / 1e6 if k != "n" else v for k, v in s["bytes_per_step"].items()}
        w = s.get("wire_sent_per_step")
        wmb = "-" if w is None else f({k: v / 1e6 if k != "n" else v for k, v in w.items()}, 2)
        wvs = "-" if s.get("wire_vs_plain") is None else f(s["wire_vs_plain"], 3, "x")
        t.add_row(s["case"], f(s["step_ms"]), f(s["speedup_vs_plain"], 2, "x"), f(mb, 2),
                  f(s["bytes_vs_plain"], 3, "x"), wmb, wvs, f"{s['loss']['median']:.6f}",
                  f"{s['held_out_loss']['median']:.6f}")  # fmt: skip
    for name, why in res.get("skipped", {}).items():
        t.add_row(f"{name}: not run: {why}", *["-"] * 8)
    cli_common.console().print(t)
    print("cases and their settings:")
    for r in res["rows"]:
        if r.get("repeat", 0) == 0 and r.get("setting"):
            print(f"  {r['case']}: {r['setting']}")
    print("ring formula: what NCCL's ring all-gather and reduce-scatter send per rank, (world_size - 1) segments a "
          "call (and torsh's all-to-all); interface: what this rank's network interface carried, from the kernel's "
          "counters (emulated hosts only): gloo's own algorithms (its reduce-scatter sends more than a ring's), the "
          "TCP/IP headers and ACKs")  # fmt: skip


def _learning_rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive learning rate, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    at_least_1 = cli_common.int_at_least(1)
    p.add_argument("--world-size", type=at_least_1, default=2, help="local ranks when not under torchrun")
    p.add_argument("--width", type=at_least_1, default=2048, help="width of each square Linear layer")
    p.add_argument("--layers", type=at_least_1, default=8, help="Linear layers, each under its own fully_shard")
    p.add_argument("--batch", type=at_least_1, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=at_least_1, default=5, help="timed steps per case")
    p.add_argument("--warmup", type=cli_common.int_at_least(0), default=2, help="untimed steps first")
    p.add_argument("--grads", choices=("int8", "int4"), default="int4", help="gradient format of the grads cases")
    p.add_argument("--repeat", type=at_least_1, default=1, help="run every case this many times, interleaved")
    p.add_argument("--threads", type=at_least_1, default=1, help="torch threads per rank")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="instead: fp8 weights (and grads) against torchao's float8 all-gather (torchao installed)",
    )
    p.add_argument("--lr", type=_learning_rate, default=1e-3, help="SGD learning rate (1e-3)")
    p.add_argument("--offload", action="store_true",
                   help="instead: the optimizer's memory under ZeRO-3, AdamW (with and without FSDP2's "
                   "CPUOffloadPolicy) against OffloadedOptimizer with bf16 and int8 state")  # fmt: skip
    cli_common.add_json(p)


def run(args: argparse.Namespace) -> int:
    cfg = {"width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "grads": args.grads, "repeat": args.repeat, "threads": args.threads,
           "progress": True, "offload": args.offload, "fp8": args.fp8, "lr": args.lr}  # fmt: skip
    if "RANK" in os.environ:
        comm = init_from_env(timeout=600)
        doc = _worker(comm, cfg)
        if doc is not None:
            emit(args, doc)
        sys.stdout.flush()
        return 0
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "gloo"
    doc = run_local(_worker, args.world_size, cfg, backend=backend, threads=args.threads, timeout=3600,
                    op_timeout=600)[0]  # fmt: skip
    emit(args, doc)
    return 0
