"""Collectives and compressed all-reduce over real processes, with the cost model's predictions.

Per transport (``--transports``: torch.distributed, NCCL through CuPy, RDMA through pyverbs; those this
machine cannot run are listed with the reason), collective and size: nccl-tests columns (size in
bytes, element count, time, algbw = size / time, busbw = algbw * the collective's bus factor: 2(n-1)/n
for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast), the time of
torch's over this transport's ("vs torch", same op and size, same run), and for torch.distributed the
alpha-beta model's prediction from a ping-pong probe of the link made at the start of the same run.
Per compressor and size: ``compressed_all_reduce`` end to end (compression, traffic, decompression),
its speedup over the uncompressed all-reduce of the same buffer, and the bytes each rank sends: the payload
(the compressor's formula) and, on the emulated hosts, what each rank's network interface carried per call
(the kernel's counters, headers and gloo's own messages included; the same column for the collectives).

Launch: on its own it spawns ``--world-size`` local ranks (gloo; NCCL where there are enough GPUs).
Under torchrun, or the two-host helper ``benchmarks/emulated_hosts.sh`` (``RANK``/``WORLD_SIZE`` set),
each process is one rank. Times are the slowest rank's median over ``--reps`` repetitions, each started
together after a barrier.

python benchmarks/bench_collectives.py [--world-size 2] [--sizes 1K,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ... import cli_common
from ... import compression as cz
from ...checks import env_int
from ...collectives import Link, TorchCommunicator, init_from_env, make_communicator, probe, run_local
from ...collectives.cost_model import all_gather_time, all_reduce_time, all_to_all_time
from ...compression import compressed_all_reduce, compressed_time
from ...errors import TransportUnavailableError
from . import emit, environment, fmt_bytes

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
TRANSPORTS = ("torch", "cupy-nccl", "rdma")
COMPRESSORS = {
    "none": lambda: None,
    "fp16": lambda: cz.FP16(),
    "topk": lambda: cz.TopK(0.01),
    "int8": lambda: cz.Quantize(8),
    "int4": lambda: cz.Quantize(4),
    "sign": lambda: cz.Sign(),
    "powersgd": lambda: cz.PowerSGD(4),
}


def parse_size(s: str) -> int:
    """'64K', '1M', '4096' -> bytes (a multiple of 4, in [4 B, 8 GiB])."""
    s = s.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        v = float(s[:-1] if s[-1:] in "KMG" else s) * mult
    except ValueError:
        raise ValueError(f"cannot read size {s!r}; write bytes with an optional K, M or G suffix, e.g. 64K") from None
    if not v >= 4 or v > (8 << 30):
        raise ValueError(f"size {s!r} out of range [4 B, 8 GiB]")
    return int(v) // 4 * 4


def _bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def _timed(comm, fn, reps: int, warmup: int) -> tuple[float, float | None]:
    """(the slowest rank's median seconds per call, the bytes each rank's own network interface sent per call,
    the mean over the ranks, on emulated hosts; None elsewhere: :func:`~.emulated.wire_counter`)."""
    from .emulated import per_rank, wire_counter

    counter = wire_counter()
    times = []
    for i in range(warmup + reps):
        comm.barrier()
        if i == warmup and counter is not None:
            counter.start()
        if comm.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if comm.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=comm.device)
    comm.all_reduce(t, "max")
    sent = None
    if counter is not None:  # after a barrier: the peers have received all this rank sent
        comm.barrier()
        sent = [counter.read()["sent"] / reps]
    ranks = per_rank(comm, sent)
    return float(t.item()), (statistics.fmean(r[0] for r in ranks) if ranks is not None else None)


def _predict(op: str, nbytes: int, p: int, link: Link) -> float:
    if op == "all_reduce":
        return all_reduce_time(nbytes, p, link, "ring")
    if op == "all_gather":  # size = the gathered output; each rank contributes size / p
        return all_gather_time(nbytes / p, p, link)
    if op == "reduce_scatter":  # size = the input; ring reduce-scatter: (p-1) steps of size / p
        return all_gather_time(nbytes / p, p, link)
    if op == "all_to_all":
        return all_to_all_time(nbytes, p, link)
    # broadcast: gloo sends the whole buffer from the root to each of the p - 1 others
    return (p - 1) * link.time(nbytes)


def _transports(comm: TorchCommunicator, names: list[str]) -> tuple[dict, dict]:
    """(name -> communicator, name -> why it cannot run here) for the transports asked for."""
    comms, skipped = {}, {}
    for name in names:
        if name == "torch":
            comms[name] = comm
            continue
        try:
            comms[name] = make_communicator(name, timeout=600)
        except TransportUnavailableError as e:
            skipped[name] = f"{e.reason} (to enable: {e.fix})" if e.fix else e.reason
    return comms, skipped


def _op_case(c, op: str, size: int):
    """(element count, bytes, the timed call) of one collective of about ``size`` bytes over ``c``."""
    p, dev = c.world_size, c.device
    count = size // 4
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = count // p * p
    if count == 0:
        return 0, 0, None
    x = torch.randn(count, device=dev)
    if op == "all_reduce":
        fn = lambda: c.all_reduce(x)
    elif op == "all_gather":
        src = x[: count // p].clone()
        fn = lambda: c.all_gather(x, src)
    elif op == "reduce_scatter":
        out = torch.empty(count // p, device=dev)
        fn = lambda: c.reduce_scatter(out, x)
    elif op == "broadcast":
        fn = lambda: c.broadcast(x, 0)
    else:
        out = torch.empty_like(x)
        fn = lambda: c.all_to_all(out, x)
    return count, 4 * count, fn


def _worker(comm: TorchCommunicator, cfg: dict) -> dict:
    p, dev = comm.world_size, comm.device
    reps, warmup = cfg["reps"], cfg["warmup"]
    link = probe(comm, large_bytes=cfg["probe_bytes"], repeats=5) if p > 1 else None
    comms, skipped = _transports(comm, cfg.get("transports", ["torch"]))
    rows, crow = [], []
    for tname, c in comms.items():
        for op in cfg["ops"]:
            for size in cfg["sizes"]:
                count, nbytes, fn = _op_case(c, op, size)
                if fn is None:
                    continue
                t, sent = _timed(c, fn, reps, warmup)
                algbw = nbytes / t
                pred = _predict(op, nbytes, p, link) if tname == "torch" and link is not None else None
                rows.append({"transport": tname, "backend": c.backend, "op": op, "size": nbytes, "count": count,
                             "type": "float32", "time_us": t * 1e6, "algbw_GBps": algbw / 1e9,
                             "busbw_GBps": algbw * _bus_factor(op, p) / 1e9,
                             "predicted_us": pred * 1e6 if pred is not None else None,
                             "measured_over_predicted": t / pred if pred else None,
                             "interface_sent_per_rank": sent})  # fmt: skip
    torch_t = {(r["op"], r["size"]): r["time_us"] for r in rows if r["transport"] == "torch"}
    for r in rows:
        ref = torch_t.get((r["op"], r["size"]))
        r["torch_over_this"] = ref / r["time_us"] if ref else None
    for name, c in comms.items():
        if name != "torch" and hasattr(c, "close"):
            c.close()
    for size in cfg["compress_sizes"]:
        count = size // 4
        base = None
        shape = _matrix(count)
        g = torch.Generator().manual_seed(comm.rank)
        src = torch.randn(shape, generator=g).to(dev)
        for name in cfg["compressors"]:
            c = COMPRESSORS[name]()
            state = c.new_state(seed=comm.rank) if c is not None else None
            x = src.clone()

            def fn(x=x, c=c, state=state, src=src):
                x.copy_(src)
                compressed_all_reduce(x, comm, c, state)

            t, sent = _timed(comm, fn, reps, warmup)
            if name == "none":
                base = t
            wire = (c or cz.NoCompression()).payload_nbytes(shape)
            algo, pred = compressed_time(c, shape, p, link) if link is not None else ("-", float("nan"))
            crow.append({"compressor": name, "size": 4 * count, "shape": list(shape), "time_us": t * 1e6,
                         "speedup_vs_none": (base / t) if base else None, "wire_bytes_per_rank": wire,
                         "interface_sent_per_rank": sent, "algorithm": algo,
                         "predicted_comm_us": pred * 1e6})  # fmt: skip
    return {"link": {"latency_us": link.latency * 1e6, "bandwidth_GBps": link.bandwidth / 1e9} if link else None,
            "collectives": rows, "compressed": crow, "world_size": p, "backend": comm.backend,
            "transports_skipped": skipped}  # fmt: skip


def _matrix(count: int) -> tuple[int, ...]:
    """A 2-D gradient-like shape with ``count`` elements (rows a power of two), as PowerSGD sees layers."""
    rows = 1 << max(0, (int(count**0.5)).bit_length() - 1)
    while count % rows:
        rows //= 2
    return (rows, count // rows)


def print_report(res: dict, env: dict) -> None:
    from rich.markup import escape

    con = cli_common.console()
    link = res["link"]
    probed = (
        f"probed link: latency {link['latency_us']:.1f} us, bandwidth {link['bandwidth_GBps'] * 8:.3g} Gbit/s "
        f"({link['bandwidth_GBps'] * 1e3:.4g} MB/s)" if link else "no link to probe (one rank)"
    )  # fmt: skip
    con.print(f"[bold]collectives[/] on {env['device']}, {res['world_size']} ranks, {res['backend']}; {probed}")
    for name, why in res.get("transports_skipped", {}).items():
        con.print(f"transport {name}: not run here: {escape(why)}")
    if res["collectives"]:
        t = cli_common.table("collectives (nccl-tests columns; vs torch: torch.distributed's time over this one's; "
                       "predicted: alpha-beta model from the probed link)",
                       ["transport", "op", "size", "count", "time", "algbw GB/s", "busbw GB/s", "vs torch", "predicted",
                        "meas/pred", "sent/rank, interface"], text=("transport", "op"),
                       title_justify="center")  # fmt: skip
        for r in res["collectives"]:
            pred, ratio, vs = r["predicted_us"], r["measured_over_predicted"], r.get("torch_over_this")
            sent = r.get("interface_sent_per_rank")
            t.add_row(r.get("transport", "torch"), r["op"], fmt_bytes(r["size"]), f"{r['count']:,}",
                      _fmt_us(r["time_us"]), f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
                      f"{vs:.2f}x" if vs is not None and r.get("transport") != "torch" else "-",
                      _fmt_us(pred) if pred is not None else "-", f"{ratio:.2f}" if ratio else "-",
                      "-" if sent is None else fmt_bytes(sent))  # fmt: skip
        con.print(t)
    if res["compressed"]:
        t = cli_common.table("compressed_all_reduce (end to end: compress + traffic + decompress)",
                       ["compressor", "size", "time", "vs none", "payload/rank", "sent/rank, interface", "scheme",
                        "predicted comm"],
                       text=("compressor", "scheme"), title_justify="center")  # fmt: skip
        for r in res["compressed"]:
            sp = r["speedup_vs_none"]
            t.add_row(r["compressor"], fmt_bytes(r["size"]), _fmt_us(r["time_us"]),
                      f"{sp:.2f}x" if sp else "-", fmt_bytes(r["wire_bytes_per_rank"]),
                      "-" if r.get("interface_sent_per_rank") is None else fmt_bytes(r["interface_sent_per_rank"]),
                      r["algorithm"],
                      _fmt_us(r["predicted_comm_us"]))  # fmt: skip
        con.print(t)


def _fmt_us(us: float) -> str:
    return f"{us:.1f} us" if us < 1000 else (f"{us / 1e3:.2f} ms" if us < 1e6 else f"{us / 1e6:.3f} s")


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=cli_common.int_at_least(1), default=2,
                   help="local ranks to spawn (ignored under torchrun)")  # fmt: skip
    p.add_argument("--transports", default=list(TRANSPORTS), type=cli_common.choice_list(TRANSPORTS, "transport"),
                   help=f"transports to time, side by side (default: {','.join(TRANSPORTS)}; those that cannot run "
                   "here are listed with the reason)")  # fmt: skip
    p.add_argument("--sizes", default="4K,64K,1M,8M,32M", type=_sizes,
                   help="collective sizes (bytes; K/M/G suffixes)")  # fmt: skip
    p.add_argument("--ops", default=list(OPS), type=cli_common.choice_list(OPS, "op"),
                   help=f"collectives to time (default: {','.join(OPS)})")  # fmt: skip
    p.add_argument(
        "--compress-sizes", default="1M,32M", type=_sizes, help="buffer sizes of the compressed all-reduce cases"
    )
    p.add_argument("--compressors", default=list(COMPRESSORS), type=cli_common.choice_list(COMPRESSORS, "compressor"),
                   help=f"compressors ('none' is the baseline; default: {','.join(COMPRESSORS)})")  # fmt: skip
    p.add_argument("--reps", type=cli_common.int_at_least(1), default=5, help="timed repetitions (default 5)")
    p.add_argument("--warmup", type=cli_common.int_at_least(0), default=2, help="untimed repetitions first (default 2)")
    p.add_argument("--probe-bytes", default="8M", type=_size, help="message size of the bandwidth probe (default 8M)")
    cli_common.add_json(p)


def run(args: argparse.Namespace) -> int:
    sizes, csizes, probe_bytes = args.sizes, args.compress_sizes, args.probe_bytes
    ops, comps, trs = list(args.ops), list(args.compressors), list(args.transports)
    if "torch" not in trs:
        trs.insert(0, "torch")  # the reference every other transport is compared with
    if csizes and comps and comps[0] != "none":
        comps = ["none", *[c for c in comps if c != "none"]]  # the baseline first
    cfg = {"sizes": sizes, "ops": ops, "compress_sizes": csizes, "compressors": comps, "reps": args.reps,
           "warmup": args.warmup, "probe_bytes": probe_bytes, "transports": trs}  # fmt: skip
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / emulated hosts: this process is one rank
        torch.set_num_threads(env_int("TORSH_BENCH_THREADS", 1, "torsh bench collectives", lo=1, hi=4096))
        comm = init_from_env(timeout=600)
        res = _worker(comm, cfg)
        if comm.rank != 0:
            return 0
    else:
        backend = "nccl" if torch.cuda.device_count() >= args.world_size else "gloo"
        res = run_local(_worker, args.world_size, cfg, backend=backend, op_timeout=600, timeout=3600)[0]
    dev = torch.device("cuda" if res["backend"] == "nccl" else "cpu")
    env = environment(dev)
    env["network"] = os.environ.get("TORSH_BENCH_NETWORK", "local processes (loopback)")
    print_report(res, env)
    emit(args, {"suite": "collectives", **env, "config": cfg, **res})
    return 0
