"""What this machine can run, and for each thing it cannot, why and the command that would enable it.

Sections: the system (OS, CPU), the install (where torsh_kernels is imported from and how it is installed:
editable, a wheel, or a source tree on the path), the software (Python, torch, its CUDA build, the GPU
driver and NCCL; numpy, rich, cupy and the nvidia-* wheels), the ``TORSH_*``, ``TRITON_*``, ``NUMBA_*``
and ``NCCL_*`` variables that are set, the tuning cache and Numba's cache, the kernel providers (triton,
numba, cpu, torch) on CUDA and CPU tensors, a self-test (one tiny fused op per provider that can run here,
timed, checked against the torch reference), the transports (torch.distributed, NCCL through CuPy, RDMA
through pyverbs), the RDMA devices and ports the kernel exposes, whether network namespaces (the two
emulated hosts of ``benchmarks/emulated_hosts.sh``) can be made, and the compressors' names (what
``compressor=`` accepts). Nothing is connected; the exit status is 0 whatever is missing or fails.

On a terminal the sections are tables; piped or redirected, plain aligned text no wider than 100
columns. ``--bug-report`` prints a compact plain-text block to paste into an issue (no colour, no
borders). A provider that is not installed (triton on a CPU install) is reported as such, not imported.

torsh doctor [--json [PATH]] [--bug-report] [--no-self-test]   (--json alone: JSON on stdout, and nothing else)
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import textwrap
import time
from pathlib import Path

from .. import cli_common

ENV_PREFIXES = ("TORSH_", "TRITON_", "NUMBA_", "NCCL_")
"""The environment variables the report lists (those set)."""

PLAIN_WIDTH = 100
"""The widest line of the report when it is not printed on a terminal."""


def _driver() -> tuple[str | None, str]:
    """(the NVIDIA driver version, where it came from or why there is none)."""
    p = Path("/proc/driver/nvidia/version")
    if p.exists():
        lines = p.read_text().splitlines()
        for tok in (lines[0] if lines else "").split():
            if tok[:1].isdigit() and "." in tok:
                return tok, str(p)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0], "nvidia-smi"
    except (OSError, subprocess.SubprocessError):
        pass
    return None, "no NVIDIA driver (no /proc/driver/nvidia/version, no nvidia-smi)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _system() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"os": f"{platform.system()} {platform.release()}", "platform": platform.platform(),
            "machine": platform.machine(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
            "cpus_usable": usable}  # fmt: skip


def _install() -> dict:
    """Where torsh_kernels is imported from, and how it is installed (editable, a wheel, not at all)."""
    import torsh_kernels

    here = Path(torsh_kernels.__file__).resolve().parent
    found = []
    for d in metadata.distributions(name="torsh-kernels"):
        try:
            url = json.loads(d.read_text("direct_url.json") or "null")
        except ValueError:
            url = None
        if d.read_text("RECORD") is not None or url is not None:  # an installed dist-info (not a source egg-info)
            found.append((d, url))
    if not found:
        return {"path": str(here), "mode": "not installed: imported from a source tree (PYTHONPATH or the working "
                "directory)", "editable": False, "installed": False}  # fmt: skip
    d, url = found[0]
    editable = bool(url and url.get("dir_info", {}).get("editable"))
    if editable:
        src = str(url.get("url", "")).removeprefix("file://")
        mode = f"editable (pip install -e {src})"
        inside = not src or str(here).startswith(str(Path(src).resolve()))
    else:
        site = Path(d.locate_file("")).resolve()
        mode = f"installed ({d.version}) in {site}"
        inside = str(here).startswith(str(site))
    if not inside:
        mode += f"; but imported from {here}, which shadows it"
    return {"path": str(here), "mode": mode, "editable": editable, "installed": True}


def _packages() -> dict:
    """Versions of the packages around the library (None: not installed); cupy and nvidia-* by whatever
    distribution names are installed (cupy-cuda12x, nvidia-nccl-cu12, ...)."""
    out: dict[str, str | None] = {}
    for name in ("numpy", "rich", "triton", "numba"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    extra = {}
    for d in metadata.distributions():
        n = (d.metadata["Name"] or "").lower()
        if n.startswith(("cupy", "nvidia-")):
            extra[n] = d.version
    if not any(n.startswith("cupy") for n in extra):
        out["cupy"] = None
    out.update(sorted(extra.items()))
    return out


def _caches() -> dict:
    from ..ops.tuning import ENV_CACHE_DIR, cache_path

    tuning = cache_path()
    numba_dir = os.environ.get("NUMBA_CACHE_DIR")
    ops = Path(__file__).resolve().parent.parent / "ops"
    if numba_dir:
        numba = f"{numba_dir} (NUMBA_CACHE_DIR)"
    elif os.access(ops, os.W_OK):
        numba = f"{ops}/*/__pycache__ (next to the kernels' sources; NUMBA_CACHE_DIR moves it)"
    else:
        numba = "Numba's user cache directory (the sources' folder is not writable; NUMBA_CACHE_DIR moves it)"
    return {"tuning": str(tuning), "tuning_exists": tuning.is_file(),
            "tuning_from": ENV_CACHE_DIR if os.environ.get(ENV_CACHE_DIR) else "default", "numba": numba}  # fmt: skip


def _compressors() -> dict:
    from ..compression.names import AUTO, DEFAULT_CANDIDATE_NAMES, describe_names

    return {"names": [{"form": f, "what": w} for f, w in describe_names()], "auto": AUTO,
            "auto_candidates": list(DEFAULT_CANDIDATE_NAMES)}  # fmt: skip


def self_test(provider_info) -> list[dict]:
    """One tiny fused op per provider (``flatten`` of a 5- and a 3x7-element tensor scaled by 0.5, on CUDA
    tensors where CUDA is usable, else CPU), timed (the first call, compilation included, and a second
    call), checked element by element against the torch reference. A provider that cannot run here is
    skipped with its reason; nothing is imported for it."""
    import torch

    from ..ops import flatten

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, generator=gen).to(dev), torch.randn(3, 7, generator=gen).to(dev)]
    want = [x * 0.5 for x in xs]  # the torch reference (a power-of-two scale: exact)
    rows = []
    for p in provider_info.values():
        why = p.cuda if dev.type == "cuda" else p.cpu
        row = {"provider": p.name, "device": dev.type, "op": "flatten(scale=0.5)"}
        if why is not None:
            rows.append({**row, "status": "skipped", "first_ms": None, "ms": None, "detail": why})
            continue
        try:
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                flat, layout = flatten(xs, scale=0.5, provider=p.name)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append((time.perf_counter() - t0) * 1e3)
            got = layout.views(flat)
            bad = sum(int((g.view(w.shape) != w).sum()) for g, w in zip(got, want))
            status = "pass" if bad == 0 else "fail"
            detail = "matches the torch reference" if bad == 0 else f"{bad} element(s) differ from the torch reference"
        except Exception as e:  # a doctor reports what fails, whatever it is
            times, status, detail = [None, None], "fail", f"{type(e).__name__}: {cli_common.one_line(e)}"
        rows.append({**row, "status": status, "first_ms": times[0], "ms": times[1], "detail": detail})
    return rows


def collect(*, run_self_test: bool = True) -> dict:
    """Everything the report shows, as plain data."""
    import torch

    from .. import __version__, providers
    from ..collectives.rdma import sysfs_devices
    from ..collectives.transports import namespaces_supported, torch_nccl_version, transports

    driver, driver_src = _driver()
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = torch_nccl_version()
    software = {
        "torsh_kernels": __version__, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpus": gpus, "driver": driver, "driver_source": driver_src, "torch_nccl": nccl,
    }  # fmt: skip
    provs = []
    for p in providers().values():
        provs.append({"name": p.name, "version": p.version, "mode": p.mode, "cuda": p.cuda, "cpu": p.cpu,
                      "available": p.available})  # fmt: skip
    ok, why = namespaces_supported()
    info = providers()
    return {
        "system": _system(),
        "install": _install(),
        "software": software,
        "packages": _packages(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "caches": _caches(),
        "providers": provs,
        "self_test": self_test(info) if run_self_test else None,
        "compressors": _compressors(),
        "transports": [t.as_dict() for t in transports()],
        "rdma_ports": sysfs_devices(),
        "network_namespaces": {"available": ok, "detail": why},
    }


def _yes(reason: str | None) -> str:
    return "yes" if reason is None else f"no: {reason}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _sections(d: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report as (title, column names, rows of strings): the one content both renderings show."""
    s, sy, ins = d["software"], d.get("system"), d.get("install")
    out = []
    if sy:
        out.append(("system", ["", ""], [["OS", f"{sy['os']} ({sy['platform']})"],
                                         ["CPU", f"{sy['cpu']}, {sy['machine']}, {sy['cpus']} cores "
                                                 f"({sy['cpus_usable']} usable by this process)"]]))  # fmt: skip
    rows = [["torsh-kernels", s["torsh_kernels"]]]
    if ins:
        rows += [["imported from", ins["path"]], ["install", ins["mode"]]]
    build = s["torch_cuda_build"] or "none, CPU only"
    rows += [["python", s["python"]], ["torch", f"{s['torch']} (CUDA build: {build})"],
             ["GPUs", ", ".join(s["gpus"]) or "none"], ["driver", s["driver"] or s["driver_source"]],
             ["torch's NCCL", s["torch_nccl"] or "n/a"]]  # fmt: skip
    rows += [[k, v or "not installed"] for k, v in (d.get("packages") or {}).items()]
    out.append(("software", ["", ""], rows))
    env = d.get("environment")
    if env is not None:
        out.append(("environment (TORSH_*, TRITON_*, NUMBA_*, NCCL_* that are set)", ["", ""],
                    [[k, v] for k, v in env.items()] or [["(none set)", ""]]))  # fmt: skip
    c = d.get("caches")
    if c:
        out.append(("caches", ["", ""], [
            ["tuning cache", f"{c['tuning']} ({'present' if c['tuning_exists'] else 'absent'}"
                             f"{', from ' + c['tuning_from'] if c['tuning_from'] != 'default' else ''})"],
            ["Numba cache", c["numba"]]]))  # fmt: skip
    out.append(("kernel providers", ["provider", "version", "CUDA tensors", "CPU tensors", "mode"],
                [[p["name"], p["version"] or "not installed", _yes(p["cuda"]), _yes(p["cpu"]), p["mode"]]
                 for p in d["providers"]]))  # fmt: skip
    if d.get("self_test") is not None:
        out.append(("self-test (one tiny op per provider, against the torch reference)",
                    ["provider", "device", "result", "first ms", "ms", "detail"],
                    [[r["provider"], r["device"], r["status"], _ms(r["first_ms"]), _ms(r["ms"]), r["detail"]]
                     for r in d["self_test"]]))  # fmt: skip
    out.append(("transports", ["transport", "available", "what was found / why not", "to enable"],
                [[t["name"], "yes" if t["available"] else "no", t["detail"], t["fix"] or "-"]
                 for t in d["transports"]]))  # fmt: skip
    if d["rdma_ports"]:
        out.append(("RDMA ports (/sys/class/infiniband)", ["device", "port", "state", "physical", "link layer", "rate"],
                    [[p["device"], str(p["port"]), p["state"], p["phys_state"], p["link_layer"], p["rate"]]
                     for p in d["rdma_ports"]]))  # fmt: skip
    else:
        out.append(("RDMA ports", ["", ""], [["(none)", "/sys/class/infiniband lists no device"]]))
    ns = d["network_namespaces"]
    out.append(("network namespaces (emulated hosts)", ["", ""],
                [["available" if ns["available"] else "not available", ns["detail"]]]))  # fmt: skip
    comp = d.get("compressors")
    if comp:
        rows = [[n["form"], n["what"]] for n in comp["names"]]
        rows.append([comp["auto"], "measure the job's link and candidates, then choose (the hook, the synchronizer); "
                     "default candidates: " + ", ".join(comp["auto_candidates"])])  # fmt: skip
        out.append(("compressors (compressor= accepts these names)", ["name", "what"], rows))
    return out


def _wrap(text: str, width: int, indent: int) -> list[str]:
    """``text`` folded at spaces to ``width`` columns, continuation lines indented (words never split)."""
    lines = textwrap.wrap(text, width, subsequent_indent=" " * indent, break_long_words=False,
                          break_on_hyphens=False) or [""]  # fmt: skip
    return lines


def render_plain(d: dict, width: int = PLAIN_WIDTH) -> str:
    """The report as plain aligned text, no line wider than ``width`` (but a single word longer than that):
    a section per heading; two-column sections as ``key  value``; in wider ones, a row's short values on
    its first line (``name: column value, ...``) and each long one on a line of its own."""
    out: list[str] = []
    for title, cols, rows in _sections(d):
        out.append(f"== {title}")
        if len(cols) == 2 and not cols[0]:
            kw = min(max((len(r[0]) for r in rows), default=0), 30)
            for k, v in rows:
                out += _wrap(f"  {k:<{kw}}  {v}" if v else f"  {k}", width, kw + 4)
            out.append("")
            continue
        for r in rows:
            short = [f"{c} {v}" for c, v in zip(cols[1:], r[1:]) if len(v) <= 24 and v != "-"]
            out += _wrap(f"  {r[0]}: " + ", ".join(short), width, 4)
            for c, v in zip(cols[1:], r[1:]):
                if len(v) > 24:
                    out += _wrap(f"    {c}: {v}", width, 6)
        out.append("")
    return "\n".join(out)


def bug_report(d: dict) -> str:
    """A compact plain-text block to paste into an issue: versions, install, system, providers, the
    self-test, the variables set and the transports; no colour, no borders."""
    s, sy, ins, pk = d["software"], d["system"], d["install"], d["packages"]
    lines = [
        "```text",
        f"torsh-kernels {s['torsh_kernels']}: {ins['mode']}; imported from {ins['path']}",
        f"python {s['python']}; {sy['os']}; {sy['machine']}; {sy['cpu']}; {sy['cpus']} cores "
        f"({sy['cpus_usable']} usable)",
        f"torch {s['torch']} (CUDA build {s['torch_cuda_build'] or 'none'}); GPUs: {', '.join(s['gpus']) or 'none'}; "
        f"driver: {s['driver'] or 'none'}; torch NCCL: {s['torch_nccl'] or 'n/a'}",
        "packages: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in pk.items()),
        "providers: " + "; ".join(f"{p['name']} {p['version'] or 'not installed'} (cuda "
                                  f"{'yes' if p['cuda'] is None else 'no'}, cpu {'yes' if p['cpu'] is None else 'no'})"
                                  for p in d["providers"]),
    ]  # fmt: skip
    if d.get("self_test") is not None:
        lines.append("self-test: " + "; ".join(
            f"{r['provider']} {r['status']}" + (f" {_ms(r['ms'])} ms" if r["ms"] is not None else "")
            + (f" ({r['detail']})" if r["status"] == "fail" else "") for r in d["self_test"]))  # fmt: skip
    env = d["environment"]
    lines.append("env: " + (" ".join(f"{k}={v}" for k, v in env.items()) or "(no TORSH_/TRITON_/NUMBA_/NCCL_ set)"))
    lines.append(
        "transports: " + "; ".join(f"{t['name']} {'yes' if t['available'] else 'no'}" for t in d["transports"])
    )
    c = d["caches"]
    lines.append(f"caches: tuning {c['tuning']} ({'present' if c['tuning_exists'] else 'absent'})")
    lines.append("```")
    return "\n".join(lines)


def print_report(d: dict) -> None:
    """The report on stdout: tables on a terminal, plain aligned text elsewhere (see :func:`render_plain`)."""
    con = cli_common.console()
    if not con.is_terminal:
        print(render_plain(d))
        return
    from rich.table import Table
    from rich.text import Text

    for title, cols, rows in _sections(d):
        if len(cols) == 2 and not cols[0]:  # key and value: a borderless grid, values folded under themselves
            con.print(Text(title, style="bold"))
            g = Table.grid(padding=(0, 2))
            g.add_column(no_wrap=True)
            g.add_column(overflow="fold")
            for k, v in rows:
                g.add_row(Text("  " + k), Text(v))
            con.print(g)
            continue
        t = cli_common.table(title, cols, text=[c for c in cols if c not in ("first ms", "ms", "port")])
        for r in rows:
            t.add_row(*r)
        con.print(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli_common.add_json(p, "the report")
    p.add_argument("--bug-report", action="store_true",
                   help="print a compact plain-text block to paste into an issue instead of the report")  # fmt: skip
    p.add_argument("--no-self-test", action="store_true", help="skip the self-test (one tiny op per provider)")


def run(args: argparse.Namespace) -> int:
    d = collect(run_self_test=not getattr(args, "no_self_test", False))
    if args.json != "-":  # on stdout the JSON is the report: nothing else is printed
        if getattr(args, "bug_report", False):
            print(bug_report(d))
        else:
            print_report(d)
    cli_common.write_json(args.json, d)
    return 0
