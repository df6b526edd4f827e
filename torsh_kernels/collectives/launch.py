"""Starting ranks: ``init_from_env`` for jobs launched by torchrun, ``run_local`` for N local processes.

``run_local(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a process group in each
(gloo by default, over a file store in a private temporary directory), calls ``fn(comm, *args)`` with a
:class:`TorchCommunicator`, and returns the ranks' return values in rank order. If a rank raises or
exits, the others are given ``op_timeout`` seconds (their collectives fail with ``CollectiveError`` in
that time) and are then terminated; :class:`~torsh_kernels.errors.RankFailedError` names each failed
rank with its error and traceback, and carries the values of the ranks that finished. Nothing hangs
past ``timeout``.

``start_method="forkserver"`` starts the ranks from a server process that imported torch, torsh_kernels
and ``fn``'s module once (about 2 s, paid by the first call of the process), so each later launch costs
a fork instead of a fresh interpreter importing torch: for programs (test suites) that launch many
small jobs. ``"spawn"`` (default) starts fresh interpreters. :func:`set_defaults` sets, for this process,
the start method of calls that pass none and modules for the server to import before it forks any rank
(a module that warms caches at import, kernels loaded and lazy imports done, then warms them once for
every rank); the test suite's ``conftest.py`` does both.

A fork of the server runs with the modules the server imported, configured by the environment the
server started with. A rank is handed the caller's current environment (``os.environ``), but a module
that read a variable at import keeps the server's value; so when any variable that configures torch,
Triton, Numba, the transports, the thread counts or torsh_kernels (prefixes in ``_IMPORT_ENV``) differs
from the server's, that launch spawns fresh interpreters instead: the same ranks, only slower.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import recording
from ..checks import check_timeout
from ..errors import InvalidArgumentError, RankFailedError
from .communicator import TorchCommunicator

__all__ = ["START_METHODS", "init_from_env", "run_local", "set_defaults"]

START_METHODS = ("spawn", "forkserver")
"""How :func:`run_local` starts its ranks (see the module docstring)."""

_defaults: dict[str, Any] = {"start_method": "spawn", "preload": ()}  # see set_defaults

# Prefixes of the environment variables that the libraries a rank imports may read once, at import or
# first use, and that a caller sets to configure them: torsh_kernels' own, torch's, the compilers', the
# transports', the thread counts. (Not the ones libraries set for themselves while they load, such as
# Intel OpenMP's KMP_*: the server has loaded them already.)
_IMPORT_ENV = ("TORSH_", "TORCH_", "PYTORCH_", "TRITON_", "NUMBA_", "CUDA_", "NCCL_", "GLOO_", "OMP_", "MKL_")
_server_env: dict[str, str] | None = None  # those variables as the fork server started with them


def set_defaults(*, start_method: str | None = None, preload: Sequence[str] | None = None) -> None:
    """:func:`run_local`'s defaults in this process: ``start_method`` for calls that pass none, and
    ``preload``, modules the fork server imports (beside torch, torsh_kernels and the first ``fn``'s module)
    when it starts; a server already running keeps what it imported. None leaves a setting as it is."""
    if start_method is not None:
        if start_method not in START_METHODS:
            raise InvalidArgumentError(
                f"set_defaults: start_method must be one of {START_METHODS}, got {start_method!r}"
            )
        _defaults["start_method"] = start_method
    if preload is not None:
        if isinstance(preload, str) or not all(isinstance(m, str) and m for m in preload):
            raise InvalidArgumentError(f"set_defaults: preload must be a sequence of module names, got {preload!r}")
        _defaults["preload"] = tuple(preload)


def _import_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_ENV)}


def init_from_env(backend: str | None = None, *, timeout: float = 300.0, **kwargs) -> TorchCommunicator:
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; ``LOCAL_RANK`` picks the GPU) unless it already is, and return a
    communicator over it. ``backend`` defaults to nccl where CUDA is available, else gloo."""
    check_timeout(timeout, "init_from_env")
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise InvalidArgumentError(
                f"init_from_env: environment variables {missing} are not set; launch with torchrun "
                "(or set them), or use run_local for ranks on this machine"
            )
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return TorchCommunicator(**kwargs)


def _child(rank, world, fn, args, init, backend, op_timeout, threads, results, env=None) -> None:
    status: tuple
    try:
        if env is not None:  # a fork of the server: the caller's environment, not the server's
            os.environ.clear()
            os.environ.update(env)
        if threads:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=op_timeout)
        )
        # Every rank connected before any runs fn: a rank that fails (or returns) at once would otherwise close
        # its sockets while a slower peer is still connecting its gloo mesh, whose init_process_group then
        # fails with "Connection closed by peer" instead of the peer's own error reaching it.
        _all_arrive(init, world, op_timeout, "initialized")
        comm = TorchCommunicator(timeout=op_timeout)
        value = fn(comm, *args)
        recording.flush()  # TORSH_TRACE: write this rank's trace now (os._exit below skips atexit)
        status = ("ok", pickle.dumps(value))
    except BaseException as e:
        status = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    results.put((rank, *status))
    if status[0] == "ok":
        # Stay until every rank has returned (a failed peer never arrives: the parent, which has every report
        # by then, terminates this rank, or the wait ends after op_timeout).
        _all_arrive(init, world, op_timeout, "finished")
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0 if status[0] == "ok" else 1)  # skip interpreter teardown (threads of a failed backend)


def _all_arrive(init: str, world: int, op_timeout: float, name: str) -> None:
    """Wait until every rank has called this with ``name``, on a file store of its own beside the init store
    (so that waiting never interleaves with a peer's collectives); gives up quietly after ``op_timeout``
    (a peer that failed never arrives: its own error is what the caller reports)."""
    with contextlib.suppress(Exception):
        store = dist.FileStore(init.removeprefix("file://") + ".arrivals", world)
        store.set_timeout(datetime.timedelta(seconds=op_timeout))
        if store.add(name, 1) == world:
            store.set(f"{name}/all", "1")
        store.wait([f"{name}/all"])


def preload_forkserver(ctx, fn: Callable[..., Any]) -> bool:
    """Set what the fork server imports before it forks any rank (only the first call's list counts: the
    server keeps running for the rest of the process). False when forks of the server would see other
    values of the import-time variables than the caller has now (see the module docstring)."""
    global _server_env
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:  # not started yet: this call starts it
        mods = ["torch", "torch.distributed", "torsh_kernels", "torsh_kernels.collectives.launch"]
        mods += _defaults["preload"]
        mod = getattr(fn, "__module__", None)
        if mod and mod != "__main__":
            mods.append(mod)
        ctx.set_forkserver_preload(mods)
        _server_env = _import_env()
        return True
    return server_env_matches()  # (a server started elsewhere: unknown)


def server_env_matches() -> bool:
    """Whether the fork server this process started had the import-time variables (prefixes in
    ``_IMPORT_ENV``) the caller has now; False when no server was started here."""
    return _server_env is not None and _import_env() == _server_env


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    op_timeout: float = 30.0,
    threads: int | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` fresh local processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function), ``args`` and results picklable.
    ``op_timeout`` bounds each collective (the process group's timeout); ``timeout`` bounds the whole
    run. ``threads``: torch intra-op threads per rank (default: the CPU count divided among the ranks).
    ``start_method``: "spawn" (fresh interpreters) or "forkserver" (forks of a server that has imported
    torch, torsh_kernels and ``fn``'s module; see the module docstring); None: :func:`set_defaults`' choice,
    "spawn" unless changed.
    """
    start_method, threads = _checked_run_args(fn, world_size, backend, threads, start_method, timeout, op_timeout)
    ctx, env = _rank_context(start_method, fn)
    tmp = tempfile.mkdtemp(prefix="torsh-run-")
    init = "file://" + os.path.join(tmp, "store")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, fn, args, init, backend, op_timeout, threads, results, env),
            name=f"torsh-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        done = _collect_reports(procs, results, timeout, op_timeout)
    finally:
        _stop(procs)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return _values_or_raise(done, world_size)


def _checked_run_args(fn, world_size, backend, threads, start_method, timeout, op_timeout) -> tuple[str, int]:
    """:func:`run_local`'s arguments checked: (the start method, the torch threads per rank)."""
    check_timeout(timeout, "run_local")
    check_timeout(op_timeout, "run_local", "op_timeout")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"run_local: world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise InvalidArgumentError(f"run_local: fn must be callable, got {fn!r}")
    if backend not in ("gloo", "nccl"):
        raise InvalidArgumentError(f"run_local: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InvalidArgumentError("run_local: backend='nccl' needs CUDA; use backend='gloo' on this machine")
    if start_method is None:
        start_method = _defaults["start_method"]
    if start_method not in START_METHODS:
        raise InvalidArgumentError(f"run_local: start_method must be one of {START_METHODS}, got {start_method!r}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    return start_method, threads


def _rank_context(start_method: str, fn: Callable[..., Any]) -> tuple[Any, dict[str, str] | None]:
    """(the multiprocessing context that starts the ranks, the environment a fork of the server is handed:
    None where the ranks are fresh interpreters)."""
    env = None
    if start_method == "forkserver":
        ctx = torch.multiprocessing.get_context("forkserver")
        if preload_forkserver(ctx, fn):
            env = dict(os.environ)
        else:  # the server's import-time environment differs from ours: fresh interpreters
            ctx = torch.multiprocessing.get_context("spawn")
    else:
        ctx = torch.multiprocessing.get_context(start_method)
    return ctx, env


def _collect_reports(procs: list, results, timeout: float, op_timeout: float) -> dict[int, tuple]:
    """Each rank's report (status, value or error, traceback) by rank, as they arrive: until every rank has
    reported or exited, ``timeout`` has passed, or ``op_timeout`` + 10 s after the first failure."""
    world_size = len(procs)
    done: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    grace_end = None
    while len(done) < world_size:
        now = time.monotonic()
        if now > deadline or (grace_end is not None and now > grace_end):
            break
        try:
            rank, *status = results.get(timeout=0.05)
            done[rank] = tuple(status)
        except queue_mod.Empty:
            pass
        for r, p in enumerate(procs):
            if r not in done and p.exitcode is not None:
                # give a just-exited process's queued report a moment to arrive
                try:
                    rank, *status = results.get(timeout=0.5)
                    done[rank] = tuple(status)
                    continue
                except queue_mod.Empty:
                    pass
                if r not in done:
                    done[r] = ("exit", f"exited with code {p.exitcode} without reporting a result", "")
        if grace_end is None and any(s[0] != "ok" for s in done.values()):
            grace_end = time.monotonic() + op_timeout + 10.0
    return done


def _stop(procs: list) -> None:
    """Terminate the ranks still running, then kill those that outlive 5 s."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _values_or_raise(done: dict[int, tuple], world_size: int) -> list[Any]:
    """The ranks' values in rank order, or ``RankFailedError`` naming each rank that failed or did not finish."""
    values: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    tracebacks: dict[int, str] = {}
    for r in range(world_size):
        s = done.get(r)
        if s is None:
            failures[r] = "did not finish (terminated)"
        elif s[0] == "ok":
            values[r] = pickle.loads(s[1])
        else:
            failures[r] = s[1]
            if s[2]:
                tracebacks[r] = s[2]
    if failures:
        lines = [f"rank {r}: {m}" for r, m in sorted(failures.items())]
        first = min(tracebacks) if tracebacks else None
        tb = f"\n--- traceback of rank {first} ---\n{tracebacks[first]}" if first is not None else ""
        msg = f"run_local: {len(failures)} of {world_size} ranks failed:\n" + "\n".join(lines) + tb
        raise RankFailedError(msg, values=values, failures=failures)
    return values
