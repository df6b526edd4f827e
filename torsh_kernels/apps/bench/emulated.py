"""Two emulated hosts on one machine: network namespaces joined by a veth pair whose two ends are each
rate-limited by a ``tbf`` qdisc (each direction carries at most ``rate``), with an optional ``netem``
delay. ``run_on_emulated_hosts(cmd)`` runs ``cmd`` twice, as rank 0 in the first namespace and rank 1
in the second, with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME`` set as on two hosts, and removes the namespaces, the veth
pair and the qdiscs afterwards, whatever happens. Needs root, ``ip`` and ``tc``.

    sudo python -m torsh_kernels.apps.bench.emulated --rate 1gbit [--delay 1ms] -- COMMAND [ARGS...]

Rank 0 prints to the terminal; rank 1's output goes to a log file, shown if it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...errors import InvalidArgumentError

__all__ = ["EmulatedHosts", "emulated_hosts", "run_on_emulated_hosts", "unavailable_reason"]


@dataclass(frozen=True, slots=True)
class EmulatedHosts:
    namespaces: tuple[str, str]
    """The two network namespaces."""
    addresses: tuple[str, str]
    """Their IPv4 addresses on the veth link."""
    interfaces: tuple[str, str]
    """The veth ends (GLOO_SOCKET_IFNAME of each rank)."""
    description: str
    """One line: rate, burst, delay."""


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made here (None: they can)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces and qdiscs needs root (run with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def emulated_hosts(rate: str = "1gbit", *, delay: str | None = None, burst: str = "512kb") -> Iterator[EmulatedHosts]:
    """Create the two namespaces and the shaped link; remove them on exit."""
    why = unavailable_reason()
    if why is not None:
        raise InvalidArgumentError(f"emulated hosts: {why}")
    tag = f"t{os.getpid()}"
    ns = (f"torsh-h0-{tag}", f"torsh-h1-{tag}")
    ifs = (f"tv0{tag}"[:15], f"tv1{tag}"[:15])
    net = f"10.213.{os.getpid() % 200}"
    ips = (f"{net}.1", f"{net}.2")
    try:
        for n in ns:
            _run("ip", "netns", "add", n)
        _run("ip", "link", "add", ifs[0], "type", "veth", "peer", "name", ifs[1])
        for n, i, a in zip(ns, ifs, ips):
            _run("ip", "link", "set", i, "netns", n)
            _run("ip", "-n", n, "link", "set", "lo", "up")
            _run("ip", "-n", n, "addr", "add", f"{a}/24", "dev", i)
            _run("ip", "-n", n, "link", "set", i, "up")
            tbf = ["tbf", "rate", rate, "burst", burst, "latency", "100ms"]
            if delay:
                _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "root", "handle", "1:", "netem",
                     "delay", delay)  # fmt: skip
                _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "root", *tbf)
        desc = f"two network namespaces, veth pair, tbf {rate} per direction" + (f", delay {delay}" if delay else "")
        yield EmulatedHosts(ns, ips, ifs, desc)
    except subprocess.CalledProcessError as e:
        raise InvalidArgumentError(f"emulated hosts: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from e
    finally:
        for n in ns:
            pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for p in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(p), 9)
            # deleting a namespace removes its veth end, the peer and the qdiscs
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def run_on_emulated_hosts(
    cmd: Sequence[str], *, rate: str = "1gbit", delay: str | None = None, burst: str = "512kb", port: int = 29533
) -> int:
    """Run ``cmd`` as rank 0 and rank 1 on two emulated hosts; returns rank 0's exit code (or rank 1's
    if rank 0 succeeded and rank 1 did not)."""
    if not cmd:
        raise InvalidArgumentError("run_on_emulated_hosts: no command given")
    with emulated_hosts(rate, delay=delay, burst=burst) as hosts:
        print(f"emulated hosts: {hosts.namespaces[0]} ({hosts.addresses[0]}) <-> {hosts.namespaces[1]} "
              f"({hosts.addresses[1]}), {hosts.description}", file=sys.stderr)  # fmt: skip
        common = {
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": hosts.addresses[0],
            "MASTER_PORT": str(port),
            "TORSH_BENCH_NETWORK": hosts.description,
        }
        envs = [{**os.environ, **common, "RANK": str(r), "GLOO_SOCKET_IFNAME": hosts.interfaces[r]} for r in (0, 1)]
        with tempfile.NamedTemporaryFile("w+", prefix="torsh-rank1-", suffix=".log") as log:
            p1 = subprocess.Popen(["ip", "netns", "exec", hosts.namespaces[1], *cmd], env=envs[1], stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
            try:
                rc0 = subprocess.run(["ip", "netns", "exec", hosts.namespaces[0], *cmd], env=envs[0]).returncode
                rc1 = p1.wait(timeout=120 if rc0 == 0 else 10)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                p1.kill()
                rc0, rc1 = (rc0 if "rc0" in locals() else 130), p1.wait()
            if rc1 != 0:
                log.seek(0)
                print(f"rank 1 exited with {rc1}; its output:\n{log.read()}", file=sys.stderr)
    return rc0 if rc0 != 0 else rc1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torsh_kernels.apps.bench.emulated", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rate", default="1gbit", help="tbf rate per direction (tc syntax: 1gbit, 100mbit)")
    ap.add_argument("--delay", default=None, help="netem delay per direction (e.g. 1ms)")
    ap.add_argument("--burst", default="512kb", help="tbf burst")
    ap.add_argument("--port", type=int, default=29533, help="MASTER_PORT")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given; put it after --")
    why = unavailable_reason()
    if why is not None:
        print(f"emulated hosts: {why}", file=sys.stderr)
        return 2
    return run_on_emulated_hosts(cmd, rate=a.rate, delay=a.delay, burst=a.burst, port=a.port)


if __name__ == "__main__":
    sys.exit(main())
