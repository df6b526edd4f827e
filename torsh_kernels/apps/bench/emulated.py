"""Two emulated hosts on one machine: network namespaces joined by a veth pair whose two ends are each
rate-limited by a ``tbf`` qdisc (each direction carries at most ``rate``), with an optional ``netem``
delay. ``run_on_emulated_hosts(cmd)`` runs ``cmd`` twice, as rank 0 in the first namespace and rank 1
in the second, with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME`` set as on two hosts, and removes the namespaces, the veth
pair and the qdiscs afterwards, whatever happens. Needs root, ``ip`` and ``tc``.

Rates are bits per second with the unit spelled out (:func:`parse_rate`: ``500kbit``, ``100mbit``, ``1gbit``,
``10gbit``) and are handed to ``tc`` in plain bits, so tc's own unit meanings (a bare number, ``gbps`` =
gigabytes per second) never apply; delays are ``us``, ``ms`` or ``s`` (:func:`parse_delay`). Each namespace
gets its own ``/etc/hosts`` (``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts) naming both
addresses (also IPv4-mapped), so a reverse look-up of the peer (c10d's, on every connection) answers from
the file instead of failing on a namespace with no route to a DNS server (c10d's ``hostname ... err=-3``
warning).

    sudo python -m torsh_kernels.apps.bench.emulated --rate 1gbit [--delay 1ms] -- COMMAND [ARGS...]

Rank 0 prints to the terminal; rank 1's output goes to a log file, shown if it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...errors import InvalidArgumentError

__all__ = [
    "RATE_FORMS",
    "EmulatedHosts",
    "LinkRate",
    "WireCounter",
    "emulated_hosts",
    "interface_bytes",
    "parse_delay",
    "parse_rate",
    "per_rank",
    "rank_environments",
    "run_on_emulated_hosts",
    "set_rate",
    "unavailable_reason",
    "wire_counter",
]

RATE_FORMS = "500kbit, 100mbit, 1gbit, 10gbit (a number, then kbit, mbit, gbit or tbit: bits per second)"
"""The link rates :func:`parse_rate` accepts, in words for error messages and help."""
_RATE_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?) ?(?P<prefix>[kmgt]?)bit(?:/s)?", re.IGNORECASE)
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BYTES_RE = re.compile(r"\d+(?:\.\d+)?\s*(?:[kmgt]i?)?(?:bps|b/s|bytes?(?:/s)?|b)", re.IGNORECASE)
_MIN_RATE, _MAX_RATE = 1_000, 10**13
_DELAY_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<unit>us|ms|s)")
_DELAY_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, slots=True)
class LinkRate:
    """A link rate, in bits per second (what :func:`parse_rate` returns)."""

    bits_per_s: int

    @property
    def tc(self) -> str:
        """The rate as ``tc`` reads it, in plain bits per second (no unit of tc's own applies)."""
        return f"{self.bits_per_s}bit"

    def __str__(self) -> str:
        for unit, scale in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
            if self.bits_per_s >= scale:
                return f"{self.bits_per_s / scale:g} {unit}"
        return f"{self.bits_per_s} bit/s"


def parse_rate(text: object, *, what: str = "rate") -> LinkRate:
    """A link rate written in bits per second with the unit spelled out: ``500kbit``, ``100mbit``, ``1gbit``,
    ``10gbit`` (any case, a decimal number, a space before the unit and ``/s`` after it are fine:
    ``2.5 Gbit/s``). A bare number, or a bytes-per-second spelling
    (``gbps``, ``GBps``, ``100mb``), raises :class:`~torsh_kernels.errors.InvalidArgumentError` naming the
    accepted forms: tc would read ``1000`` and ``10gbps`` by its own rules (bits, and gigabytes per second)."""
    if isinstance(text, LinkRate):
        return text
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{what}: expected a rate such as 100mbit, got {type(text).__name__} {text!r}")
    t = text.strip()
    m = _RATE_RE.fullmatch(t)
    if m is None:
        if re.fullmatch(r"\d+(?:\.\d+)?", t):
            hint = "a bare number has no unit"
        elif _BYTES_RE.fullmatch(t):
            hint = "that spells bytes per second (tc reads 10gbps as 80 Gbit/s)"
        else:
            hint = "not a rate"
        raise InvalidArgumentError(
            f"{what} {text!r}: {hint}; give bits per second with the unit spelled out: {RATE_FORMS}"
        )
    bits = round(float(m["num"]) * _PREFIX[m["prefix"].lower()])
    if not _MIN_RATE <= bits <= _MAX_RATE:
        raise InvalidArgumentError(f"{what} {text!r}: must be between 1kbit and 10tbit (bits per second), got "
                                   f"{LinkRate(bits)}")  # fmt: skip
    return LinkRate(bits)


def parse_delay(text: str, *, what: str = "delay") -> str:
    """A one-way delay: a number then ``us``, ``ms`` or ``s`` (``1ms``, ``250us``); returned in the form tc
    reads (microseconds, ``250us``). Anything else raises :class:`~torsh_kernels.errors.InvalidArgumentError`."""
    m = _DELAY_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise InvalidArgumentError(f"{what} {text!r}: give a number then us, ms or s (e.g. 250us, 1ms)")
    us = float(m["num"]) * _DELAY_UNIT[m["unit"]] * 1e6
    if not 0 <= us <= 10e6:
        raise InvalidArgumentError(f"{what} {text!r}: must be between 0 and 10 s")
    return format(us, "f").rstrip("0").rstrip(".") + "us"  # plain digits: 1 s is 1000000us, not 1e+06us


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
    burst: str = "512kb"
    """tbf's burst."""
    delay: str | None = None
    """The netem delay per direction (None: none)."""


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


def _hosts_file(names: Sequence[str], addresses: Sequence[str]) -> str:
    """A namespace's /etc/hosts: this machine's, then both emulated hosts by name, each also as the IPv4-mapped
    IPv6 address a dual-stack socket (c10d's TCPStore server) sees its peer at."""
    try:
        with open("/etc/hosts") as f:
            base = f.read()
    except OSError:
        base = "127.0.0.1 localhost\n"
    lines = "".join(f"{a} {n}\n::ffff:{a} {n}\n" for n, a in zip(names, addresses))
    return base.rstrip("\n") + "\n# torsh emulated hosts\n" + lines


@contextlib.contextmanager
def emulated_hosts(
    rate: str | LinkRate = "1gbit", *, delay: str | None = None, burst: str = "512kb"
) -> Iterator[EmulatedHosts]:
    """Create the two namespaces and the shaped link; remove them on exit. ``rate``: see :func:`parse_rate`;
    ``delay``: see :func:`parse_delay`; ``burst``: tbf's burst, in tc's syntax."""
    rate = parse_rate(rate)
    delay = parse_delay(delay) if delay is not None else None
    why = unavailable_reason()
    if why is not None:
        raise InvalidArgumentError(f"emulated hosts: {why}")
    tag = f"t{os.getpid()}"
    ns = (f"torsh-h0-{tag}", f"torsh-h1-{tag}")
    ifs = (f"tv0{tag}"[:15], f"tv1{tag}"[:15])
    net = f"10.213.{os.getpid() % 200}"
    ips = (f"{net}.1", f"{net}.2")
    made_netns_dir = not os.path.isdir("/etc/netns")
    try:
        try:
            _setup(ns, ifs, ips, rate, delay, burst)
        except subprocess.CalledProcessError as e:
            raise InvalidArgumentError(f"emulated hosts: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from e
        except OSError as e:  # e.g. a read-only /etc
            raise InvalidArgumentError(f"emulated hosts: {e}") from e
        desc = f"two network namespaces, veth pair, tbf {rate} per direction" + (f", delay {delay}" if delay else "")
        yield EmulatedHosts(ns, ips, ifs, desc, burst, delay)
    finally:
        for n in ns:
            pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for p in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(p), 9)
            # deleting a namespace removes its veth end, the peer and the qdiscs
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
            shutil.rmtree(f"/etc/netns/{n}", ignore_errors=True)
        if made_netns_dir:
            with contextlib.suppress(OSError):
                os.rmdir("/etc/netns")  # made here, and empty: left as found


def _setup(ns, ifs, ips, rate: LinkRate, delay: str | None, burst: str) -> None:
    """The namespaces (each with its hosts file), the veth pair and the qdiscs."""
    for n in ns:
        _run("ip", "netns", "add", n)
        os.makedirs(f"/etc/netns/{n}", exist_ok=True)
        with open(f"/etc/netns/{n}/hosts", "w") as f:
            f.write(_hosts_file(ns, ips))
    _run("ip", "link", "add", ifs[0], "type", "veth", "peer", "name", ifs[1])
    for n, i, a in zip(ns, ifs, ips):
        _run("ip", "link", "set", i, "netns", n)
        _run("ip", "-n", n, "link", "set", "lo", "up")
        _run("ip", "-n", n, "addr", "add", f"{a}/24", "dev", i)
        _run("ip", "-n", n, "link", "set", i, "up")
        tbf = ["tbf", "rate", rate.tc, "burst", burst, "latency", "100ms"]
        if delay:
            _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "root", "handle", "1:", "netem",
                 "delay", delay)  # fmt: skip
            _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "root", *tbf)


def set_rate(hosts: EmulatedHosts, rate: str | LinkRate) -> LinkRate:
    """Change the link's rate under whatever runs on it (``tc qdisc change`` of both ends' tbf, per direction);
    connections stay up. Returns the rate set."""
    rate = parse_rate(rate)
    tbf = ["tbf", "rate", rate.tc, "burst", hosts.burst, "latency", "100ms"]
    where = ["parent", "1:1", "handle", "10:"] if hosts.delay else ["root"]
    try:
        for n, i in zip(hosts.namespaces, hosts.interfaces):
            _run("ip", "netns", "exec", n, "tc", "qdisc", "change", "dev", i, *where, *tbf)
    except subprocess.CalledProcessError as e:
        raise InvalidArgumentError(f"emulated hosts: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from e
    return rate


def rank_environments(hosts: EmulatedHosts, port: int = 29533) -> list[dict[str, str]]:
    """torchrun's environment of rank 0 and rank 1 on the two hosts (this process's, plus the ranks' own)."""
    common = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": hosts.addresses[0],
        "MASTER_PORT": str(port),
        "TORSH_BENCH_NETWORK": hosts.description,
    }
    return [{**os.environ, **common, "RANK": str(r), "GLOO_SOCKET_IFNAME": hosts.interfaces[r]} for r in (0, 1)]


def interface_bytes(interface: str) -> tuple[int, int]:
    """(received, sent) bytes of ``interface`` in this process's network namespace: the kernel's counters in
    ``/proc/self/net/dev`` (whole Ethernet frames: payload plus the TCP/IP and Ethernet headers, ACKs
    included). A missing interface raises :class:`~torsh_kernels.errors.InvalidArgumentError`."""
    try:
        with open("/proc/self/net/dev") as f:
            lines = f.read().splitlines()[2:]
    except OSError as e:
        raise InvalidArgumentError(f"interface counters: cannot read /proc/self/net/dev: {e}") from e
    for line in lines:
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            v = fields.split()
            return int(v[0]), int(v[8])
    raise InvalidArgumentError(f"interface counters: no interface {interface!r} in this network namespace")


class WireCounter:
    """The bytes this rank's network interface carried: on an emulated host the veth end that only this rank
    uses, so its counters are this rank's traffic, measured by the kernel rather than a formula. ``start()``,
    then ``read()`` gives ``{"sent": ..., "received": ...}`` since the start. Made by :func:`wire_counter`."""

    def __init__(self, interface: str) -> None:
        self.interface = interface
        self._at = interface_bytes(interface)

    def start(self) -> None:
        self._at = interface_bytes(self.interface)

    def read(self) -> dict[str, int]:
        rx, tx = interface_bytes(self.interface)
        return {"sent": tx - self._at[1], "received": rx - self._at[0]}


def per_rank(comm, values: Sequence[float] | None) -> list[list[float]] | None:
    """Every rank's ``values`` (a collective call: every rank calls it, with as many values or None), as one list
    per rank; None unless every rank had values (a rank without its own interface counts nothing). The suites pass
    what their :class:`WireCounter` read, per step or per call."""
    import torch

    dev = getattr(comm, "device", None)  # a transport's collectives may take only its device's tensors
    n = len(values) if values is not None else 0
    width = torch.tensor([float(n), float(-n)], dtype=torch.float64, device=dev)
    comm.all_reduce(width, "max")  # the widest, and minus the narrowest: equal when every rank has values
    w = int(width[0].item())
    if w == 0 or int(-width[1].item()) != w:
        return None
    v = torch.zeros(comm.world_size * w, dtype=torch.float64, device=dev)
    v[comm.rank * w : (comm.rank + 1) * w] = torch.tensor(list(values), dtype=torch.float64, device=dev)
    comm.all_reduce(v, "sum")
    return v.view(comm.world_size, w).cpu().tolist()


def wire_counter() -> WireCounter | None:
    """A :class:`WireCounter` on this rank's own interface where it has one: ``GLOO_SOCKET_IFNAME`` names an
    interface other than loopback that exists here (on the emulated hosts, each rank's veth end). None
    elsewhere: on loopback every rank, the rendezvous store and the rest of the machine share ``lo``, so its
    counters are nobody's traffic in particular."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if not name or name == "lo" or not sys.platform.startswith("linux"):
        return None
    try:
        return WireCounter(name)
    except InvalidArgumentError:
        return None


def run_on_emulated_hosts(
    cmd: Sequence[str],
    *,
    rate: str | LinkRate = "1gbit",
    delay: str | None = None,
    burst: str = "512kb",
    port: int = 29533,
) -> int:
    """Run ``cmd`` as rank 0 and rank 1 on two emulated hosts; returns rank 0's exit code (or rank 1's
    if rank 0 succeeded and rank 1 did not). ``rate`` and ``delay`` are checked before anything is made.
    A ``KeyboardInterrupt`` stops both ranks, removes the hosts and propagates."""
    if not cmd:
        raise InvalidArgumentError("run_on_emulated_hosts: no command given")
    rate = parse_rate(rate)
    delay = parse_delay(delay) if delay is not None else None
    with emulated_hosts(rate, delay=delay, burst=burst) as hosts:
        print(f"emulated hosts: {hosts.namespaces[0]} ({hosts.addresses[0]}) <-> {hosts.namespaces[1]} "
              f"({hosts.addresses[1]}), {hosts.description}", file=sys.stderr)  # fmt: skip
        envs = rank_environments(hosts, port)
        with tempfile.NamedTemporaryFile("w+", prefix="torsh-rank1-", suffix=".log") as log:
            p1 = subprocess.Popen(["ip", "netns", "exec", hosts.namespaces[1], *cmd], env=envs[1], stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
            try:
                rc0 = subprocess.run(["ip", "netns", "exec", hosts.namespaces[0], *cmd], env=envs[0]).returncode
                rc1 = p1.wait(timeout=120 if rc0 == 0 else 10)
            except KeyboardInterrupt:  # Ctrl-C: both ranks stop, the caller says so once (no rank-1 log)
                p1.kill()
                p1.wait()
                raise
            except subprocess.TimeoutExpired:
                p1.kill()
                rc1 = p1.wait()
            if rc1 != 0:
                log.seek(0)
                print(f"rank 1 exited with {rc1}; its output:\n{log.read()}", file=sys.stderr)
    return rc0 if rc0 != 0 else rc1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torsh_kernels.apps.bench.emulated", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rate", default="1gbit", help=f"rate per direction, in bits per second: {RATE_FORMS}")
    ap.add_argument("--delay", default=None, help="netem delay per direction: a number then us, ms or s (e.g. 1ms)")
    ap.add_argument("--burst", default="512kb", help="tbf burst")
    ap.add_argument("--port", type=int, default=29533, help="MASTER_PORT")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given; put it after --")
    try:
        rate = parse_rate(a.rate, what="--rate")
        delay = parse_delay(a.delay, what="--delay") if a.delay is not None else None
    except InvalidArgumentError as e:
        ap.error(str(e))
    why = unavailable_reason()
    if why is not None:
        print(f"emulated hosts: {why}", file=sys.stderr)
        return 2
    try:
        return run_on_emulated_hosts(cmd, rate=rate, delay=delay, burst=a.burst, port=a.port)
    except KeyboardInterrupt:
        print("emulated hosts: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
