"""``torsh bench moe --ep``: the expert-parallel MoE layer's training step with its dispatch plain, fp8 or int8
(``ExpertParallelMoE(wire=...)``), side by side in one run.

Every rank builds the same layer (one seed), the expert-parallel copies of it differ only in their wire format,
and each timed repetition runs one forward + backward of every wire in turn (interleaved, so a load change on
the machine hits them alike) on the same tokens. Reported per wire: the step time (the slowest rank's, median
and 20th-80th percentiles over the repetitions), the bytes this rank sent in the step's four all-to-alls
(dispatch, combine and their gradients; the layer's ``last_dispatch``), on emulated hosts also what each rank's
own network interface carried per step (``interface_sent_per_step``, the mean over the ranks: the kernel's
counters, headers and the step's closing all-reduce included), the dispatch's bytes against a bf16
dispatch, and the output's and the input gradient's relative error against the plain layer. Run it on two
emulated hosts (``python -m torsh_kernels.apps.bench.emulated --rate 1gbit -- torsh bench moe --ep ...``), under
torchrun, or on ``--ep-world`` local ranks over loopback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from ... import cli_common
from ...collectives import init_from_env, run_local
from . import emit, environment, quantile

__all__ = ["add_arguments", "run"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _wires(text: str) -> list[str]:
    return cli_common.choice_list(("none", "bf16", "fp8", "e4m3", "e5m2", "int8", "fp8-all"), "wire")(text)


def _wire(name: str):
    """The layer's ``wire=`` for a wire's name: "none" the plain layer, "fp8-all" e4m3 on all four all-to-alls
    (dispatch, combine and their gradients), another name the dispatch's format (combine in bf16)."""
    from ...parallel import ExpertWireSpec

    if name == "none":
        return None
    if name == "fp8-all":
        return ExpertWireSpec(dispatch="e4m3", combine="e4m3", grad_combine="e4m3", grad_dispatch="e4m3")
    return name


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert parallelism (--ep)")
    g.add_argument("--ep", action="store_true",
                   help="instead: ExpertParallelMoE forward + backward with plain, fp8 and int8 dispatch")  # fmt: skip
    g.add_argument("--ep-world", type=cli_common.int_at_least(1), default=2,
                   help="local ranks over loopback (ignored under torchrun / emulated hosts)")  # fmt: skip
    g.add_argument("--ep-tokens", type=cli_common.int_at_least(1), default=4096, help="tokens per rank (4096)")
    g.add_argument("--ep-hidden", type=cli_common.int_at_least(1), default=1024, help="H (1024)")
    g.add_argument("--ep-ffn", type=cli_common.int_at_least(1), default=128, help="each expert's width (128)")
    g.add_argument("--ep-dtype", choices=sorted(_DTYPES), default="bf16", help="the layer's dtype (bf16)")
    g.add_argument("--ep-wires", type=_wires, default=["none", "fp8", "int8", "fp8-all"],
                   help="none,fp8,int8,fp8-all (fp8-all: e4m3 on all four all-to-alls)")  # fmt: skip
    g.add_argument("--ep-steps", type=cli_common.int_at_least(1), default=5, help="timed repetitions (5)")
    g.add_argument("--ep-warmup", type=cli_common.int_at_least(0), default=1, help="untimed first (1)")
    g.add_argument("--ep-threads", type=cli_common.int_at_least(1), default=1, help="torch threads per rank (1)")
    g.add_argument("--ep-train", type=cli_common.int_at_least(1), default=None, metavar="STEPS",
                   help="instead: train a 2-layer MoE byte-level LM this many steps with bf16 dispatch and with each "
                   "compressed --ep-wires format, same data and seed; the final losses side by side")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.ep_train is not None:
        return run_train(args)
    cfg = {"experts": list(args.experts), "k": args.k, "tokens": args.ep_tokens, "hidden": args.ep_hidden,
           "ffn_hidden": args.ep_ffn, "dtype": args.ep_dtype, "wires": list(args.ep_wires),
           "steps": args.ep_steps, "warmup": args.ep_warmup, "threads": args.ep_threads}  # fmt: skip
    if args.note is not None:
        cfg["note"] = args.note
    if "RANK" in os.environ:
        torch.set_num_threads(args.ep_threads)
        doc = _worker(init_from_env(timeout=600), cfg)
    else:
        doc = run_local(_worker, args.ep_world, cfg, threads=args.ep_threads, timeout=7200, op_timeout=600)[0]
    if doc is not None:
        emit(args, doc)
    sys.stdout.flush()
    return 0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _case(comm, cfg: dict, E: int) -> list[dict]:
    from ...parallel import ExpertParallelMoE, MoELayer

    W, me = comm.world_size, comm.rank
    T, H, dtype = cfg["tokens"], cfg["hidden"], _DTYPES[cfg["dtype"]]
    torch.manual_seed(0)  # the same layer on every rank
    base = MoELayer(H, cfg["ffn_hidden"], E, cfg["k"], dtype=dtype)
    layers = {w: ExpertParallelMoE.from_layer(base, comm, wire=_wire(w)) for w in cfg["wires"]}
    g = torch.Generator().manual_seed(1000 + me)
    x = torch.randn(T, H, generator=g).to(dtype)
    dy = torch.randn(T, H, generator=g).to(dtype)
    from .emulated import per_rank, wire_counter

    counter = wire_counter()  # this rank's own interface on the emulated hosts; None on loopback
    iface: dict[str, int] = {w: 0 for w in layers}
    times: dict[str, list[float]] = {w: [] for w in layers}
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    sent: dict[str, dict] = {}
    for rep in range(cfg["warmup"] + cfg["steps"]):
        for w, layer in layers.items():
            xi = x.detach().requires_grad_()
            comm.barrier()
            if counter is not None:
                counter.start()
            t0 = time.perf_counter()
            y = layer(xi)
            y.backward(dy)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            comm.all_reduce(dt, "max")  # the step ends when its slowest rank's does
            layer.zero_grad(set_to_none=True)
            if rep >= cfg["warmup"]:
                times[w].append(float(dt))
                if counter is not None:  # after the all-reduce: the peers have received this step's bytes
                    iface[w] += counter.read()["sent"]
            if rep == 0:
                outs[w] = (y.detach(), xi.grad.detach())
                sent[w] = dict(layer.last_dispatch)
        if me == 0:
            print(f"  E={E} repetition {rep + 1}/{cfg['warmup'] + cfg['steps']}", file=sys.stderr, flush=True)
    ranks = per_rank(comm, [iface[w] / cfg["steps"] for w in layers] if counter is not None else None)
    y0, g0 = outs.get("none", next(iter(outs.values())))
    rows = []
    plain_bytes = 2 * (T * cfg["k"]) * H  # a bf16 dispatch of every routed row (the reference)
    for w in layers:
        d = sent[w]
        fwd, bwd = int(d.get("bytes_sent", 0)), int(d.get("backward_bytes_sent", 0))
        ts = times[w]
        rows.append({
            "case": f"E={E}", "wire": w, "world_size": W, "experts": E, "step_ms": 1e3 * statistics.median(ts),
            "p20_ms": 1e3 * quantile(ts, 0.2), "p80_ms": 1e3 * quantile(ts, 0.8), "steps_ms": [1e3 * t for t in ts],
            "bytes_per_step": fwd + bwd, "forward_bytes": fwd, "backward_bytes": bwd,
            "interface_sent_per_step": (statistics.fmean(r[list(layers).index(w)] for r in ranks)
                                        if ranks is not None else None),
            "dispatch_row_bytes": _row_bytes(layer_wire(layers[w]), H, dtype),
            "dispatch_vs_bf16": _row_bytes(layer_wire(layers[w]), H, dtype) / (2 * H),
            "output_rel_error": _rel(outs[w][0], y0), "grad_rel_error": _rel(outs[w][1], g0),
            "bf16_dispatch_bytes_all_rows": plain_bytes,
        })  # fmt: skip
    return rows


def layer_wire(layer) -> object:
    return getattr(layer, "wire", None)


def _row_bytes(wire, H: int, dtype: torch.dtype) -> int:
    """Bytes of one dispatched row: the packed row of a compressed dispatch, else H elements of its dtype."""
    from ...ops import RowQuantSpec, row_wire_bytes

    f = getattr(wire, "dispatch", None)
    if isinstance(f, RowQuantSpec):
        return row_wire_bytes(H, f)
    return H * (2 if f == "bf16" else torch.empty((), dtype=dtype).element_size())


def _worker(comm, cfg: dict) -> dict | None:
    rows = []
    for E in cfg["experts"]:
        rows += _case(comm, cfg, E)
    if comm.rank != 0:
        return None
    _print(rows, cfg)
    env = environment(torch.device("cpu"))
    return {"suite": "moe-ep", **env, "config": {**cfg, "world_size": comm.world_size,
            "link": os.environ.get("TORSH_BENCH_LINK", "loopback" if "RANK" not in os.environ else "see note"),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}, "rows": rows}  # fmt: skip


def _print(rows: list[dict], cfg: dict) -> None:
    print(f"torsh bench moe --ep: T={cfg['tokens']}/rank, H={cfg['hidden']}, k={cfg['k']}, ffn={cfg['ffn_hidden']}, "
          f"{cfg['dtype']}, world {rows[0]['world_size']}; step = forward + backward, the slowest rank")  # fmt: skip
    print(f"{'case':8} {'wire':6} {'step ms':>9} {'p20-p80':>15} {'vs none':>8} {'MiB/step':>9} {'bytes vs none':>13} "
          f"{'row vs bf16':>11} {'out err':>8} {'grad err':>8} {'MiB/step, interface':>19}")  # fmt: skip
    for r in rows:
        iface = r.get("interface_sent_per_step")
        iface = "-" if iface is None else f"{iface / 2**20:.2f}"
        base = next(b for b in rows if b["case"] == r["case"] and b["wire"] == rows[0]["wire"])
        print(f"{r['case']:8} {r['wire']:6} {r['step_ms']:9.1f} {r['p20_ms']:7.1f}-{r['p80_ms']:<7.1f} "
              f"{base['step_ms'] / r['step_ms']:7.2f}x {r['bytes_per_step'] / 2**20:9.2f} "
              f"{r['bytes_per_step'] / max(base['bytes_per_step'], 1):12.3f}x {r['dispatch_vs_bf16']:10.3f}x "
              f"{r['output_rel_error']:8.2e} {r['grad_rel_error']:8.2e} {iface:>19}")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# --ep-train: a small MoE language model trained with each dispatch format


def _corpus() -> torch.Tensor:
    """Bytes of text to model: the project's documentation (docs/*.md beside the package), else the package's own
    Python source (what an installed wheel holds)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    files = sorted((root / "docs").glob("*.md")) or sorted((root / "torsh_kernels").rglob("*.py"))
    data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class _LM(torch.nn.Module):
    """Bytes -> embedding -> 2 x (causal attention, expert-parallel MoE), pre-norm residual -> bytes."""

    def __init__(self, comm, H: int, E: int, k: int, ffn: int, wire: object) -> None:
        from ...parallel import ExpertParallelMoE, MoELayer

        super().__init__()
        self.emb = torch.nn.Embedding(256, H)
        self.attn = torch.nn.ModuleList(torch.nn.MultiheadAttention(H, 4, batch_first=True) for _ in range(2))
        self.n1 = torch.nn.ModuleList(torch.nn.LayerNorm(H) for _ in range(2))
        self.n2 = torch.nn.ModuleList(torch.nn.LayerNorm(H) for _ in range(3))
        self.moe = torch.nn.ModuleList(
            ExpertParallelMoE.from_layer(MoELayer(H, ffn, E, k), comm, wire=wire) for _ in range(2)
        )
        self.out = torch.nn.Linear(H, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        S = tokens.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
        h = self.emb(tokens)
        for a, n1, n2, m in zip(self.attn, self.n1, self.n2, self.moe):
            z = n1(h)
            h = h + a(z, z, z, attn_mask=mask, need_weights=False)[0]
            h = h + m(n2(h))
        return self.out(self.n2[2](h))

    def aux(self) -> torch.Tensor:
        return sum(m.aux_loss for m in self.moe)


def _train_worker(comm, cfg: dict) -> dict | None:
    W, me = comm.world_size, comm.rank
    data = _corpus()
    B, S, steps = cfg["batch"], cfg["seq"], cfg["steps"]
    curves = {}
    for w in cfg["wires"]:
        torch.manual_seed(0)  # the same model on every rank and for every wire
        model = _LM(comm, cfg["hidden"], cfg["experts"], cfg["k"], cfg["ffn_hidden"], _wire(w))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        g = torch.Generator().manual_seed(7)  # the same batches for every wire
        dense = [p for n, p in model.named_parameters() if not n.startswith("moe.")]
        losses = []
        t0 = time.perf_counter()
        for _ in range(steps):
            starts = torch.randint(0, data.numel() - S - 1, (W, B), generator=g)[me]
            seq = torch.stack([data[s : s + S + 1] for s in starts.tolist()])
            logits = model(seq[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), seq[:, 1:].reshape(-1))
            (loss + model.aux()).backward()
            for m in model.moe:
                m.reduce_gradients(average=True)
            flat = torch.cat([p.grad.reshape(-1) for p in dense])
            comm.all_reduce(flat)
            flat.div_(W)
            for p, v in zip(dense, torch.split(flat, [p.numel() for p in dense])):
                p.grad.copy_(v.view_as(p))
            opt.step()
            opt.zero_grad(set_to_none=True)
            lt = torch.tensor([loss.item()], dtype=torch.float64)
            comm.all_reduce(lt)
            losses.append(float(lt) / W)
        curves[w] = {"losses": losses, "seconds": time.perf_counter() - t0,
                     "final_loss": statistics.mean(losses[-cfg["tail"] :])}  # fmt: skip
        if me == 0:
            print(f"  {w}: final loss {curves[w]['final_loss']:.4f} (mean of the last {cfg['tail']} steps), "
                  f"{curves[w]['seconds']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    if me != 0:
        return None
    ref = curves[cfg["wires"][0]]["final_loss"]
    print(f"torsh bench moe --ep-train: {steps} steps, 2 MoE layers (E={cfg['experts']}, k={cfg['k']}, "
          f"H={cfg['hidden']}), {W} ranks, {B}x{S} tokens per rank")  # fmt: skip
    for w, c in curves.items():
        print(f"  {w:8} final loss {c['final_loss']:.4f}  vs {cfg['wires'][0]}: {c['final_loss'] / ref - 1:+.2%}")
    env = environment(torch.device("cpu"))
    return {"suite": "moe-ep-train", **env, "config": {**cfg, "world_size": W, "corpus_bytes": data.numel()},
            "runs": curves}  # fmt: skip


def run_train(args: argparse.Namespace) -> int:
    cfg = {"experts": args.experts[0], "k": args.k, "hidden": 128, "ffn_hidden": 128, "batch": 8, "seq": 64,
           "steps": args.ep_train, "tail": 20, "lr": 3e-3, "wires": ["bf16", *[w for w in args.ep_wires
           if w not in ("none", "bf16")]]}  # fmt: skip
    doc = run_local(_train_worker, args.ep_world, cfg, threads=args.ep_threads, timeout=7200, op_timeout=600)[0]
    emit(args, doc)
    return 0
