"""What ``torsh bench ddp`` prints: the step-time table, the bucket sweep's and the signature exchange's
(:mod:`~torsh_kernels.apps.bench.ddp` runs the cases and summarises them)."""

from __future__ import annotations

from ... import cli_common

__all__ = ["fmt_spread", "print_report", "print_signatures", "print_sweep"]


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
