"""``torsh demo``: compressed data parallelism end to end, in one command.

N local ranks (default 2; gloo on CPU, NCCL with the Triton kernels where CUDA is present) train the same
small MLP on the digits data set bundled with the package under PyTorch's DistributedDataParallel, once per
compressor (none, fp16, topk:0.01, int8, sign, powersgd:4: the compressors' own names) through
:func:`~torsh_kernels.parallel.compression_hook`, for a fixed number of steps from the same initial weights
and the same batches, and once with
``compressor="auto"``, which measures the link and each of those compressors on this model's buckets at
the end of the warm-up and keeps the cheapest. Then two tables: per compressor the step time, bytes each
rank sends per step, compression ratio, final test accuracy and speedup over uncompressed; and what
``auto`` measured: per compressor its compute cost per step, its bytes, its predicted step cost on the
measured link and the link bandwidth below which it pays off against sending uncompressed, and its choice.

``--fsdp`` trains the same model under FSDP2 instead (``fully_shard`` on each Linear and the root), once
plain and once per quantized comm configuration of :func:`~torsh_kernels.parallel.apply_quantized_comm`
(``w8``: int8 weights, ``g4``: int4 gradients, ``w8g4``: both, ...; ``--compressors`` picks among
:data:`FSDP_CASES`), with the same table: step time, bytes this rank sends per step (counted on every
all-gather and reduce-scatter), plain's bytes over them, test accuracy, speedup over plain.

The link. Compression pays only where the link is slow next to the compute it costs: over loopback
every compressor but fp16 loses to sending the gradients uncompressed. So by default, where this process
can make network namespaces (root, ``ip`` and ``tc``), the two ranks run on two emulated hosts joined by
a :data:`DEFAULT_LINK` link (``tbf`` on a veth pair) and the demo says so in one line; elsewhere it runs
over loopback and says, in one line, why compression does not pay there and which command shows it.
``--link RATE`` picks the rate (bits per second with the unit spelled out: 500kbit, 100mbit, 1gbit,
10gbit; checked before anything starts), ``--link none`` keeps loopback. :func:`plan_link` makes that
decision without side effects. After the runs, ``auto``'s prediction is checked against what it then
measured (:func:`auto_check`): a line says when they disagree by more than 2x, and why it likely did.

``--trace DIR`` records the last ``--trace-steps`` steps of every compressor with the timeline recorder
(one ``rank{R}.json`` per rank in DIR, steps labelled by compressor) and prints the timeline's summary;
``torsh timeline DIR`` and ``torsh report DIR`` then show the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import cli_common
from ..compression import Compressor, NoCompression
from ..compression.names import compressor_from_name
from ..errors import InvalidArgumentError
from .bench import fmt_bytes, quantile
from .bench.emulated import LinkRate, parse_delay, parse_rate

__all__ = [
    "COMPRESSORS",
    "DEFAULT_LINK",
    "FSDP_CASES",
    "DemoConfig",
    "LinkPlan",
    "auto_check",
    "load_digits_split",
    "plan_link",
    "print_auto",
    "print_trace_summary",
    "run_rank",
]


COMPRESSORS = ("none", "fp16", "topk:0.01", "int8", "sign", "powersgd:4", "auto")
"""The demo's compressors by their names (:mod:`torsh_kernels.compression.names`: the names the hook, ``auto``'s
table and ``torsh doctor`` use), then ``auto``. ``--compressors`` takes any compressor name."""
FORMER_NAMES = {"quantize": "int8", "topk": "topk:0.01", "powersgd": "powersgd:4"}
"""The demo's earlier names, still accepted: each runs (and its row reads) as the compressor name it stands for."""


def demo_name(name: str) -> str:
    """The name a demo row reads for ``--compressors``' ``name``: ``auto``, or the canonical compressor name
    (``FORMER_NAMES`` resolved); an unknown or malformed name raises the registry's ``InvalidArgumentError``."""
    name = FORMER_NAMES.get(name, name)
    return name if name == "auto" else compressor_from_name(name).name


def _compressor(name: str) -> Compressor | str | None:
    """The hook's ``compressor=`` for a demo row's name (None: uncompressed, as DDP's default)."""
    name = FORMER_NAMES.get(name, name)
    if name == "auto":
        return "auto"
    c = compressor_from_name(name)
    return None if isinstance(c, NoCompression) else c


FSDP_CASES: dict[str, tuple[str | None, str | None]] = {
    "plain": (None, None),
    "w8": ("int8", None),
    "w4": ("int4", None),
    "g8": (None, "int8"),
    "g4": (None, "int4"),
    "w8g8": ("int8", "int8"),
    "w8g4": ("int8", "int4"),
    "w4g4": ("int4", "int4"),
}
"""``--fsdp`` cases: (weights, grads) for :func:`~torsh_kernels.parallel.apply_quantized_comm` (plain: FSDP2's
own comms)."""
FSDP_DEFAULT = ("plain", "w8", "g4", "w8g4")


DEFAULT_LINK = "100mbit"
"""The emulated link the demo runs on by default where it can shape one: slow enough that compression
clearly pays on the demo's model (1.15 MiB of gradients a step, ~100 ms on the wire uncompressed), fast
enough that the whole demo takes a few minutes."""
LOOPBACK = ("none", "loopback")
"""``--link`` values that keep the local loopback run."""
SHOW_IT = f'`sudo "$(command -v torsh)" demo` (or, as root, `torsh demo --link {DEFAULT_LINK}`)'
"""How to see it where this process may not shape a link (sudo's own PATH would not find a venv's torsh)."""


@dataclass(frozen=True, slots=True)
class LinkPlan:
    """Where the demo's ranks run (what :func:`plan_link` decides)."""

    rate: LinkRate | None
    """The emulated link's rate (None: local ranks over loopback)."""
    delay: str | None = None
    """The emulated link's one-way delay, in tc's form (None: none)."""
    note: str | None = None
    """One line for the user: the link and why (None: nothing to say)."""


def parse_link(link: str | None) -> LinkRate | str | None:
    """``--link`` checked: a :class:`LinkRate`, ``"none"`` for loopback, or None (not given). A typed
    :class:`~torsh_kernels.cli_common.UsageError` naming the accepted forms otherwise."""
    if link is None:
        return None
    if link.strip().lower() in LOOPBACK:
        return "none"
    try:
        return parse_rate(link, what="--link")
    except InvalidArgumentError as e:
        raise cli_common.UsageError(f"{e}; or none for loopback") from None


def plan_link(link: str | None, delay: str | None, *, ranks: int, cannot_shape: str | None) -> LinkPlan:
    """Where to run, from ``--link``, ``--delay``, ``--ranks`` and whether this process can shape a link
    (``cannot_shape``: None when it can, else why not, as
    :func:`~torsh_kernels.apps.bench.emulated.unavailable_reason` says). Pure: checks the arguments (a
    :class:`~torsh_kernels.cli_common.UsageError` for bad ones) and decides, nothing is made or run."""
    rate = parse_link(link)
    if delay is not None:
        if not isinstance(rate, LinkRate):
            raise cli_common.UsageError("--delay is the one-way delay of an emulated link: it needs --link RATE")
        try:
            delay = parse_delay(delay, what="--delay")
        except InvalidArgumentError as e:
            raise cli_common.UsageError(str(e)) from None
    if isinstance(rate, LinkRate) and ranks != 2:
        raise cli_common.UsageError(f"--link runs two ranks, one per emulated host; --ranks {ranks} cannot apply "
                                    "(leave --ranks out, or use --link none)")  # fmt: skip
    if rate == "none":
        return LinkPlan(None)
    if rate is None:
        if ranks != 2:
            return LinkPlan(None, note=(
                f"link: loopback ({ranks} local ranks; the emulated slow link joins two), where compressing costs "
                "more compute than the bytes it saves; `torsh demo` as root, without --ranks, shows where it pays"
            ))  # fmt: skip
        if cannot_shape is None:
            rate = parse_rate(DEFAULT_LINK)
            return LinkPlan(rate, note=f"link: {rate} emulated (two network namespaces, tc tbf), where compression "
                            "pays on this model; --link RATE to change it, --link none for loopback")  # fmt: skip
        show = SHOW_IT if "root" in cannot_shape else "`torsh demo` as root where it can be emulated"
        return LinkPlan(None, note=(
            "link: loopback, where compressing costs more compute than the bytes it saves; compression pays on a "
            f"slow link, which cannot be emulated here ({cannot_shape}): {show} shows it"
        ))  # fmt: skip
    if cannot_shape is not None:
        return LinkPlan(None, note=(
            f"torsh demo: --link {link} needs two emulated hosts, but {cannot_shape}; running {ranks} ranks over "
            "loopback instead (the step times then show compute, not a slow link)"
        ))  # fmt: skip
    extra = f", {delay} one-way delay" if delay else ""
    return LinkPlan(rate, delay, note=f"link: {rate} emulated (two network namespaces, tc tbf{extra}); "
                    "--link none for loopback")  # fmt: skip


def _auto_candidates(names: list[str]) -> tuple[Compressor | None, ...]:
    """What ``auto`` chooses among in the demo: the demo's other compressors (all of them when the run
    names only some)."""
    chosen = [n for n in names if n != "auto"]
    return tuple(_compressor(n) for n in (chosen if len(chosen) > 1 else COMPRESSORS[:-1]))


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """What the demo trains and how."""

    compressors: list[str] = field(default_factory=lambda: list(COMPRESSORS))
    """Compressors to run, in order (the first one should be ``none``: the baseline)."""
    steps: int = 600
    """Optimizer steps per compressor."""
    hidden: int = 512
    """Width of the MLP's two hidden layers."""
    batch: int = 32
    """Samples per rank per step."""
    lr: float = 0.05
    """SGD learning rate (momentum 0.9)."""
    warmup: int = 10
    """Steps left out of the timing, and run uncompressed by the hook (its start_iter)."""
    seed: int = 0
    """Seed of the weights, the split and the batches."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    trace: str | None = None
    """Directory for the per-rank timeline traces (None: no tracing)."""
    trace_steps: int | None = None
    """With ``trace``: record this many of each compressor's last steps (None: 20, or every timed step if
    fewer). The table then shows the traced steps' figures, read from the traces as ``torsh report``
    reads them."""
    fsdp: bool = False
    """Train under FSDP2 (``fully_shard``) instead of DDP; ``compressors`` are then :data:`FSDP_CASES`."""
    watch: str | None = None
    """A directory the ranks publish their live metrics to (``torsh top`` reads it; one compressor per run)."""

    def __post_init__(self) -> None:
        if self.fsdp:
            bad = [c for c in self.compressors if c not in FSDP_CASES]
            if bad or not self.compressors:
                raise InvalidArgumentError(f"unknown FSDP case(s) {bad}; choose from {list(FSDP_CASES)}")
        else:
            names, bad = [], []
            for c in self.compressors:
                try:
                    names.append(demo_name(c))
                except InvalidArgumentError:
                    bad.append(c)
            if bad or not names:
                raise InvalidArgumentError(
                    f"unknown compressor(s) {bad}; choose from {list(COMPRESSORS)} or any compressor name "
                    "(`torsh doctor` lists them; the demo's former names quantize, topk, powersgd still work)"
                )
            self.compressors = names
        for name in ("steps", "hidden", "batch"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise InvalidArgumentError(
                f"steps must be more than the {self.warmup} warm-up steps, got {self.steps} (warmup must be in "
                "[0, steps))"
            )
        if self.trace_steps is None:
            self.trace_steps = min(20, self.steps - self.warmup)
        if self.trace and not 1 <= self.trace_steps <= self.steps - self.warmup:
            raise InvalidArgumentError(
                f"trace_steps must be in [1, steps - warmup] = [1, {self.steps - self.warmup}], got {self.trace_steps}"
            )


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set (1797 8x8 images, 10 classes; UCI's optdigits test set, the copy scikit-learn
    bundles, shipped in this package as ``apps/data/digits.npz``) scaled to [0, 1]; a fixed 80/20 split."""
    from importlib.resources import files

    import numpy as np

    with files("torsh_kernels.apps").joinpath("data", "digits.npz").open("rb") as f, np.load(f) as d:
        x = torch.from_numpy(d["images"]).to(torch.float32) / 16.0
        y = torch.from_numpy(d["target"]).to(torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def _mlp(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def run_rank(comm, cfg: DemoConfig) -> list[dict] | None:
    """One rank's part: train once per compressor. Rank 0 returns a row per compressor."""
    if cfg.fsdp:
        return _fsdp_rank(comm, cfg)
    from ..profiling import timeline

    dev = comm.device
    xtr, ytr, xte, yte = load_digits_split(cfg.seed)
    data = tuple(t.to(dev) for t in (xtr, ytr, xte, yte))
    progress = _progress_bar() if comm.rank == 0 and cfg.progress else None
    rows = []
    rec = timeline.Recorder(cfg.trace, rank=comm.rank, world_size=comm.world_size) if cfg.trace else None
    pub = None
    if cfg.watch:
        from ..profiling.live import watch

        pub = watch(dir=cfg.watch, job="torsh-demo")
    try:
        for ci, name in enumerate(cfg.compressors):
            rows.append(_train(comm, cfg, ci, name, data, rec, progress))
    finally:
        if progress:
            progress.stop()
        if rec is not None:
            rec.stop()
        if pub is not None:
            pub.close()
    if rec is not None:
        rec.write()
        comm.barrier()  # every rank's file is written before rank 0 reads them
    if comm.rank != 0:
        return None
    base = next((r["step_ms"] for r in rows if r["compressor"] == "none"), None)
    for r in rows:
        r["speedup"] = base / r["step_ms"] if base else None
    return rows


def _progress_bar():
    """Rank 0's progress bars, one per compressor (started)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=None, transient=False,
    )  # fmt: skip
    progress.start()
    return progress


def _train(comm, cfg: DemoConfig, ci: int, name: str, data: tuple, rec, progress) -> dict:
    """Train the model once with compressor ``name`` (the ``ci``-th): its row of the table."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..parallel import CompressionHookState, compression_hook
    from ..profiling import timeline

    dev = comm.device
    xtr, ytr, xte, yte = data
    me, ws = comm.rank, comm.world_size
    compressor = _compressor(name)
    net = _mlp(cfg.hidden, cfg.seed).to(dev)
    ddp = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    extra = {"auto_candidates": _auto_candidates(cfg.compressors)} if compressor == "auto" else {}
    state = CompressionHookState(compressor=compressor, start_iter=cfg.warmup, **extra)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.9)
    g = torch.Generator().manual_seed(cfg.seed + 1)  # the same global batches for every compressor
    task = progress.add_task(f"{name} ({ws} ranks)", total=cfg.steps) if progress else None
    times = []
    for i in range(cfg.steps):
        idx = torch.randint(0, len(ytr), (ws * cfg.batch,), generator=g)[me * cfg.batch : (me + 1) * cfg.batch]
        idx = idx.to(dev)
        traced = rec is not None and i >= cfg.steps - cfg.trace_steps
        if traced:
            rec.start()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with timeline.step(ci * cfg.steps + i, label=name):
            opt.zero_grad(set_to_none=True)
            with timeline.record("forward"):
                loss = torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
            with timeline.record("backward"):
                loss.backward()
            with timeline.record("optimizer"):
                opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        if traced:
            rec.stop()
        if progress:
            progress.update(task, advance=1)
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    row = _row(cfg, name, compressor, state, times, rec is not None, acc, loss.item())
    if compressor == "auto":  # for auto_check: the step without its gradient sync
        row["compute_floor_ms"] = _compute_floor_ms(ddp, opt, xtr, ytr, g, me, ws, cfg.batch, dev)
    return row


def _compute_floor_ms(ddp, opt, xtr, ytr, g, me: int, ws: int, batch: int, dev, steps: int = 20) -> float:
    """Median milliseconds of a training step with DDP's gradient sync switched off (``no_sync``: forward,
    backward, optimizer, no hook, no collective): what ``auto``'s per-step prediction leaves out."""
    times = []
    for _ in range(steps):
        idx = torch.randint(0, len(ytr), (ws * batch,), generator=g)[me * batch : (me + 1) * batch].to(dev)
        t0 = time.perf_counter()
        with ddp.no_sync():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _row(cfg: DemoConfig, name: str, compressor, state, times: list[float], traced: bool, acc: float,
         loss: float) -> dict:  # fmt: skip
    """One compressor's row: the timed steps' figures (the hook keeps its last 100 iterations): wire bytes as
    the timeline and `torsh report` count them (collectives.wire_bytes), payload as the compressor counts it."""
    timed = state.stats.per_iteration[-min(cfg.steps - cfg.warmup, 100) :]
    gradient = timed[-1]["bytes_before"]
    payload = statistics.fmean(it["bytes_after"] for it in timed)
    auto = state.stats.auto
    return {
        "compressor": name,
        "chose": None if auto is None else auto["choice"],
        "spec": "uncompressed" if compressor is None else repr(state.compressor if auto else compressor),
        "auto": auto,
        "step_ms": 1e3 * statistics.median(times[cfg.warmup :]),
        "step_ms_p20": 1e3 * quantile(times[cfg.warmup :], 0.2),
        "step_ms_p80": 1e3 * quantile(times[cfg.warmup :], 0.8),
        "bytes_per_step": statistics.fmean(it["wire_bytes"] for it in timed),
        "payload_bytes_per_step": payload,
        "gradient_bytes": gradient,
        "ratio": gradient / payload if payload else None,
        "figures_from": "timer and hook",
        # the hook's wire bytes over the traced steps alone (from_trace checks them against the traces)
        "hook_traced_bytes_per_step": statistics.fmean(
            it["wire_bytes"] for it in state.stats.per_iteration[-min(cfg.trace_steps, 100) :]
        )
        if traced
        else None,
        "accuracy": acc,
        "final_loss": loss,
    }


def _fsdp_rank(comm, cfg: DemoConfig) -> list[dict] | None:
    """``--fsdp``: the same model, data and steps under ``fully_shard`` (each Linear and the root), once per
    case of :data:`FSDP_CASES`, with the bytes this rank sent per step counted on every comm."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..parallel.fsdp import apply_quantized_comm, count_traffic

    warnings.simplefilter("ignore", FutureWarning)  # FSDP2's use of its deprecated collective names
    dev = comm.device
    xtr, ytr, xte, yte = (t.to(dev) for t in load_digits_split(cfg.seed))
    me, ws = comm.rank, comm.world_size
    mesh = init_device_mesh(dev.type, (ws,))
    rows = []
    for name in cfg.compressors:
        weights, grads = FSDP_CASES[name]
        net = _mlp(cfg.hidden, cfg.seed).to(dev)
        for m in net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
        comms = count_traffic(net, apply_quantized_comm(net, weights=weights, grads=grads))
        opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.9)
        g = torch.Generator().manual_seed(cfg.seed + 1)
        times, sent = [], 0
        for _ in range(cfg.steps):
            idx = torch.randint(0, len(ytr), (ws * cfg.batch,), generator=g)[me * cfg.batch : (me + 1) * cfg.batch]
            idx = idx.to(dev)
            before = sum(c.bytes_sent for c in comms)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
            sent = sum(c.bytes_sent for c in comms) - before
        with torch.no_grad():
            acc = (net(xte).argmax(1) == yte).float().mean().item()  # every rank: the forward all-gathers
        spec = "FSDP2's own comms" if weights is None and grads is None else " + ".join(
            f"{v} {k}" for k, v in (("weights", weights), ("grads", grads)) if v
        )  # fmt: skip
        rows.append({"compressor": name, "chose": None, "spec": spec, "auto": None,
                     "step_ms": 1e3 * statistics.median(times[cfg.warmup :]),
                     "step_ms_p20": 1e3 * quantile(times[cfg.warmup :], 0.2),
                     "step_ms_p80": 1e3 * quantile(times[cfg.warmup :], 0.8),
                     "bytes_per_step": sent, "accuracy": acc, "final_loss": loss.item()})  # fmt: skip
    if me != 0:
        return None
    plain = next((r for r in rows if r["compressor"] == "plain"), None)
    for r in rows:
        r["gradient_bytes"] = plain["bytes_per_step"] if plain else None
        r["ratio"] = plain["bytes_per_step"] / max(1, r["bytes_per_step"]) if plain else None
        r["speedup"] = plain["step_ms"] / r["step_ms"] if plain else None
    return rows


def print_table(rows: list[dict], *, title: str, console=None) -> None:
    console = console or cli_common.console()
    base = "plain" if any(r["compressor"] == "plain" for r in rows) else "none"
    t = cli_common.table(title, ["compressor", "step time (ms)", "p20-p80 (ms)", "wire bytes / step", "compression",
                           "test accuracy", f"speedup vs {base}"], text=("compressor",))  # fmt: skip
    for r in rows:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        name = r["compressor"] + (f": {r['chose']}" if r.get("chose") else "")
        t.add_row(
            name, f"{r['step_ms']:.2f}", f"{r['step_ms_p20']:.2f}-{r['step_ms_p80']:.2f}",
            fmt_bytes(r["bytes_per_step"]), "-" if r["ratio"] is None else f"{r['ratio']:.1f}x",
            f"{100 * r['accuracy']:.1f}%", sp,
        )  # fmt: skip
    console.print(t)
    auto = next((r["auto"] for r in rows if r.get("auto")), None)
    if auto is not None:
        print_auto(auto)


def print_auto(auto: dict, *, console=None) -> None:
    """What ``compressor="auto"`` measured (``stats.auto`` of the hook or the synchronizer) and chose."""
    console = console or cli_common.console()
    link = auto["link"]
    t = cli_common.table(
        f"compressor='auto' at the end of the warm-up: measured link {link['bandwidth_Bps'] * 8 / 1e9:.3g} "
        f"Gbit/s, {link['latency_s'] * 1e6:.0f} us latency; each compressor on this model's "
        f"{auto['buckets']} bucket(s), {fmt_bytes(auto['gradient_bytes'])} of gradients per step "
        f"(decided in {auto['measure_s']:.2f} s)",
        ["compressor", "compute / step (ms)", "payload / step", "wire / step (ms)", "predicted (ms)", "pays off below"],
        text=("compressor",),
    )
    for c in auto["candidates"]:
        if c["compressor"] == "none":
            be = "-"
        elif c["break_even_gbit"] is None:
            be = "any link"
        elif c["break_even_gbit"] <= 0:
            be = "never"
        else:
            be = f"{c['break_even_gbit']:.3g} Gbit/s"
        mark = "  <- auto" if c["compressor"] == auto["choice"] else ""
        t.add_row(c["compressor"] + mark, f"{1e3 * c['compute_s']:.2f}", fmt_bytes(c["bytes_sent"]),
                  f"{1e3 * c['wire_s']:.2f}", f"{1e3 * c['total_s']:.2f}", be)  # fmt: skip
    console.print(t)
    console.print(f"auto chose {auto['reason']}")


def _label_of(name: str) -> str | None:
    """The label ``auto`` gives the demo's compressor ``name`` (None for auto itself)."""
    c = _compressor(name)
    return "none" if c is None else (c.label() if isinstance(c, Compressor) else None)


def auto_check(rows: list[dict], *, link: LinkRate | None = None, cpus: int | None = None) -> str | None:
    """``auto``'s prediction checked against what the demo then measured (None without an auto row).

    Prediction: the step without its gradient sync (the auto row's ``compute_floor_ms``, measured under DDP's
    ``no_sync``) plus the chosen candidate's predicted compute and wire time; measured: the auto row's step
    time. Within 2x either way, one line saying so; beyond, the line says why it likely disagrees, from the
    figures at hand: the same check on each compressor the demo also ran (uncompressed as predicted means the
    link model held and the compressors' compute did not; uncompressed off too means the link did not), the
    probed link against the shaped one (``link``), ``cpus`` against the ranks, and a compressor that measured
    faster than auto's choice."""
    r = next((r for r in rows if r.get("auto")), None)
    if r is None:
        return None
    auto = r["auto"]
    floor = r.get("compute_floor_ms") or 0.0
    by_label = {c["compressor"]: c for c in auto["candidates"]}
    choice = by_label[auto["choice"]]

    def measured(row: dict) -> float:
        return row.get("timer_step_ms", row["step_ms"])

    pred = floor + 1e3 * choice["total_s"]
    meas = measured(r)
    ratio = meas / pred if pred > 0 else float("inf")
    head = (
        f"auto's check: {auto['choice']} predicted {pred:.1f} ms/step ({floor:.1f} ms of step without sync + "
        f"{1e3 * choice['compute_s']:.1f} ms compute + {1e3 * choice['wire_s']:.1f} ms wire), measured {meas:.1f} ms"
    )
    if 0.5 <= ratio <= 2.0:
        return head + f": within 2x ({ratio:.2f}x)"
    why = []
    others = {}  # label -> (predicted, measured) of each compressor the demo ran
    for row in rows:
        lab = _label_of(row["compressor"])
        if lab in by_label:
            others[lab] = (floor + 1e3 * by_label[lab]["total_s"], measured(row))
    if "none" in others and auto["choice"] != "none":
        p0, m0 = others["none"]
        if 2 / 3 <= m0 / p0 <= 1.5:
            worst = sorted(((m / p, lab) for lab, (p, m) in others.items() if lab != "none"), reverse=True)
            why.append(
                f"uncompressed ran as predicted ({p0:.1f} vs {m0:.1f} ms), so the link model held and the "
                "compressors cost more under load than auto's warm-up timing of each (run with no traffic) "
                "showed: " + ", ".join(f"{lab} {x:.1f}x" for x, lab in worst[:3])
            )
        else:
            why.append(f"uncompressed also took {m0 / p0:.1f}x its prediction ({m0:.1f} vs {p0:.1f} ms): the link "
                       "under load is not the link probed at the end of the warm-up")  # fmt: skip
    probed = auto["link"]["bandwidth_Bps"] * 8
    if link is not None and not 2 / 3 <= probed / link.bits_per_s <= 1.5:
        why.append(f"the warm-up probe measured {LinkRate(round(probed))} on a link shaped to {link}")
    ranks = auto.get("world_size", 2)
    if cpus is not None and cpus < 2 * ranks:
        why.append(f"{ranks} ranks share {cpus} CPU cores with the network stack and gloo's threads, so compute "
                   "and communication contend")  # fmt: skip
    best = min(
        (row for row in rows if not row.get("auto") and _label_of(row["compressor"]) in by_label),
        key=measured, default=None,
    )  # fmt: skip
    if best is not None and measured(best) < 0.9 * meas:
        why.append(f"measured, {best['compressor']} was faster than auto's pick ({measured(best):.1f} vs "
                   f"{meas:.1f} ms)")  # fmt: skip
    return head + f": they disagree by {max(ratio, 1 / ratio):.1f}x; likely because " + "; ".join(why or ["(unknown)"])


def _title(cfg: DemoConfig, ranks: int, backend: str, network: str, params: int) -> str:
    return (
        f"torsh demo: {ranks} ranks ({backend}, {network}), MLP 64-{cfg.hidden}-{cfg.hidden}-10 "
        f"({params:,} parameters, "
        f"{4 * params / 2**20:.2f} MiB of gradients) on UCI digits, {cfg.steps} steps of {cfg.batch}/rank, "
        + ("FSDP2 (fully_shard) + torsh quantized comms" if cfg.fsdp else "DDP + torsh compression_hook")
    )


def from_trace(rows: list[dict], trace, rep: dict) -> None:
    """With ``--trace``: each row's step time and wire bytes per step become those of its traced steps, as
    ``torsh report`` computes them from the traces (:func:`~torsh_kernels.profiling.report.label_figures`:
    median step over every rank, wire bytes per step by ``collectives.wire_bytes``), so the table, the trace
    summary and the report show one set of figures. The demo's own measurements stay in the row:
    ``timer_step_ms`` (its timer, every timed step) and ``hook_bytes_per_step`` (the hook's wire bytes over
    the traced steps, counted by its communicator rather than by the recorder). ``trace``: the loaded traces;
    ``rep``: ``report.build(trace)``."""
    durs: dict[str, list[float]] = {}
    for s in trace.steps():
        durs.setdefault(s.args.get("label"), []).append(s.dur)
    for r in rows:
        hook = r.pop("hook_traced_bytes_per_step", None)
        f = rep["by_label"].get(r["compressor"])
        if f is None or f["step_ms_median"] is None or f["wire_bytes_per_step"] is None:
            continue  # no traced step of it: the row keeps the timer's and the hook's figures (figures_from)
        r["timer_step_ms"], r["hook_bytes_per_step"] = r["step_ms"], hook
        d = durs[r["compressor"]]
        r.update(step_ms=f["step_ms_median"], step_ms_p20=quantile(d, 0.2), step_ms_p80=quantile(d, 0.8),
                 bytes_per_step=f["wire_bytes_per_step"], figures_from="trace")  # fmt: skip
    base = next((r for r in rows if r["compressor"] == "none"), None)
    for r in rows:  # a speedup only between figures of one source
        same = base is not None and base["figures_from"] == r["figures_from"]
        r["speedup"] = base["step_ms"] / r["step_ms"] if same else None


def _finish(rows: list[dict], cfg: DemoConfig, ranks: int, backend: str, network: str, json_path: str | None) -> None:
    params = sum(p.numel() for p in _mlp(cfg.hidden, cfg.seed).parameters())
    title = _title(cfg, ranks, backend, network, params)
    if cfg.trace:  # the traces are read and reported on once, for the table and the summary
        from ..profiling.report import build
        from ..profiling.traces import load

        trace = load(cfg.trace)
        rep = build(trace)
        from_trace(rows, trace, rep)
        title += f"; figures of the {cfg.trace_steps} traced steps of each, from the traces"
    print_table(rows, title=title)
    check = auto_check(rows, link=_shaped_rate(), cpus=os.cpu_count())
    if check is not None:
        cli_common.console().print(check, highlight=False, markup=False)
    if json_path:
        from .bench import environment

        dev = torch.device("cuda" if backend == "nccl" else "cpu")
        cli_common.write_json(json_path, {"environment": environment(dev), "network": network, "ranks": ranks,
                                    "backend": backend, "config": asdict(cfg), "parameters": params,
                                    "rows": rows, "auto_check": check},
                              announce=not os.environ.get(_RELAY))  # fmt: skip
    if cfg.trace:
        print_trace_summary(cfg.trace, trace=trace, rep=rep)


def print_trace_summary(directory: str, console=None, *, trace=None, rep: dict | None = None) -> None:
    """The timeline of the last traced step, then the viewer's per-rank totals and top names over every
    traced step, and the communication share per compressor (the report's per-label table). ``trace`` and
    ``rep`` (``report.build(trace)``): the traces of ``directory`` already loaded and reported on."""
    from ..profiling import analysis
    from ..profiling.report import build, print_labels
    from ..profiling.traces import load
    from ..profiling.viewer import View, render_lanes, render_tables

    if console is None:  # the lanes take the console's width: at least 120 columns
        probe = cli_common.console()
        console = cli_common.console(width=max(120, probe.width) if probe.is_terminal else 120, highlight=False)
    trace = load(directory) if trace is None else trace
    last = max(n for s in trace.steps() if (n := analysis.step_number(s)) is not None)
    render_lanes(trace, View(step=last), console, source=f"{directory} (last traced step)")
    render_tables(trace, View(top=10), console)
    print_labels(build(trace) if rep is None else rep, console)
    console.print(f"traces in {directory}/: `torsh timeline {directory} --step N` to zoom into a step, "
                  f"`torsh report {directory}` for the bottleneck report")  # fmt: skip


_RELAY = "TORSH_DEMO_JSON_RELAY"  # set: rank 0 writes its JSON for the parent to pass on, unannounced
_LINK_RATE = "TORSH_DEMO_LINK_BPS"  # the emulated link's rate, for the ranks' auto_check
_ROWS_BY_PARENT = "TORSH_DEMO_ROWS_BY_PARENT"  # set (--watch): rank 0 writes its rows for the parent to print


def _shaped_rate() -> LinkRate | None:
    v = os.environ.get(_LINK_RATE)
    return LinkRate(int(v)) if v and v.isdigit() else None


def _env_rank_main(cfg: DemoConfig, json_path: str | None) -> int:
    """Entry point of one rank under torchrun's environment (the --link mode's two namespaces)."""
    from ..collectives import init_from_env

    comm = init_from_env("gloo", timeout=120)  # on the CPU over the shaped veth (NCCL would bypass it)
    rows = run_rank(comm, cfg)
    if rows is not None:
        net = os.environ.get("TORSH_BENCH_NETWORK", "torchrun environment")
        if os.environ.get(_ROWS_BY_PARENT):  # --watch: the parent shows the live view, then the table
            with open(json_path, "w") as f:
                json.dump({"rows": rows, "backend": comm.backend, "network": net}, f)
        else:
            _finish(rows, cfg, comm.world_size, comm.backend, net, json_path)
    torch.distributed.destroy_process_group()
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    at_least_1 = cli_common.int_at_least(1)
    ap.add_argument("--ranks", type=at_least_1, default=2, help="local ranks (default 2; --link always uses 2)")
    d = DemoConfig()
    ap.add_argument("--steps", type=at_least_1, default=d.steps, help="steps per compressor")
    ap.add_argument("--hidden", type=at_least_1, default=d.hidden, help="hidden width of the MLP")
    ap.add_argument("--batch", type=at_least_1, default=d.batch, help="samples per rank per step")
    ap.add_argument(
        "--compressors", default=None,
        help="comma-separated, from: " + ", ".join(COMPRESSORS) + " (default: all); with --fsdp, from: "
        + ", ".join(FSDP_CASES) + f" (default: {','.join(FSDP_DEFAULT)})",
    )  # fmt: skip
    ap.add_argument("--fsdp", action="store_true",
                    help="train under FSDP2 (fully_shard) with torsh's quantized all-gather / reduce-scatter: "
                    "w8 = int8 weights, g4 = int4 gradients, ...")  # fmt: skip
    ap.add_argument("--link", default=None, metavar="RATE",
                    help="2 ranks on two emulated hosts joined by a link of this rate, in bits per second: 500kbit, "
                    f"100mbit, 1gbit, 10gbit; none: local ranks over loopback (default: {DEFAULT_LINK} where this "
                    "process can make network namespaces (root, ip, tc), else loopback)")  # fmt: skip
    ap.add_argument("--delay", default=None, help="with --link RATE: one-way delay per direction (e.g. 1ms, 250us)")
    ap.add_argument("--threads", type=at_least_1, default=1, help="torch threads per rank (CPU)")
    cli_common.add_json(ap, "the rows")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--trace", default=None, metavar="DIR", help="record timeline traces (rank{R}.json) into DIR")
    ap.add_argument("--watch", nargs="?", const="", default=None, metavar="DIR",
                    help="show the live view of the ranks while they train (torsh top), from the live metrics they "
                    "publish to DIR (default: a new temporary directory); one compressor per run (default auto, "
                    "which then follows the link)")  # fmt: skip
    ap.add_argument("--trace-steps", type=at_least_1, default=None,
                    help="with --trace: the last N steps of each compressor (default 20, or every timed step if "
                    "fewer); the table then shows those steps, as the traces hold them")  # fmt: skip


def run(a: argparse.Namespace) -> int:
    watching = getattr(a, "watch", None) is not None
    try:
        names = a.compressors if a.compressors is not None else ",".join(FSDP_DEFAULT if a.fsdp else COMPRESSORS)
        if watching and a.compressors is None:
            names = "auto"
        cfg = DemoConfig(compressors=[c.strip() for c in names.split(",") if c.strip()], steps=a.steps,
                         hidden=a.hidden, batch=a.batch, progress=not a.no_progress and not watching,
                         trace=os.path.abspath(a.trace) if a.trace else None, trace_steps=a.trace_steps,
                         fsdp=a.fsdp)  # fmt: skip
    except InvalidArgumentError as e:
        raise cli_common.UsageError(str(e)) from e
    if watching:
        if cfg.fsdp or len(cfg.compressors) != 1:
            raise cli_common.UsageError("--watch shows one DDP run: give one compressor (--compressors X; default "
                                        "auto), without --fsdp")  # fmt: skip
        if not a.watch:
            import tempfile

            a.watch = tempfile.mkdtemp(prefix="torsh-live-")
        cfg.watch = a.watch = os.path.abspath(a.watch)
    if cfg.fsdp and cfg.trace:
        raise cli_common.UsageError("--trace records the DDP demo; it is not wired into --fsdp")
    if os.environ.get("TORSH_DEMO_RANK_MODE") == "env":  # a rank started on an emulated host below
        torch.set_num_threads(a.threads)
        return _env_rank_main(cfg, a.json)
    from .bench import emulated

    plan = plan_link(a.link, a.delay, ranks=a.ranks, cannot_shape=emulated.unavailable_reason())
    if plan.note:
        print(plan.note, file=sys.stderr, flush=True)
    if plan.rate is not None:
        try:
            return _run_emulated(a, plan)
        except InvalidArgumentError as e:  # the namespaces could not be made (e.g. root without CAP_SYS_ADMIN)
            if a.link is not None or a.delay is not None:
                raise
            print(f"link: loopback after all: {e}", file=sys.stderr, flush=True)
    from ..collectives import run_local

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= a.ranks else "gloo"
    with _live_view(cfg):
        rows = run_local(run_rank, a.ranks, cfg, backend=backend, threads=a.threads, timeout=1800, op_timeout=120)[0]
    _finish(rows, cfg, a.ranks, backend, "loopback" if backend == "gloo" else "NVLink/PCIe", a.json)
    return 0


@contextlib.contextmanager
def _live_view(cfg: DemoConfig):
    """With ``--watch``: ``torsh top``'s live view of the ranks' live metrics, from a thread of this process, until
    the ranks are done (then the path of the records, for ``torsh top DIR --once`` later)."""
    if not cfg.watch:
        yield
        return
    import threading

    from ..profiling.top import live_view

    stop = threading.Event()
    t = threading.Thread(target=live_view, args=([cfg.watch],), kwargs={"stop": stop, "interval": 0.5}, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)
        print(f"\nlive metrics: {cfg.watch} (torsh top {cfg.watch} --once)", file=sys.stderr, flush=True)


def _run_emulated(a: argparse.Namespace, plan: LinkPlan) -> int:
    """The two ranks on two emulated hosts: this command again in each namespace, as a rank."""
    import tempfile

    from .bench import emulated

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    argv = cli_common.argv_of(ap, a, skip={"link", "delay", "ranks", "json"})
    env = {"TORSH_DEMO_RANK_MODE": "env", _LINK_RATE: str(plan.rate.bits_per_s)}
    relay = None
    cfg = DemoConfig(compressors=[a.compressors or "auto"], watch=a.watch) if a.watch else None
    if cfg is not None:  # --watch: rank 0 hands its rows to this process, which shows the live view meanwhile
        fd, rows_file = tempfile.mkstemp(prefix="torsh-demo-rows-", suffix=".json")
        os.close(fd)
        argv += ["--json", rows_file]
        env[_ROWS_BY_PARENT] = "1"
    elif a.json == "-":  # rank 0's stdout is this process's stderr while the JSON waits: it goes by a file
        fd, relay = tempfile.mkstemp(prefix="torsh-demo-", suffix=".json")
        os.close(fd)
        argv += ["--json", relay]
        env[_RELAY] = "1"
    elif a.json:
        argv += ["--json", os.path.abspath(a.json)]
    cmd = [sys.executable, "-m", "torsh_kernels.apps.cli", "demo", *argv]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if cfg is not None:
            with _live_view(cfg):
                rc = emulated.run_on_emulated_hosts(cmd, rate=plan.rate, delay=plan.delay)
            if rc == 0:
                with open(rows_file) as f:
                    got = json.load(f)
                full = DemoConfig(compressors=[a.compressors or "auto"], steps=a.steps, hidden=a.hidden,
                                  batch=a.batch, watch=a.watch)  # fmt: skip
                _finish(got["rows"], full, 2, got["backend"], got["network"], a.json)
            os.unlink(rows_file)
            return rc
        rc = emulated.run_on_emulated_hosts(cmd, rate=plan.rate, delay=plan.delay)
        if relay is not None and rc == 0:
            with open(relay) as f:
                cli_common.write_json("-", json.load(f))
        return rc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if relay is not None:
            os.unlink(relay)
