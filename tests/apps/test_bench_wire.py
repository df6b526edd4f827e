"""The benchmarks' wire counter: the bytes a rank's own network interface carried, from the kernel's counters
(``emulated.wire_counter``), checked against a known transfer between two emulated hosts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torsh_kernels.apps.bench import emulated
from torsh_kernels.errors import InvalidArgumentError


def test_interface_bytes_reads_loopback_and_refuses_an_unknown_interface():
    rx, tx = emulated.interface_bytes("lo")
    assert rx >= 0 and tx >= 0
    with pytest.raises(InvalidArgumentError, match="no interface 'torsh-none0'"):
        emulated.interface_bytes("torsh-none0")


@pytest.mark.parametrize("name", [None, "", "lo", "torsh-none0"])
def test_no_counter_where_no_interface_is_the_rank_s_own(monkeypatch, name):
    # loopback carries every rank and the rest of the machine; an interface that is not here counts nothing
    if name is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    assert emulated.wire_counter() is None


_SENDER = textwrap.dedent("""
    import json, os, socket, sys, time
    from torsh_kernels.apps.bench.emulated import wire_counter
    c = wire_counter()
    assert c is not None, "no counter on " + os.environ.get("GLOO_SOCKET_IFNAME", "")
    for attempt in range(100):
        try:
            s = socket.create_connection((sys.argv[1], 29611))
            break
        except OSError:
            time.sleep(0.05)
    c.start()
    s.sendall(b"x" * int(sys.argv[2]))
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the receiver's byte: everything has arrived
    s.close()
    print(json.dumps(c.read()))
""")
_RECEIVER = textwrap.dedent("""
    import socket
    srv = socket.create_server(("0.0.0.0", 29611))
    conn, _ = srv.accept()
    n = 0
    while chunk := conn.recv(1 << 20):
        n += len(chunk)
    conn.sendall(b"k")
    conn.close()
    print(n)
""")


@pytest.mark.skipif(emulated.unavailable_reason() is not None, reason="emulated hosts need root, ip and tc")
def test_the_counter_sees_a_known_transfer_between_emulated_hosts():
    import json
    import os

    payload = 8 << 20
    with emulated.emulated_hosts("1gbit") as hosts:
        envs = emulated.rank_environments(hosts)
        recv = subprocess.Popen(["ip", "netns", "exec", hosts.namespaces[1], sys.executable, "-c", _RECEIVER],
                                env=envs[1], stdout=subprocess.PIPE, text=True)  # fmt: skip
        send = subprocess.run(["ip", "netns", "exec", hosts.namespaces[0], sys.executable, "-c", _SENDER,
                               hosts.addresses[1], str(payload)], env={**envs[0], "PYTHONPATH": os.getcwd()},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert send.returncode == 0, send.stderr
        assert int(recv.communicate(timeout=30)[0]) == payload
    got = json.loads(send.stdout)
    # the frames carry the payload plus TCP/IP and Ethernet headers (about 4.5% at a 1500-byte MTU); what came
    # back is the receiver's ACKs, a small fraction
    assert payload < got["sent"] < 1.08 * payload
    assert 0 < got["received"] < 0.05 * payload


def _per_rank_worker(comm, missing_rank):
    values = None if comm.rank == missing_rank else [float(comm.rank), 10.0 + comm.rank]
    return emulated.per_rank(comm, values)


@pytest.mark.parametrize("missing_rank", [None, 1])
def test_per_rank_gathers_every_rank_s_values_or_none_when_one_rank_has_none(missing_rank):
    from torsh_kernels.collectives import run_local

    got = run_local(_per_rank_worker, 2, missing_rank, timeout=120)
    if missing_rank is None:
        assert got == [[[0.0, 10.0], [1.0, 11.0]]] * 2  # the same lists on every rank, rank by rank
    else:  # a rank without its own interface: nobody reports a figure, rather than half of one
        assert got == [None, None]
