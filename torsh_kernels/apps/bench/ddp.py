"""DDP step time with gradient compression: PyTorch's own hooks against torsh's ``compression_hook``.

One model (an MLP: ``--in-dim`` -> ``--layers`` hidden layers of ``--width`` -> 10; by default
64-2048-2048-2048-10: 8.5M parameters, 34.2 MB of fp32 gradients), the same batches, one run, every case
in turn on the same ranks:

- ``no hook``: DDP's own bucketed all-reduce (25 MB buckets);
- ``torch fp16_compress_hook``;
- ``torch powerSGD_hook`` at ``--rank`` with one bucket (``bucket_cap_mb`` above the model size): on gloo
  it fails with several buckets, which the last case shows;
- ``torsh auto``: ``compressor="auto"`` choosing among the other compressors of the run at the end of the warm-up,
  judged by its own steps against the best fixed case of the same run (no hook or one of ours): its steady step,
  the whole run with its warm-up and decision, and a run of ``AUTO_HORIZON`` steps; with its decision's seconds;
- ``torsh <compressor>`` for every compressor, through ``compression_hook`` with DDP's default 25 MB
  buckets (PowerSGD at the same rank and start iteration as PyTorch's), and ``torsh powersgd-1bucket``, ours
  with one bucket as PyTorch's (the like-for-like PowerSGD comparison);
- ``torch powerSGD_hook`` with the default 25 MB buckets, last (its error is reported, not raised).

Every row names its implementation and settings (``setting``); the peers run with PyTorch's defaults but for
what is named. Bytes: ``bytes_per_step`` is the payload each rank hands the collectives (the hook's output, or
the gradients); on the emulated hosts ``wire_sent_per_step`` is what each rank's own network interface carried
per timed step, read from the kernel's counters (:func:`~torsh_kernels.apps.bench.emulated.wire_counter`), with
the headers, ACKs and gloo's own messages.

``--repeat R`` runs that list R times, interleaved, and reports each case's median over the runs with
the spread of the runs' medians.

``--buckets 1,4,16,64`` measures instead the host cost of a bucket: a deeper MLP of the same size
(``--sweep-layers`` 64 layers of ``--sweep-width`` 362, 8.5 M parameters, 34 MB, so there are enough
parameters to split) under DDP with ``bucket_cap_mb`` set so that it splits into about that many buckets,
for PyTorch's ``fp16_compress_hook`` and ours with fp16, bf16, top-k and PowerSGD (``--sweep``), side by
side. Per case and bucket count: the step time and the host time spent inside the hook per step (this
thread's CPU time, ``time.thread_time``: waiting for a collective is not counted, the decode that runs in
the collective's completion callback on gloo's thread is not either) and per bucket, and the marginal
host cost of one more bucket, ``(hook(N) - hook(1)) / (N - 1)``.

``--signatures`` measures instead what the signature exchange costs (``check_signatures``, on by default:
one all-gather per new bucket layout, :mod:`torsh_kernels.collectives.agreement`): every compressor of
``--compressors`` through ``compression_hook`` with the exchange on and off, side by side in the same run,
the two orders alternating over ``--repeat`` runs. Per case: the first two steps (where the exchanges
happen: DDP's first bucket layout, then its rebuilt one), the exchanges' count and seconds, and the
steady-state step time; per compressor the ratios on / off with their spread over the runs.

Per case: median step time (forward, backward with the hook, optimizer step) of the slowest rank over
``--steps`` steps after warm-up, p20-p80, bytes each rank sends per step where known, and the speedup over
no hook. Launch like ``bench collectives``: local ranks on its own, one rank per process under torchrun
or ``benchmarks/emulated_hosts.sh``.

python benchmarks/bench_ddp.py [--width 2048] [--layers 3] [--rank 4] [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

from ... import cli_common
from ... import compression as cz
from ...collectives import TorchCommunicator, init_from_env, run_local
from ...errors import RankFailedError
from . import emit, environment, quantile
from .ddp_report import auto_summary, print_report, print_signatures, print_sweep, signature_summary, summaries

OURS = {
    "none": lambda r: None,
    "fp16": lambda r: cz.FP16(),
    "bf16": lambda r: cz.BF16(),
    "topk": lambda r: cz.TopK(0.01),
    "int8": lambda r: cz.Quantize(8),
    "int4": lambda r: cz.Quantize(4),
    "sign": lambda r: cz.Sign(),
    "powersgd": lambda r: cz.PowerSGD(r),
    "auto": lambda r: "auto",
}


def _auto_candidates(rank: int, names) -> tuple:
    """What ``compressor="auto"`` chooses among here: every other compressor this run measures (all of
    them when it measures auto alone)."""
    names = [n for n in names if n != "auto"] or [n for n in OURS if n != "auto"]
    return tuple(OURS[n](rank) for n in names)


def _mlp(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    dims = [cfg["in_dim"]] + [cfg["width"]] * cfg["layers"]
    mods: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(dims):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(dims[-1], 10))
    return torch.nn.Sequential(*mods)


def _case(comm: TorchCommunicator, cfg: dict, kind: str, name: str, *, buckets: int | None = None) -> dict:
    dev = comm.device
    net = _mlp(cfg if buckets is None else {**cfg, "layers": cfg["sweep_layers"], "width": cfg["sweep_width"]}).to(dev)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    one_bucket = name == "powersgd-1bucket" or buckets == 1
    cap = 2 * grad_bytes / 2**20 + 1 if one_bucket else 25.0
    if buckets is not None and buckets > 1:
        cap = grad_bytes / buckets / 2**20 * 0.999
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap,
                                                    device_ids=[dev.index] if dev.type == "cuda" else None)  # fmt: skip
    hook_cpu = [0.0, 0]
    if buckets is not None:  # the sweep: its hook, timed (see _sweep_case)
        hstate, timed, hook_cpu = cfg["_hook"]
        ddp.register_comm_hook(hstate, timed)
        state = None
    else:
        state = _register_hook(ddp, cfg, kind, name)
    times, pre, error, counted = _run_steps(comm, cfg, ddp, net, hook_cpu)
    # the slowest rank's time per step (and its steps before the timed ones: the warm-up, where auto decides,
    # and its seconds in signature exchanges)
    sig_s = state.stats.signature_s if state is not None else 0.0
    n = len(times) or 1
    t = torch.tensor((times or [float("nan")]) + pre + [sig_s], dtype=torch.float64)
    if error is None:
        comm.all_reduce(t, "max")
    t, pre, sig_s = t[:n], t[n:-1].tolist(), float(t[-1])
    first = pre[:2]
    # the payload each rank hands the collectives per step, and what the formula says it sends (torsh's traffic
    # counters: every collective of the hook, each by its algorithm; DDP's ring all-reduce: 2 (n - 1) / n of it)
    wire = formula = None
    if state is not None and state.stats.per_iteration:
        wire = state.stats.per_iteration[-1]["bytes_after"]
        formula = state.stats.per_iteration[-1].get("wire_bytes") or None
    elif kind == "none" or (kind == "torch" and name == "fp16"):
        wire = grad_bytes if kind == "none" else grad_bytes // 2
        formula = round(wire * 2 * (comm.world_size - 1) / comm.world_size)
    measured = _wire_per_step(comm, counted, len(times), error)
    ts = t.tolist()
    if buckets is not None:
        nb = hook_cpu[1] / cfg["steps"]
        return {
            "case": "torch fp16" if kind == "torch" else f"torsh {name}",
            "buckets_asked": buckets,
            "buckets": round(nb),
            **_step_ms(ts, error),
            "hook_ms_per_step": 1e3 * hook_cpu[0] / cfg["steps"],
            "hook_ms_per_bucket": 1e3 * hook_cpu[0] / cfg["steps"] / nb if nb else None,
            "gradient_bytes": grad_bytes,
            "error": error,
        }
    if "check" in cfg:
        return {
            "case": f"torsh {name}",
            "check": cfg["check"],
            **_step_ms(ts, error),
            "first_steps_ms": [1e3 * v for v in first],
            "signature_checks": state.stats.signature_checks,
            "signature_ms": 1e3 * sig_s,
            "gradient_bytes": grad_bytes,
            "error": error,
        }
    return {
        "case": "no hook" if kind == "none" else f"{kind} {name}",
        "setting": _setting(cfg, kind, name),
        "chose": state.stats.auto["choice"] if state is not None and state.stats.auto else None,
        "auto": state.stats.auto if state is not None and comm.rank == 0 else None,
        "buckets": "1" if one_bucket else "25 MB",
        **_step_ms(ts, error),
        "steps_before_ms": [1e3 * v for v in pre] if error is None else None,
        "bytes_per_step": wire,
        "wire_formula_per_step": formula,
        **measured,
        "gradient_bytes": grad_bytes,
        "parameters": sum(p.numel() for p in net.parameters()),
        "error": error,
    }


def _setting(cfg: dict, kind: str, name: str) -> str:
    """The case's implementation and the settings it runs with, in words (the peers' are PyTorch's defaults
    but for what is named)."""
    buckets = "one bucket (bucket_cap_mb above the model)" if name == "powersgd-1bucket" else "DDP's 25 MB buckets"
    if kind == "none":
        return "DDP's own all-reduce (no comm hook), DDP's default 25 MB buckets"
    if kind == "torch" and name == "fp16":
        return "PyTorch default_hooks.fp16_compress_hook, DDP's default 25 MB buckets"
    if kind == "torch":
        return (f"PyTorch powerSGD_hook, PowerSGDState(matrix_approximation_rank={cfg['rank']}, "
                f"start_powerSGD_iter={cfg['start_iter']}, min_compression_rate=2; use_error_feedback, warm_start "
                f"and orthogonalization_epsilon at their defaults), {buckets}")  # fmt: skip
    what = "compressor='auto' among the run's other compressors" if name == "auto" else f"compressor {name}"
    what = what.replace("-1bucket", "")
    return f"torsh compression_hook, {what}, start_iter={cfg['start_iter']}, {buckets}"


def _wire_per_step(comm: TorchCommunicator, counted: dict | None, steps: int, error: str | None) -> dict:
    """What each rank's network interface carried per timed step, from the kernel's counters (emulated hosts:
    :func:`~torsh_kernels.apps.bench.emulated.wire_counter`); None fields on loopback, where no interface is
    one rank's own."""
    from .emulated import per_rank

    out = {"wire_sent_per_step": None, "wire_received_per_step": None, "wire_sent_per_step_by_rank": None}
    if error is not None:
        return out
    ranks = per_rank(comm, None if counted is None else [counted["sent"] / steps, counted["received"] / steps])
    if ranks is None:
        return out
    sent, received = [r[0] for r in ranks], [r[1] for r in ranks]
    return {"wire_sent_per_step": statistics.median(sent), "wire_received_per_step": statistics.median(received),
            "wire_sent_per_step_by_rank": sent}  # fmt: skip


def _register_hook(ddp, cfg: dict, kind: str, name: str):
    """The case's comm hook on ``ddp``: PyTorch's fp16 or PowerSGD, or ours; returns ours's state (else None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from ...parallel import CompressionHookState, compression_hook

    start = cfg["start_iter"]
    if kind == "torch" and name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch" and name.startswith("powersgd"):
        ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg["rank"],
                                         start_powerSGD_iter=start, min_compression_rate=2)  # fmt: skip
        ddp.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
    elif kind == "torsh":
        extra = {"auto_candidates": _auto_candidates(cfg["rank"], cfg["compressors"])} if name == "auto" else {}
        if "check" in cfg:
            extra["check_signatures"] = cfg["check"]
        make = OURS["powersgd" if name == "powersgd-1bucket" else name]
        state = CompressionHookState(compressor=make(cfg["rank"]), start_iter=start, **extra)
        ddp.register_comm_hook(state, compression_hook)
        return state
    return None


def _run_steps(comm: TorchCommunicator, cfg: dict, ddp, net: torch.nn.Module,
               hook_cpu: list) -> tuple[list[float], list[float], str | None, dict | None]:  # fmt: skip
    """(seconds of each timed step, of each step before them, the error that ended the run or None, what this
    rank's interface carried over the timed steps or None): the warm-up, then ``cfg["steps"]`` timed steps; the
    sweep's hook timer and the interface counter restart where the timed steps begin."""
    from .emulated import wire_counter

    dev = comm.device
    counter = wire_counter()
    start = cfg["start_iter"]
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(cfg["batch"], cfg["in_dim"], generator=g).to(dev)
    y = torch.randint(0, 10, (cfg["batch"],), generator=g).to(dev)
    times = []
    pre = []  # the steps before the timed ones: the first two agree on the bucket layouts, auto decides at start
    try:
        for step in range(start + 2 + cfg["steps"]):
            comm.barrier()
            if step == start + 2:
                hook_cpu[:] = [0.0, 0]
                if counter is not None:
                    counter.start()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if step >= start + 2:
                times.append(time.perf_counter() - t0)
            else:
                pre.append(time.perf_counter() - t0)
        counted = None
        if counter is not None:  # after a barrier: the peer has received everything this rank sent
            comm.barrier()
            counted = counter.read()
    except Exception as e:  # PyTorch's PowerSGD hook on gloo with several buckets
        msg = str(e)
        while "when running the callback: " in msg:  # futures wrap the cause once per callback
            msg = msg.split("when running the callback: ", 1)[1]
        return times, pre, f"{type(e).__name__}: {msg.splitlines()[0][:160]}", None
    return times, pre, None, counted


def _step_ms(ts: list[float], error: str | None) -> dict:
    """The median step time and its p20 and p80, in milliseconds (None after an error)."""
    return {
        "step_ms": 1e3 * statistics.median(ts) if error is None else None,
        "p20_ms": 1e3 * quantile(ts, 0.2) if error is None else None,
        "p80_ms": 1e3 * quantile(ts, 0.8) if error is None else None,
    }


def _bucket_sweep(comm: TorchCommunicator, cfg: dict) -> dict | None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ...parallel import CompressionHookState, compression_hook

    hooks = {("torch", "fp16"): (None, default_hooks.fp16_compress_hook)}
    rows: list[dict] = []
    for rep in range(cfg["repeat"]):
        for nb in cfg["buckets"]:
            for kind, name in [("torch", "fp16")] + [("torsh", c) for c in cfg["sweep"]]:
                r = _sweep_case(comm, cfg, kind, name, nb, hooks, CompressionHookState, compression_hook)
                r["repeat"] = rep
                rows.append(r)
                if comm.rank == 0 and cfg["progress"]:
                    print(f"  {r['case']:<16} {r['buckets']:3d} buckets {r['step_ms'] or float('nan'):8.1f} ms/step "
                          f"hook {r['hook_ms_per_step']:7.2f} ms/step {r['hook_ms_per_bucket']:6.3f} ms/bucket",
                          file=sys.stderr, flush=True)  # fmt: skip
    res = {"bucket_rows": rows, "world_size": comm.world_size, "backend": comm.backend}
    return _report(res, cfg) if comm.rank == 0 else None


def _sweep_case(comm, cfg, kind, name, nb, hooks, state_cls, torsh_hook) -> dict:
    """One (hook, bucket count) case of the sweep: the step loop of :func:`_case` with the hook timed."""
    acc = [0.0, 0]
    if kind == "torch":
        state, inner = hooks[(kind, name)]
    else:
        state, inner = state_cls(compressor=OURS[name](cfg["rank"]), start_iter=cfg["start_iter"]), torsh_hook

    def timed(state, bucket):
        t0 = time.thread_time()
        f = inner(state, bucket)
        acc[0] += time.thread_time() - t0
        acc[1] += 1
        return f

    timed.__annotations__ = dict(inner.__annotations__)
    r = _case(comm, {**cfg, "_hook": (state, timed, acc)}, kind, name, buckets=nb)
    if state is not None:
        r["bytes_per_step"] = state.stats.per_iteration[-1]["bytes_after"] if state.stats.per_iteration else None
    return r


def _worker(comm: TorchCommunicator, cfg: dict) -> dict | None:
    import threading

    torch.set_num_threads(cfg["threads"])
    if cfg.get("buckets"):
        return _bucket_sweep(comm, cfg)
    if cfg.get("signatures"):
        return _signature_cost(comm, cfg)
    cases = [("none", ""), ("torch", "fp16"), ("torch", "powersgd-1bucket")]
    cases += [("torsh", c) for c in cfg["compressors"]]
    if "powersgd" in cfg["compressors"]:  # like for like with PyTorch's one-bucket case
        cases.insert(cases.index(("torsh", "powersgd")) + 1, ("torsh", "powersgd-1bucket"))
    rows: list[dict] = []
    for rep in range(cfg["repeat"]):
        for kind, name in cases:
            rows.append(_case(comm, cfg, kind, name))
            rows[-1]["repeat"] = rep
            if comm.rank == 0 and cfg["progress"]:
                r = rows[-1]
                print(f"  {r['case']:<28} {r['step_ms'] or float('nan'):9.1f} ms/step", file=sys.stderr, flush=True)
    res = {"rows": rows, "world_size": comm.world_size, "backend": comm.backend, "timed_steps": cfg["steps"]}
    if not cfg["torch_powersgd_buckets"]:
        return _report(res, cfg) if comm.rank == 0 else None
    # last: PyTorch's PowerSGD hook with DDP's default buckets. On gloo it either raises or hangs (its
    # P and Q all-reduces of different buckets are issued from callbacks in a timing-dependent order),
    # so a watchdog reports a hang and ends the process (a hung collective cannot be interrupted).
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(cfg["hang_s"]):
            if comm.rank == 0:
                rows.append({"case": "torch powersgd", "buckets": "25 MB", "step_ms": None, "p20_ms": None,
                             "p80_ms": None, "bytes_per_step": None, "gradient_bytes": rows[0]["gradient_bytes"],
                             "error": f"hung: no progress in {cfg['hang_s']:.0f} s"})  # fmt: skip
                _report(res, cfg)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    rows.append(_case(comm, cfg, "torch", "powersgd"))
    done.set()
    return _report(res, cfg) if comm.rank == 0 else None


def _signature_cost(comm: TorchCommunicator, cfg: dict) -> dict | None:
    """Every compressor with the signature exchange on and off, the order alternating run by run."""
    rows: list[dict] = []
    names = [n for n in cfg["compressors"] if n != "auto"]
    for rep in range(cfg["repeat"]):
        for name in names:
            for check in (True, False) if rep % 2 == 0 else (False, True):
                r = _case(comm, {**cfg, "check": check}, "torsh", name)
                r["repeat"] = rep
                rows.append(r)
                if comm.rank == 0 and cfg["progress"]:
                    print(f"  {r['case']:<16} check {'on ' if check else 'off'} {r['step_ms'] or float('nan'):8.1f} "
                          f"ms/step, first steps {' '.join(f'{v:.1f}' for v in r['first_steps_ms'])} ms, "
                          f"{r['signature_checks']} exchanges {r['signature_ms']:.2f} ms",
                          file=sys.stderr, flush=True)  # fmt: skip
    res = {"signature_rows": rows, "world_size": comm.world_size, "backend": comm.backend}
    return _report(res, cfg) if comm.rank == 0 else None


def _report(res: dict, cfg: dict) -> dict:
    env = environment(torch.device("cuda" if res["backend"] == "nccl" else "cpu"))
    env["network"] = os.environ.get("TORSH_BENCH_NETWORK", "loopback" if res["backend"] == "gloo" else "local GPUs")
    doc_path = cfg.get("_doc_path")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if "signature_rows" in res:
        signature_summary(res)
        print_signatures(res, env, cfg)
    else:
        summaries(res)
        auto_summary(res, cfg["rank"])
        if "bucket_rows" in res:
            print_sweep(res, env, cfg)
        else:
            print_report(res, env, cfg)
    sys.stdout.flush()
    doc = {"suite": "ddp", "environment": env, "config": cfg, **res}
    if doc_path:  # for the parent, which writes the JSON (this rank may end in os._exit)
        with open(doc_path, "w") as f:
            json.dump(doc, f)
    return doc


def _counts(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bucket counts like 1,4,16,64, got {text!r}") from None
    if any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"bucket counts must be >= 1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    at_least_1 = cli_common.int_at_least(1)
    p.add_argument("--world-size", type=at_least_1, default=2, help="local ranks when not under torchrun")
    p.add_argument("--width", type=at_least_1, default=2048, help="hidden width")
    p.add_argument("--layers", type=at_least_1, default=3, help="hidden layers")
    p.add_argument("--in-dim", type=at_least_1, default=64, help="input features")
    p.add_argument("--batch", type=at_least_1, default=64, help="samples per rank per step")
    p.add_argument("--rank", type=at_least_1, default=4, help="PowerSGD rank (ours and PyTorch's)")
    p.add_argument("--start-iter", type=cli_common.int_at_least(2), default=2,
                   help="uncompressed warm-up steps (PyTorch's PowerSGD hook needs >= 2)")  # fmt: skip
    p.add_argument("--steps", type=at_least_1, default=10, help="timed steps per case")
    p.add_argument("--compressors", default=list(OURS), type=cli_common.choice_list(OURS, "compressor"),
                   help="ours to run: " + ",".join(OURS))  # fmt: skip
    p.add_argument("--no-torch-powersgd-buckets", action="store_true",
                   help="skip PyTorch's PowerSGD with 25 MB buckets (fails on gloo)")  # fmt: skip
    p.add_argument("--threads", type=at_least_1, default=1, help="torch threads per rank")
    p.add_argument("--hang-timeout", type=float, default=60.0,
                   help="seconds after which PyTorch's multi-bucket PowerSGD case counts as hung")  # fmt: skip
    p.add_argument("--repeat", type=at_least_1, default=1, help="run every case this many times, interleaved")
    p.add_argument("--buckets", default=[], type=_counts,
                   help="bucket sweep instead, e.g. 1,4,16,64 (see the description above)")  # fmt: skip
    p.add_argument("--sweep", default=["fp16", "bf16", "topk", "powersgd"],
                   type=cli_common.choice_list(OURS, "compressor"),
                   help="ours in the bucket sweep (default fp16,bf16,topk,powersgd)")  # fmt: skip
    p.add_argument("--sweep-layers", type=at_least_1, default=64, help="hidden layers of the sweep's MLP")
    p.add_argument("--sweep-width", type=at_least_1, default=362, help="hidden width of the sweep's MLP")
    p.add_argument("--signatures", action="store_true",
                   help="measure the signature exchange instead: each compressor, the exchange on and off")  # fmt: skip
    cli_common.add_json(p)


def run(args: argparse.Namespace) -> int:
    import tempfile

    if not args.hang_timeout > 0:
        raise cli_common.UsageError(f"--hang-timeout must be > 0 seconds, got {args.hang_timeout}")
    cfg = {"width": args.width, "layers": args.layers, "in_dim": args.in_dim, "batch": args.batch,
           "rank": args.rank, "start_iter": args.start_iter, "steps": args.steps, "compressors": args.compressors,
           "torch_powersgd_buckets": not args.no_torch_powersgd_buckets, "threads": args.threads,
           "progress": True, "hang_s": args.hang_timeout, "repeat": args.repeat, "buckets": args.buckets,
           "sweep": args.sweep, "sweep_layers": args.sweep_layers, "sweep_width": args.sweep_width,
           "signatures": args.signatures}  # fmt: skip
    if "RANK" in os.environ:
        comm = init_from_env(timeout=args.hang_timeout + 60)
        doc = _worker(comm, cfg)  # rank 0 prints the report
        if doc is not None:
            emit(args, doc)
        cli_common.release_stdout()
        sys.stdout.flush()
        os._exit(0)  # a failed PowerSGD case may leave gloo's process group broken: skip its teardown
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "gloo"
    with tempfile.TemporaryDirectory(prefix="torsh-bench-ddp-") as tmp:
        cfg["_doc_path"] = os.path.join(tmp, "doc.json")  # rank 0 leaves its document here
        try:
            run_local(_worker, args.world_size, cfg, backend=backend, threads=args.threads, timeout=3600,
                      op_timeout=args.hang_timeout + 60)  # fmt: skip
        except RankFailedError as e:
            if "exit" not in str(e) or not os.path.exists(cfg["_doc_path"]):
                raise
            # the watchdog ended the ranks after PyTorch's PowerSGD hook hung; rank 0 printed the report
        with open(cfg["_doc_path"]) as f:
            doc = json.load(f)
    emit(args, doc)
    return 0
