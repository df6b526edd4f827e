"""What ``torsh bench ddp`` makes of its runs: the summaries over the repeats (the ratios against PyTorch's hooks,
``auto`` judged by its own steps, the bucket sweep's and the signature exchange's), and the tables it prints
(:mod:`~torsh_kernels.apps.bench.ddp` runs the cases)."""

from __future__ import annotations

from ... import cli_common
from .harness import run_spread

__all__ = [
    "AUTO_HORIZON",
    "LIKE_FOR_LIKE",
    "auto_summary",
    "fmt_spread",
    "print_report",
    "print_signatures",
    "print_sweep",
    "signature_summary",
    "summaries",
]


def fmt_spread(d: dict | None, digits: int = 2) -> str:
    """A spread (median, min, max, n) as ``median [min-max]`` (the median alone for one run; ``-`` for none)."""
    if d is None:
        return "-"
    if d["n"] == 1:
        return f"{d['median']:.{digits}f}"
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"


def print_signatures(res: dict, env: dict, cfg: dict) -> None:
    mlp = f"{cfg['in_dim']}-{'-'.join([str(cfg['width'])] * cfg['layers'])}-10"
    t = cli_common.table((f"Signature exchange on vs off, DDP with compression_hook, {res['world_size']} ranks "
                    f"({res['backend']}, {env.get('network', 'local')}), MLP {mlp}, "
                    f"{res['signature_rows'][0]['gradient_bytes'] / 1e6:.1f} MB of gradients; medians over "
                    f"{cfg['repeat']} run(s) [min-max]"),
                   ["case", "exchanges", "exchange ms", "steps 0-1 on (ms)", "steps 0-1 off (ms)", "extra (ms)",
                    "step on (ms)", "step off (ms)", "on / off"], text=("case",))  # fmt: skip

    f = fmt_spread

    for r in res["signature_summary"]:
        t.add_row(r["case"], f(r["signature_checks"], 0), f(r["signature_ms"]), f(r["first_steps_ms_on"], 1),
                  f(r["first_steps_ms_off"], 1), f(r["first_steps_extra_ms"], 1), f(r["step_ms_on"], 1),
                  f(r["step_ms_off"], 1), f(r["step_ratio"], 3))  # fmt: skip
    cli_common.console().print(t)
    for r in res["signature_rows"]:
        if r["error"]:
            print(f"{r['case']} (check {'on' if r['check'] else 'off'}): {r['error']}")


def print_sweep(res: dict, env: dict, cfg: dict) -> None:
    t = cli_common.table((f"DDP host cost per bucket, {res['world_size']} ranks ({res['backend']}, "
                     f"{env.get('network', 'local')}), "
                     f"MLP {cfg['in_dim']}-{cfg['sweep_width']}x{cfg['sweep_layers']}-10, "
                     f"{res['bucket_rows'][0]['gradient_bytes'] / 1e6:.1f} MB of gradients; medians over "
                     f"{cfg['repeat']} run(s) [min-max]; hook = CPU time inside the hook"),
                   ["case", "buckets", "step (ms)", "hook / step (ms)", "hook / bucket (ms)", "one more bucket (ms)"],
                   text=("case",))  # fmt: skip

    f = fmt_spread

    for r in res["bucket_summary"]:
        t.add_row(r["case"], str(r["buckets"]), f(r["step_ms"], 1), f(r["hook_ms_per_step"]),
                  f(r["hook_ms_per_bucket"], 3), f(r["marginal_ms_per_bucket"], 3))  # fmt: skip
    cli_common.console().print(t)


def print_report(res: dict, env: dict, cfg: dict) -> None:
    rows = res["rows"]
    base = next(r["step_ms"] for r in rows if r["case"] == "no hook")
    peer = next((r["step_ms"] for r in rows if r["case"] == "torch powersgd-1bucket"), None)
    measured = any(r.get("wire_sent_per_step") is not None for r in rows)
    params = next((r.get("parameters") for r in rows if r.get("parameters")), None)
    size = f"{params / 1e6:.1f}M parameters, " if params else ""
    t = cli_common.table((f"DDP step time, {res['world_size']} ranks ({res['backend']}, "
                          f"{env.get('network', 'local')}), "
                          f"MLP {cfg['in_dim']}-{'-'.join([str(cfg['width'])] * cfg['layers'])}-10 ({size}"
                    f"{rows[0]['gradient_bytes'] / 1e6:.1f} MB of fp32 gradients), batch {cfg['batch']}/rank"),
                   ["case", "buckets", "step (ms)", "p20-p80 (ms)", "sent/step, formula",
                    "sent/step, interface" if measured else "sent/step, interface (emulated hosts only)",
                    "speedup vs no hook", "vs torch PowerSGD 1 bucket"], text=("case", "buckets"))  # fmt: skip
    for r in rows:
        if r["error"]:
            t.add_row(f"{r['case']}: failed (below)", r["buckets"], "-", "-", "", "", "", "")
            continue
        wire = "-" if r.get("wire_formula_per_step") is None else f"{r['wire_formula_per_step'] / 1e6:.2f} MB"
        sent = "-" if r.get("wire_sent_per_step") is None else f"{r['wire_sent_per_step'] / 1e6:.2f} MB"
        vs = f"{peer / r['step_ms']:.2f}x" if peer and "powersgd" in r["case"] else ""
        case = r["case"] + (f" -> {r['chose']}" if r.get("chose") else "")
        t.add_row(case, r["buckets"], f"{r['step_ms']:.1f}", f"{r['p20_ms']:.1f}-{r['p80_ms']:.1f}", wire, sent,
                  f"{base / r['step_ms']:.2f}x", vs)  # fmt: skip
    cli_common.console().print(t)
    print("sent, formula: what each rank sends per step by the collectives' algorithms (torsh's traffic counters; "
          "DDP's ring all-reduce); sent, interface: what its network interface carried (the kernel's counters: "
          "headers, ACKs, gloo's own messages and auto's link probes included). The payload handed to the "
          "collectives is bytes_per_step in the JSON")  # fmt: skip
    print("cases and their settings:")
    for r in rows:
        if r.get("repeat", 0) == 0 and r.get("setting"):
            print(f"  {r['case']}: {r['setting']}")
    for r in rows:
        if r["error"]:
            print(f"{r['case']} ({r['buckets']} buckets): {r['error']}")
    for name, d in res.get("speedups", {}).items():
        print(f"{name}: median {d['median']:.3f}x over {d['n']} runs [{d['min']:.3f}-{d['max']:.3f}] "
              f"({d.get('comparison', '')})")  # fmt: skip
    for a in res.get("auto_vs_best", []):
        dec = "" if a["decision_s"] is None else f", decision {a['decision_s']:.2f} s"
        be = a["break_even_steps_vs_no_hook"]
        be = "" if be is None else f"; its warm-up and decision paid back against no hook after {be:.0f} steps"
        print(f"run {a['repeat']}: auto chose {a['chose']}{dec}: steady step {a['auto_ms']:.1f} ms, {a['ratio']:.3f}x "
              f"the best case's ({a['best_case']}, {a['best_ms']:.1f} ms); these {a['run_steps']} steps "
              f"{a['auto_run_s']:.2f} s, {a['run_ratio']:.3f}x the best case's ({a['best_run_case']}, "
              f"{a['best_run_s']:.2f} s); over {a['horizon_steps']} steps {a['horizon_ratio']:.3f}x "
              f"({a['best_horizon_case']}){be}")  # fmt: skip
    v = res.get("auto_verdict")
    if v and v["ratio"]["n"] > 1:
        print("auto over the runs, median [min-max]: steady step " + fmt_spread(v["ratio"], 3)
              + "x the best case's; whole run " + fmt_spread(v["run_ratio"], 3) + "x; over "
              + f"{res['auto_vs_best'][0]['horizon_steps']} steps " + fmt_spread(v["horizon_ratio"], 3)
              + "x; decision " + fmt_spread(v["decision_s"], 2) + " s")  # fmt: skip
    rec = next((r["auto"] for r in rows if r.get("auto")), None)
    if rec is not None:
        print(f"auto's reason: {rec['reason']}")


def signature_summary(res: dict) -> None:
    """Per compressor: the exchange on against off, paired run by run."""
    out = []
    rows = res["signature_rows"]
    for case in dict.fromkeys(r["case"] for r in rows):
        on = {r["repeat"]: r for r in rows if r["case"] == case and r["check"] and not r["error"]}
        off = {r["repeat"]: r for r in rows if r["case"] == case and not r["check"] and not r["error"]}
        both = sorted(set(on) & set(off))
        out.append({
            "case": case,
            "step_ms_on": run_spread([on[k]["step_ms"] for k in both]),
            "step_ms_off": run_spread([off[k]["step_ms"] for k in both]),
            "step_ratio": run_spread([on[k]["step_ms"] / off[k]["step_ms"] for k in both]),
            "first_steps_ms_on": run_spread([sum(on[k]["first_steps_ms"]) for k in both]),
            "first_steps_ms_off": run_spread([sum(off[k]["first_steps_ms"]) for k in both]),
            "first_steps_extra_ms": run_spread([sum(on[k]["first_steps_ms"]) - sum(off[k]["first_steps_ms"])
                                             for k in both]),
            "signature_checks": run_spread([on[k]["signature_checks"] for k in both]),
            "signature_ms": run_spread([on[k]["signature_ms"] for k in both]),
            "signature_checks_off": run_spread([off[k]["signature_checks"] for k in both]),
        })  # fmt: skip
    res["signature_summary"] = out


def summaries(res: dict) -> None:
    """Medians over the repeats with their spread; for the sweep, the marginal cost of a bucket."""
    spread = run_spread
    if "bucket_rows" in res:
        rows = res["bucket_rows"]
        out = []
        for case in dict.fromkeys(r["case"] for r in rows):
            mine = [r for r in rows if r["case"] == case]
            ones = {r["repeat"]: r for r in mine if r["buckets_asked"] == 1}
            for nb in dict.fromkeys(r["buckets_asked"] for r in mine):
                rs = [r for r in mine if r["buckets_asked"] == nb]
                marg = [(r["hook_ms_per_step"] - ones[r["repeat"]]["hook_ms_per_step"]) / (r["buckets"] - 1)
                        for r in rs if r["repeat"] in ones and r["buckets"] > 1]  # fmt: skip
                out.append({"case": case, "buckets_asked": nb, "buckets": rs[0]["buckets"],
                            "step_ms": spread([r["step_ms"] for r in rs]),
                            "hook_ms_per_step": spread([r["hook_ms_per_step"] for r in rs]),
                            "hook_ms_per_bucket": spread([r["hook_ms_per_bucket"] for r in rs]),
                            "marginal_ms_per_bucket": spread(marg)})  # fmt: skip
        res["bucket_summary"] = out
        return
    rows = res["rows"]
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        out.append({"case": case, "step_ms": spread([r["step_ms"] for r in rows if r["case"] == case])})
    by = {}
    for r in rows:
        by.setdefault(r.get("repeat", 0), {})[r["case"]] = r["step_ms"]
    ratios = {}
    for (ours, theirs), how in LIKE_FOR_LIKE.items():
        v = [d[theirs] / d[ours] for d in by.values() if d.get(ours) and d.get(theirs)]
        if v:
            ratios[f"{theirs} / {ours}"] = {**spread(v), "comparison": how}
    res["summary"] = out
    res["speedups"] = ratios


LIKE_FOR_LIKE = {
    ("torsh fp16", "torch fp16"): "like for like: the same format, DDP's 25 MB buckets each",
    ("torsh bf16", "torch fp16"): "bf16 against PyTorch's fp16 hook (PyTorch's bf16 hook is the same arithmetic)",
    ("torsh powersgd-1bucket", "torch powersgd-1bucket"): "like for like: PowerSGD at the same rank and start "
    "iteration, one bucket each",
    ("torsh powersgd", "torch powersgd-1bucket"): "not like for like: ours with DDP's 25 MB buckets against "
    "PyTorch's with one bucket (its 25 MB-bucket case fails or hangs on gloo)",
}
"""The ratios ``summaries`` reports per run (PyTorch's step over ours), each with what it compares."""

AUTO_HORIZON = 1000
"""Steps over which ``auto``'s decision time is amortised in :func:`auto_summary`'s second verdict."""


def auto_summary(res: dict, rank: int) -> None:
    """``auto`` judged by its own steps, per run, against the best fixed case of the same run (no hook or one of
    ours): its steady step; the whole run (the same number of steps, the warm-up and its decision included); and
    a training run of :data:`AUTO_HORIZON` steps (the measured steps before the timed ones, then the steady step
    for the rest). Also the decision's own seconds (``measure_s``) and, against no hook, the step at which the
    decision has paid for itself."""
    rows = [r for r in res.get("rows", []) if r["step_ms"] is not None and r["error"] is None]
    runs = {}
    for r in rows:
        runs.setdefault(r.get("repeat", 0), []).append(r)
    out = []
    for rep, rs in sorted(runs.items()):
        auto = next((r for r in rs if r["case"] == "torsh auto"), None)
        pool = [r for r in rs if r["case"] == "no hook" or (r["case"].startswith("torsh ") and r is not auto)]
        if auto is None or not pool:
            continue

        def total(r: dict, steps: int) -> float:
            before = r.get("steps_before_ms") or []
            return sum(before) + (steps - len(before)) * r["step_ms"]

        n_run = len(auto.get("steps_before_ms") or []) + res.get("timed_steps", 0)
        best = min(pool, key=lambda r: r["step_ms"])
        best_run = min(pool, key=lambda r: total(r, n_run))
        best_h = min(pool, key=lambda r: total(r, AUTO_HORIZON))
        rec = auto.get("auto") or {}
        none = next((r for r in rs if r["case"] == "no hook"), None)
        break_even = None
        if none is not None and none["step_ms"] > auto["step_ms"]:  # steps until the decision has paid for itself
            extra = sum(auto.get("steps_before_ms") or []) - sum(none.get("steps_before_ms") or [])
            break_even = max(0.0, extra) / (none["step_ms"] - auto["step_ms"])
        out.append({
            "repeat": rep, "chose": auto["chose"], "decision_s": rec.get("measure_s"),
            "auto_ms": auto["step_ms"], "best_case": best["case"], "best_ms": best["step_ms"],
            "ratio": auto["step_ms"] / best["step_ms"],
            "run_steps": n_run, "auto_run_s": total(auto, n_run) / 1e3, "best_run_case": best_run["case"],
            "best_run_s": total(best_run, n_run) / 1e3, "run_ratio": total(auto, n_run) / total(best_run, n_run),
            "horizon_steps": AUTO_HORIZON, "best_horizon_case": best_h["case"],
            "horizon_ratio": total(auto, AUTO_HORIZON) / total(best_h, AUTO_HORIZON),
            "break_even_steps_vs_no_hook": break_even,
        })  # fmt: skip
    if out:
        res["auto_vs_best"] = out
        res["auto_verdict"] = {k: run_spread([a[k] for a in out]) for k in ("ratio", "run_ratio", "horizon_ratio",
                                                                          "decision_s")}  # fmt: skip
