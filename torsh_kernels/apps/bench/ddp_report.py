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
    t = cli_common.table((f"DDP step time, {res['world_size']} ranks ({res['backend']}, "
                          f"{env.get('network', 'local')}), "
                          f"MLP {cfg['in_dim']}-{'-'.join([str(cfg['width'])] * cfg['layers'])}-10, "
                    f"{rows[0]['gradient_bytes'] / 1e6:.1f} MB of gradients, batch {cfg['batch']}/rank"),
                   ["case", "buckets", "step (ms)", "p20-p80 (ms)", "bytes sent/step", "speedup vs no hook",
                    "vs torch PowerSGD"], text=("case", "buckets"))  # fmt: skip
    for r in rows:
        if r["error"]:
            t.add_row(f"{r['case']}: failed (below)", r["buckets"], "-", "-", "", "", "")
            continue
        wire = "-" if r["bytes_per_step"] is None else f"{r['bytes_per_step'] / 1e6:.2f} MB"
        vs = f"{peer / r['step_ms']:.2f}x" if peer and "powersgd" in r["case"] else ""
        case = r["case"] + (f" -> {r['chose']}" if r.get("chose") else "")
        t.add_row(case, r["buckets"], f"{r['step_ms']:.1f}", f"{r['p20_ms']:.1f}-{r['p80_ms']:.1f}", wire,
                  f"{base / r['step_ms']:.2f}x", vs)  # fmt: skip
    cli_common.console().print(t)
    for r in rows:
        if r["error"]:
            print(f"{r['case']} ({r['buckets']} buckets): {r['error']}")
    for name, d in res.get("speedups", {}).items():
        print(f"{name}: median {d['median']:.3f}x over {d['n']} runs [{d['min']:.3f}-{d['max']:.3f}]")
    for a in res.get("auto_vs_best", []):
        print(f"auto chose {a['chose']}: {a['auto_ms']:.1f} ms/step, {a['ratio']:.3f}x the best case measured in "
              f"the same run ({a['best_case']}, {a['best_ms']:.1f} ms/step)")  # fmt: skip
    acb = res.get("auto_choice_vs_best")
    if acb:
        for c in acb["choices"]:
            if c["ratio"] is not None:
                print(f"run {c['repeat']}: auto chose {c['chose']}, whose case measured "
                      f"{c['case_median_ms']:.1f} ms/step (median over the runs): {c['ratio']:.3f}x the best "
                      f"case ({c['best_case']}, {c['best_median_ms']:.1f} ms/step)")  # fmt: skip
    rec = next((r["auto"] for r in rows if r.get("auto")), None)
    if rec is not None:
        print(f"auto's reason: {rec['reason']}")
