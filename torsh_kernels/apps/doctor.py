"""What this machine can run, and for each thing it cannot, why and the command that would enable it.

Sections: the software (Python, torch, its CUDA build, the GPU driver and NCCL), the kernel providers
(triton, numba, cpu, torch) on CUDA and CPU tensors, the transports (torch.distributed, NCCL through
CuPy, RDMA through pyverbs), the RDMA devices and ports the kernel exposes, and whether network
namespaces (the two emulated hosts of ``benchmarks/emulated_hosts.sh``) can be made. Nothing is
initialised or connected; the exit status is 0 whatever is missing.

torsh doctor [--json [PATH]]     (--json alone: JSON on stdout, and nothing else)
"""

from __future__ import annotations

import argparse
import platform
import subprocess
from pathlib import Path

from .. import cli_common


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


def collect() -> dict:
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
    return {
        "software": software,
        "providers": provs,
        "transports": [t.as_dict() for t in transports()],
        "rdma_ports": sysfs_devices(),
        "network_namespaces": {"available": ok, "detail": why},
    }


def print_report(d: dict) -> None:
    from rich.markup import escape

    con = cli_common.console()
    s = d["software"]
    con.print(f"[bold]torsh-kernels {s['torsh_kernels']}[/] on Python {s['python']}, {s['platform']}")
    con.print(f"torch {s['torch']} (CUDA build: {s['torch_cuda_build'] or 'none, CPU only'}); GPUs: "
              f"{', '.join(s['gpus']) or 'none'}; driver: {s['driver'] or s['driver_source']}; torch's NCCL: "
              f"{s['torch_nccl'] or 'n/a'}")  # fmt: skip
    cols = ["provider", "version", "CUDA tensors", "CPU tensors", "mode"]
    t = cli_common.table("kernel providers", cols, text=cols)
    for p in d["providers"]:
        t.add_row(p["name"], p["version"] or "not installed", "yes" if p["cuda"] is None else f"no: {p['cuda']}",
                  "yes" if p["cpu"] is None else f"no: {p['cpu']}", p["mode"])  # fmt: skip
    con.print(t)
    cols = ["transport", "available", "what was found / why not", "to enable"]
    t = cli_common.table("transports", cols, text=cols)
    for tr in d["transports"]:
        t.add_row(tr["name"], "yes" if tr["available"] else "no", tr["detail"], tr["fix"] or "-")
    con.print(t)
    if d["rdma_ports"]:
        cols = ["device", "port", "state", "physical", "link layer", "rate"]
        t = cli_common.table("RDMA ports (/sys/class/infiniband)", cols, text=[c for c in cols if c != "port"])
        for p in d["rdma_ports"]:
            t.add_row(p["device"], str(p["port"]), p["state"], p["phys_state"], p["link_layer"], p["rate"])
        con.print(t)
    else:
        con.print("RDMA ports: none (/sys/class/infiniband lists no device)")
    ns = d["network_namespaces"]
    con.print(f"network namespaces (emulated hosts): {'yes' if ns['available'] else 'no'}: {escape(ns['detail'])}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli_common.add_json(p, "the report")


def run(args: argparse.Namespace) -> int:
    d = collect()
    if args.json != "-":  # on stdout the JSON is the report: nothing else is printed
        print_report(d)
    cli_common.write_json(args.json, d)
    return 0
