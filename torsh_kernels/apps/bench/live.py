"""Live metrics: what publishing costs per step, and ``compressor="auto"`` following a link that changes under a
running job.

``torsh bench live`` (the overhead): ``torsh demo``'s model (the digits MLP, ``--hidden`` wide) trained with DDP and
torsh's hook on ``--ranks`` local gloo ranks, in runs that alternate between publishing (files and a Prometheus
endpoint, every record, the compression error every 25 steps) and not, ``--runs`` of each, interleaved. Reported:
each run's median step time, the median over runs and its spread, the ratio watched / unwatched, and the
publisher's own seconds per record.

``torsh bench live --link-change [SCHEDULE]`` (root: two emulated hosts, :mod:`.emulated`): the same model on two
hosts whose link this process changes with ``tc qdisc change`` while the job runs, at the steps of SCHEDULE
(default ``10gbit,100mbit@60,10gbit@140``: 10 Gbit/s, 100 Mbit/s from rank 0's step 60, 10 Gbit/s again from
step 140), read from the ranks' live records. Cases: ``compressor="auto"`` (following the link), and each of
``--fixed`` (default: uncompressed and the compressor auto chooses on the slow link) on the same schedule.
Reported: the steps and seconds from each link change to auto's switch on each rank, and per link phase each
case's median step time over the same steps (after auto's switch), and each case's final test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ... import cli_common
from ...errors import InvalidArgumentError
from . import environment, quantile

SCHEDULE = "10gbit,100mbit@60,10gbit@140"


def parse_schedule(text: str) -> list[tuple[int, str]]:
    """``RATE[,RATE@STEP ...]`` -> [(step, rate)], the first at step 0, steps increasing."""
    from .emulated import parse_rate

    out: list[tuple[int, str]] = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        rate, _, step = part.partition("@")
        if (i == 0) != (step == ""):
            raise InvalidArgumentError(f"--link-change {text!r}: the first rate has no @STEP, every later one has one")
        parse_rate(rate, what="--link-change rate")
        s = int(step) if step else 0
        if step and (not step.isdigit() or s <= out[-1][0]):
            raise InvalidArgumentError(f"--link-change {text!r}: steps must be increasing integers, got {step!r}")
        out.append((s, rate))
    return out


# -- one rank's training ------------------------------------------------------------------------------------


def train(comm, *, compressor: str, steps: int, hidden: int, batch: int = 32, warmup: int = 5, seed: int = 0,
          slow_rank: int | None = None, slow_from: int = 0, slow_s: float = 0.0,
          auto_candidates: list[str] | None = None) -> dict:  # fmt: skip
    """``torsh demo``'s model trained with DDP and the hook (``compressor``: a name or "auto") for ``steps`` steps;
    ``slow_rank`` sleeps ``slow_s`` per step from step ``slow_from`` (a straggler). Returns the step times, the
    test accuracy, the hook's statistics."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...parallel import CompressionHookState, compression_hook
    from ..demo import _mlp, load_digits_split

    xtr, ytr, xte, yte = load_digits_split(seed)
    me, ws = comm.rank, comm.world_size
    net = _mlp(hidden, seed)
    ddp = DDP(net)
    extra = {"auto_candidates": auto_candidates} if compressor == "auto" and auto_candidates else {}
    state = CompressionHookState(compressor=None if compressor == "none" else compressor, start_iter=warmup,
                                 **extra)  # fmt: skip
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed + 1)
    times = []
    for i in range(steps):
        idx = torch.randint(0, len(ytr), (ws * batch,), generator=g)[me * batch : (me + 1) * batch]
        t0 = time.perf_counter()
        if me == slow_rank and i >= slow_from:
            time.sleep(slow_s)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    return {"rank": me, "times": times, "accuracy": acc, "loss": loss.item(), "stats": state.stats.as_dict(),
            "timed": state._communicator().traffic.timed, "live_cost_s": state._run.meter.cost_s}  # fmt: skip


def _watched_rank(comm, cfg: dict) -> dict:
    """A local rank of the overhead runs: train with or without a publisher."""
    from ...profiling.live import watch

    pub = watch(dir=cfg["dir"], prometheus=0, job="bench-live") if cfg["dir"] else None
    try:
        out = train(comm, compressor=cfg["compressor"], steps=cfg["steps"], hidden=cfg["hidden"])
    finally:
        if pub is not None:
            out_pub = (pub.records, pub.publish_s)
            pub.close()
    if pub is not None:
        out["records"], out["publish_s"] = out_pub
    return out


# -- the overhead -------------------------------------------------------------------------------------------


def overhead(a: argparse.Namespace) -> dict:
    from ...collectives import run_local

    runs = {"not watched": [], "watched": []}
    publish, share = [], []
    tmp = tempfile.mkdtemp(prefix="torsh-live-bench-")
    for r in range(a.runs):
        order = ("not watched", "watched") if r % 2 == 0 else ("watched", "not watched")
        for case in order:
            d = os.path.join(tmp, f"run{r}") if case == "watched" else None
            cfg = {"dir": d, "compressor": a.compressor, "steps": a.steps, "hidden": a.hidden}
            outs = run_local(_watched_rank, a.ranks, cfg, timeout=1800, op_timeout=120)
            skip = min(10, a.steps // 4)  # the warm-up and the first compressed steps
            slowest = max(statistics.median(o["times"][skip:]) for o in outs)
            runs[case].append(slowest * 1e3)
            if case == "watched":
                publish.append(max(o["live_cost_s"] / len(o["times"]) for o in outs) * 1e3)
                share.append(max(o["live_cost_s"] / sum(o["times"]) for o in outs))
            print(f"run {r + 1}/{a.runs} {case}: {slowest * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
    rows = []
    for case, ms in runs.items():
        rows.append({"case": f"torsh hook, {case}", "step_ms": statistics.median(ms), "p20_ms": quantile(ms, 0.2),
                     "p80_ms": quantile(ms, 0.8), "runs_ms": ms})  # fmt: skip
    ratios = [w / n for w, n in zip(runs["watched"], runs["not watched"])]
    return {
        "suite": "live",
        "mode": "overhead",
        "environment": environment(torch.device("cpu")),
        "settings": {
            "ranks": a.ranks,
            "steps": a.steps,
            "hidden": a.hidden,
            "compressor": a.compressor,
            "runs": a.runs,
        },
        "rows": rows,
        "overhead": {
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "live_ms_per_step_median": statistics.median(publish),
            "live_share_of_step_median": statistics.median(share),
            "live_share_of_step_max": max(share),
        },
    }


# -- the link change ----------------------------------------------------------------------------------------


BURST = "128kb"
"""The link-change runs' tbf burst: a token bucket of 512 KB (the emulated hosts' default) lets a compressed
step's few kilobytes through at any rate, as no real 100 Mbit/s path does, and would hide the slow link from
the probes; 128 KB still lets tbf reach 10 Gbit/s."""


def run_link_change(case: str, schedule: list[tuple[int, str]], *, steps: int, hidden: int, workdir: str,
                    candidates: list[str] | None = None, timeout: float = 900, burst: str = BURST) -> dict:  # fmt: skip
    """One case (a compressor name or "auto") on two emulated hosts whose rate follows ``schedule`` (rank 0's
    steps). Returns both ranks' records, the changes made (step, rate, unix time) and rank 0's result."""
    from ...profiling.top import DirSource
    from .emulated import emulated_hosts, rank_environments, set_rate

    live = os.path.join(workdir, f"live-{case.replace(':', '_')}")
    result = os.path.join(workdir, f"result-{case.replace(':', '_')}.json")
    cmd = [sys.executable, "-m", "torsh_kernels.apps.bench.live", "--rank-mode", "--compressor", case, "--steps",
           str(steps), "--hidden", str(hidden), "--dir", live, "--result", result]  # fmt: skip
    if candidates:
        cmd += ["--candidates", ",".join(candidates)]
    changes = [(0, schedule[0][1], time.time())]
    with emulated_hosts(schedule[0][1], burst=burst) as hosts:
        envs = rank_environments(hosts)
        logs = [tempfile.TemporaryFile("w+") for _ in range(2)]  # noqa: SIM115 (read after the ranks exit)
        procs = [subprocess.Popen(["ip", "netns", "exec", hosts.namespaces[r], *cmd], env=envs[r], stdout=logs[r],
                                  stderr=subprocess.STDOUT) for r in (0, 1)]  # fmt: skip
        todo = list(schedule[1:])
        tail = DirSource(live)  # rank 0's progress, read as torsh top reads it (only the new lines each time)
        step = -1
        t_end = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > t_end:
                    raise InvalidArgumentError(f"link change {case}: the ranks ran past {timeout} s")
                if todo:
                    if os.path.isdir(live):
                        step = max([r["step"] for r in tail.read() if r["rank"] == 0], default=step)
                    if step + 1 >= todo[0][0]:  # rank 0 finished the step before the change's
                        s, rate = todo.pop(0)
                        set_rate(hosts, rate)
                        changes.append((s, rate, time.time()))
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        rcs = [p.wait() for p in procs]
        if any(rcs):
            out = []
            for r, log in enumerate(logs):
                log.seek(0)
                out.append(f"rank {r} (exit {rcs[r]}):\n{log.read()[-4000:]}")
            raise InvalidArgumentError(f"link change {case}: a rank failed\n" + "\n".join(out))
    with open(result) as f:
        res = json.load(f)
    recs = DirSource(live).read()
    return {"case": case, "changes": changes, "result": res,
            "records": {r: [x for x in recs if x["rank"] == r] for r in (0, 1)}}  # fmt: skip


def switches(run: dict) -> dict[int, list[dict]]:
    """Each rank's switch records: {"step", "time", "from", "to"}."""
    return {r: [{"step": x["step"], "time": x["time"], **{k: x["switch"][k] for k in ("from", "to")}}
                for x in recs if x.get("switch")] for r, recs in run["records"].items()}  # fmt: skip


def link_change(a: argparse.Namespace) -> dict:
    schedule = parse_schedule(a.link_change)
    workdir = tempfile.mkdtemp(prefix="torsh-link-change-")
    cands = [c for c in a.candidates.split(",")] if a.candidates else None
    auto = run_link_change("auto", schedule, steps=a.steps, hidden=a.hidden, workdir=workdir, candidates=cands)
    sw = switches(auto)
    slow_choice = next((s["to"] for s in sw[0] if s["from"] != s["to"]), None)
    fixed = [c.strip() for c in a.fixed.split(",")] if a.fixed else ["none"] + ([slow_choice] if slow_choice else [])
    runs = [auto] + [run_link_change(c, schedule, steps=a.steps, hidden=a.hidden, workdir=workdir) for c in fixed]
    # auto's reaction to each change: the first switch at or after it, per rank
    reactions = []
    for s, rate, t in auto["changes"][1:]:
        per = {}
        for r, lst in sw.items():
            first = next((x for x in lst if x["step"] >= s - 1), None)
            per[r] = None if first is None else {"step": first["step"], "steps_after": first["step"] - s + 1,
                                                 "seconds_after": first["time"] - t, "to": first["to"]}  # fmt: skip
        reactions.append({"change_step": s, "rate": rate, "ranks": per})
    # per phase: every case's median step time over the same steps, from 2 steps after auto's switch in the
    # phase (20 steps after the phase's start where auto kept its choice) to the next change
    bounds = [s for s, _, _ in auto["changes"]] + [a.steps]
    phases = []
    for i, (s, rate, _) in enumerate(auto["changes"]):
        end = bounds[i + 1]
        sw_here = [x["step"] for x in sw[0] if s - 1 <= x["step"] < end]
        start = min(end - 1, sw_here[0] + 2 if sw_here else s + 20)
        row = {"rate": rate, "steps": [start, end]}
        for run in runs:
            recs = run["records"][0]
            st = [x["step_s"] * 1e3 for x in recs if start <= x["step"] < end and x["step_s"]]
            used = [x["compressor"] for x in recs if start <= x["step"] < end]
            row[run["case"]] = {
                "median_ms": statistics.median(st) if st else None,
                "p20_ms": quantile(st, 0.2) if st else None,
                "p80_ms": quantile(st, 0.8) if st else None,
                "compressor": max(set(used), key=used.count) if used else None,
            }
        phases.append(row)
    return {
        "suite": "live",
        "mode": "link-change",
        "environment": environment(torch.device("cpu")),
        "settings": {"schedule": a.link_change, "steps": a.steps, "hidden": a.hidden, "fixed": fixed},
        "switches": sw,
        "reactions": reactions,
        "phases": phases,
        "accuracy": {run["case"]: run["result"]["accuracy"] for run in runs},
        "auto": auto["result"]["stats"].get("auto"),
    }


# -- the command --------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    at_least_1 = cli_common.int_at_least(1)
    ap.add_argument("--ranks", type=at_least_1, default=2, help="local ranks of the overhead runs (default 2)")
    ap.add_argument("--steps", type=at_least_1, default=None, help="steps per run (default 100; --link-change 200)")
    ap.add_argument("--hidden", type=at_least_1, default=None,
                    help="the MLP's width (default 512; --link-change 1024)")  # fmt: skip
    ap.add_argument("--compressor", default="int8", help="the overhead runs' compressor (default int8)")
    ap.add_argument("--runs", type=at_least_1, default=6, help="overhead runs of each case, interleaved (default 6)")
    ap.add_argument(
        "--link-change",
        nargs="?",
        const=SCHEDULE,
        default=None,
        metavar="SCHEDULE",
        help=f"(root) auto on two emulated hosts whose link changes: RATE,RATE@STEP,... (default {SCHEDULE})",
    )
    ap.add_argument(
        "--fixed",
        default=None,
        help="--link-change: fixed compressors to compare (default: none and auto's slow-link choice)",
    )
    ap.add_argument("--candidates", default=None, help="--link-change: auto's candidates (default: its own)")
    cli_common.add_json(ap, "the results")
    # one rank of --link-change (started by this command in each namespace)
    ap.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)


def _rank_mode(a: argparse.Namespace) -> int:
    from ...collectives import init_from_env
    from ...profiling.live import watch

    torch.set_num_threads(1)
    comm = init_from_env("gloo", timeout=300)
    cands = a.candidates.split(",") if a.candidates else None
    with watch(dir=a.dir, job=f"link-change-{a.compressor}"):
        out = train(comm, compressor=a.compressor, steps=a.steps, hidden=a.hidden, auto_candidates=cands)
    if comm.rank == 0:
        with open(a.result, "w") as f:
            json.dump(out, f)
    torch.distributed.destroy_process_group()
    return 0


def run(a: argparse.Namespace) -> int:
    if a.rank_mode:
        return _rank_mode(a)
    if a.link_change is not None:
        a.steps = a.steps or 200
        a.hidden = a.hidden or 1024
        from .emulated import unavailable_reason

        why = unavailable_reason()
        if why is not None:
            raise cli_common.UsageError(f"--link-change needs two emulated hosts: {why}")
        doc = link_change(a)
        for rc in doc["reactions"]:
            for r, x in rc["ranks"].items():
                what = "no switch" if x is None else (f"switched to {x['to']} {x['steps_after']} steps, "
                                                      f"{x['seconds_after']:.2f} s after")  # fmt: skip
                print(f"link -> {rc['rate']} at step {rc['change_step']}: rank {r} {what}")
        for ph in doc["phases"]:
            cells = ", ".join(f"{k} {v['median_ms']:.1f} ms ({v['compressor']})" for k, v in ph.items()
                              if isinstance(v, dict) and v.get("median_ms") is not None)  # fmt: skip
            print(f"{ph['rate']:>8} steps {ph['steps'][0]}-{ph['steps'][1]}: {cells}")
        print("accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in doc["accuracy"].items()))
    else:
        a.steps = a.steps or 100
        a.hidden = a.hidden or 512
        doc = overhead(a)
        for r in doc["rows"]:
            print(f"{r['case']:<28} {r['step_ms']:8.2f} ms/step  [p20 {r['p20_ms']:.2f}, p80 {r['p80_ms']:.2f}]")
        o = doc["overhead"]
        print(
            f"watched / not watched: {o['ratio_median']:.4f} (min {o['ratio_min']:.4f}, max {o['ratio_max']:.4f}); "
            f"the live metrics' own host time {o['live_ms_per_step_median']:.3f} ms per step, "
            f"{o['live_share_of_step_median'] * 100:.2f}% of the step (max {o['live_share_of_step_max'] * 100:.2f}%)"
        )
    if a.json:
        cli_common.write_json(a.json, doc)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
