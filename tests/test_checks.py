"""The shared checks of timeouts and environment variables (torsh_kernels.checks), and the places that use them:
each bad value ends in one typed error that names it, at construction, never a traceback later (issue 41, item 8)."""

from __future__ import annotations

import math

import pytest
import torch

from torsh_kernels.checks import MAX_TIMEOUT, check_timeout, env_flag, env_int
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError

BAD_TIMEOUTS = [
    (math.nan, InvalidArgumentError), (math.inf, InvalidArgumentError), (1e300, InvalidArgumentError),
    (10**400, InvalidArgumentError), (0, InvalidArgumentError), (-1.0, InvalidArgumentError),
    (True, ArgumentTypeError), ("10", ArgumentTypeError), (torch.tensor(1.0), ArgumentTypeError),
]  # fmt: skip


@pytest.mark.parametrize(("value", "error"), BAD_TIMEOUTS)
def test_a_timeout_is_a_finite_positive_number_of_seconds_up_to_a_year(value, error):
    with pytest.raises(error, match="f: timeout"):
        check_timeout(value, "f")
    assert check_timeout(10, "f") == 10.0 and check_timeout(MAX_TIMEOUT, "f") == MAX_TIMEOUT


@pytest.mark.parametrize(("value", "error"), BAD_TIMEOUTS)
def test_every_timeout_is_checked_where_it_is_given(value, error):
    """CompressionHookState's timeout at construction (it was checked at the first backward, when the
    communicator is made); run_local's and the transports' the same way."""
    from torsh_kernels.collectives import bootstrap, run_local
    from torsh_kernels.parallel import CompressionHookState

    with pytest.raises(error, match="CompressionHookState: timeout"):
        CompressionHookState(timeout=value)
    with pytest.raises(error, match="run_local: op_timeout"):
        run_local(print, 1, op_timeout=value)
    with pytest.raises(error, match="run_local: timeout"):
        run_local(print, 1, timeout=value)
    with pytest.raises(error, match="X: timeout"):
        bootstrap.check_timeout(value, "X")


FLAGS = [(None, False), ("", False), ("1", True), ("true", True), (" YES ", True), ("on", True), ("0", False),
         ("false", False), ("No", False), ("off", False)]  # fmt: skip


@pytest.mark.parametrize(("raw", "want"), FLAGS)
def test_env_flag_reads_the_usual_spellings(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("TORSH_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("TORSH_TEST_FLAG", raw)
    assert env_flag("TORSH_TEST_FLAG", False, "f") is want


@pytest.mark.parametrize("raw", ["maybe", "2", "y e s"])
def test_check_collectives_takes_the_same_spellings_as_check_signatures(monkeypatch, raw):
    """TORSH_KERNELS_CHECK_COLLECTIVES=false|no|off turned the check on (anything but 0 did); now it reads as
    TORSH_KERNELS_CHECK_SIGNATURES does, and a value it cannot read is an error naming it."""
    from torsh_kernels.collectives.agreement import enabled

    for var, read in (("TORSH_KERNELS_CHECK_COLLECTIVES", lambda: env_flag("TORSH_KERNELS_CHECK_COLLECTIVES", False,
                                                                          "TorchCommunicator")),
                      ("TORSH_KERNELS_CHECK_SIGNATURES", lambda: enabled(None, "TorchCommunicator"))):  # fmt: skip
        for off in ("false", "no", "off", "0"):
            monkeypatch.setenv(var, off)
            assert read() is False, (var, off)
        monkeypatch.setenv(var, raw)
        with pytest.raises(InvalidArgumentError, match=f"TorchCommunicator: {var}="):
            read()


def _communicator_check(comm, values):
    import os

    from torsh_kernels.collectives import TorchCommunicator

    out = []
    for v in values:
        os.environ["TORSH_KERNELS_CHECK_COLLECTIVES"] = v
        try:
            out.append(TorchCommunicator(comm.group)._check)
        except InvalidArgumentError as e:
            out.append(str(e))
    return out


def test_the_communicator_reads_check_collectives_as_a_flag():
    from torsh_kernels.collectives import run_local

    (got,) = run_local(_communicator_check, 1, ["false", "no", "off", "0", "1", "on", "maybe"], op_timeout=30)
    assert got[:6] == [False, False, False, False, True, True]
    assert got[6].startswith("TorchCommunicator: TORSH_KERNELS_CHECK_COLLECTIVES='maybe'"), got[6]


@pytest.mark.parametrize("raw", ["abc", "1.5", "-1", "9" * 5000, "70000"])
def test_integer_environment_variables_are_typed_errors(monkeypatch, raw):
    monkeypatch.setenv("TORSH_RDMA_GID_INDEX", raw)
    with pytest.raises(InvalidArgumentError, match="TORSH_RDMA_GID_INDEX="):
        env_int("TORSH_RDMA_GID_INDEX", 0, "RdmaCommunicator", lo=0, hi=65535)
    monkeypatch.setenv("TORSH_RDMA_GID_INDEX", " 3 ")
    assert env_int("TORSH_RDMA_GID_INDEX", 0, "RdmaCommunicator", lo=0, hi=65535) == 3


def test_trace_size_limit_from_the_environment_is_bounded(monkeypatch):
    from torsh_kernels.profiling.trace_files import resolve_limit

    monkeypatch.setenv("TORSH_TRACE_MAX_BYTES", "9" * 40 + "TiB")
    with pytest.raises(InvalidArgumentError, match=r"TORSH_TRACE_MAX_BYTES=.*at most"):
        resolve_limit(None, "TORSH_TRACE_MAX_BYTES", 2 << 30, "max_bytes")
    monkeypatch.setenv("TORSH_TRACE_MAX_BYTES", "8GiB")
    assert resolve_limit(None, "TORSH_TRACE_MAX_BYTES", 2 << 30, "max_bytes") == 8 << 30


def test_short_shows_an_int_too_long_for_repr_by_its_size():
    """Python refuses repr() past 4300 digits (ValueError): a message naming such a value was an untyped error."""
    from torsh_kernels.checks import check_int, short

    assert short(10**5000) == "<an int of about 5001 digits>"
    assert short(-(10**5000)) == "<an int of about 5001 digits>"
    assert short(12345) == "12345" and short(2**150) == str(2**150)  # 46 digits: shown whole
    assert short(10**100) == "1" + "0" * 56 + "..."  # repr cut
    with pytest.raises(InvalidArgumentError, match="about 5001 digits"):
        check_int(10**5000, "f", "n", 0, 10)
