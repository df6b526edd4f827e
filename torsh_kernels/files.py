"""Files the library writes and reads on its own account (the tuning cache, traces): the one home of how.

- :func:`write_atomic` writes a file whole or not at all: the bytes go to a temporary file created
  exclusively in the target's directory (``tempfile.mkstemp``: a random name, ``O_CREAT | O_EXCL |
  O_NOFOLLOW``, so a symlink planted at any name cannot redirect the write), are flushed (and fsynced
  when asked), and the temporary file then replaces the target with ``os.replace`` (a reader sees the old
  file or the new one, never half of one; a symlink at the target's own name is replaced, not followed).
  The new file gets the permissions a plain ``open(path, "w")`` would give it (0666 less the umask).
- :func:`locked` holds an exclusive ``fcntl.flock`` on a sidecar lock file (``NAME.lock`` beside the
  file) for a read-merge-write: concurrent writers (processes or threads) then take turns and none
  loses another's update. The lock file is opened with ``O_NOFOLLOW`` and must be a regular file.
- :func:`open_regular` opens a file for reading only if it is a regular file: a FIFO, a device or a
  directory at the path is refused without blocking on it (``/dev/zero`` would never end, a FIFO never
  open); :func:`read_capped` reads such a file of at most ``max_bytes`` bytes, refusing a larger one
  without reading it.
- :func:`check_writable_dir` makes a directory (and its parents) and proves it writable by creating and
  removing a temporary file in it, so a job learns at start, not at exit, that its output has nowhere
  to go.

Errors are :class:`~torsh_kernels.errors.FileAccessError` (an ``OSError``) naming the path and what to do.
Imports only the standard library and the error hierarchy (floor 0).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import FileAccessError

__all__ = [
    "LOCK_SUFFIX",
    "LOCK_TIMEOUT_S",
    "check_writable_dir",
    "locked",
    "open_regular",
    "read_capped",
    "write_atomic",
]

LOCK_SUFFIX = ".lock"
LOCK_TIMEOUT_S = 60.0
"""How long :func:`locked` waits for another writer before it gives up (seconds)."""

_UMASK: int | None = None


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, which races with other threads)."""
    global _UMASK
    if _UMASK is None:
        _UMASK = 0o022
        with contextlib.suppress(OSError, ValueError):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("Umask:"):
                    _UMASK = int(line.split()[1], 8)
                    break
    return _UMASK


def write_atomic(path: str | os.PathLike, data: str | bytes, *, fsync: bool = True, what: str = "file") -> Path:
    """Write ``data`` to ``path`` whole or not at all (see the module docstring); the parent directory is
    created if missing. Returns the path. Raises :class:`FileAccessError` when the directory cannot hold it."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise FileAccessError(f"cannot write the {what} {p}: {e.strerror or e}; make {p.parent} a writable "
                              "directory or choose another place") from e  # fmt: skip
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise FileAccessError(f"cannot write the {what} {p}: {e.strerror or e}") from e
        raise
    return p


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def locked(path: str | os.PathLike, *, timeout: float = LOCK_TIMEOUT_S, what: str = "file") -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (an ``flock`` on ``path + ".lock"``) for the block. Threads of
    one process take turns too (``flock`` locks belong to the open file, which each call opens anew)."""
    import fcntl

    p = Path(path)
    lock = p.with_name(p.name + LOCK_SUFFIX)
    with _THREAD_LOCKS_GUARD:
        tlock = _THREAD_LOCKS.setdefault(str(lock), threading.Lock())
    if not tlock.acquire(timeout=timeout):
        raise FileAccessError(f"the lock {lock} of the {what} is held by another thread of this process for "
                              f"over {timeout:g} s")  # fmt: skip
    try:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
        except OSError as e:
            why = ("a symlink sits there (the lock is never followed through one); remove it"
                   if e.errno == errno.ELOOP else f"{e.strerror or e}")  # fmt: skip
            raise FileAccessError(f"cannot open the lock file {lock} of the {what}: {why}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileAccessError(f"the lock file {lock} of the {what} is not a regular file; remove it")
            deadline = time.monotonic() + timeout
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise FileAccessError(
                            f"another process has held the lock {lock} of the {what} for over {timeout:g} s; if no "
                            "torsh process is running, something else holds it (lsof " + str(lock) + ")"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        tlock.release()


def open_regular(path: str | os.PathLike, fail: Callable[[str], Exception]) -> BinaryIO:
    """``path`` opened for reading in binary mode, once it is known to be a regular file (``fail(why)``
    makes the error otherwise: a FIFO, device or directory, which is refused without blocking on it);
    ``OSError`` (missing, unreadable) passes."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block the open
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise fail("not a regular file (a directory, FIFO or device)")
    return f


def read_capped(path: str | os.PathLike, max_bytes: int, fail: Callable[[str], Exception]) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them: ``fail(why)`` makes the error
    raised when the path is not a regular file or holds more; ``OSError`` (missing, unreadable) passes."""
    with open_regular(path, fail) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise fail(f"{size} bytes, over the limit of {max_bytes}")
        data = f.read(max_bytes + 1)  # the file may have grown since the fstat
    if len(data) > max_bytes:
        raise fail(f"over {max_bytes} bytes, the limit")
    return data


def check_writable_dir(path: str | os.PathLike, *, what: str = "the output directory",
                       fix: str = "point it at a writable directory") -> Path:  # fmt: skip
    """Make ``path`` (and its parents) a directory if it is not one, and prove it writable by creating and
    removing a temporary file in it. Raises :class:`FileAccessError` saying why not, then ``fix``."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        raise FileAccessError(f"{what} {p} exists and is not a directory; {fix}") from e
    except OSError as e:
        raise FileAccessError(f"{what} {p} cannot be created ({e.strerror or e}); {fix}") from e
    try:
        fd, probe = tempfile.mkstemp(prefix=".torsh-probe.", dir=p)
    except OSError as e:
        raise FileAccessError(f"{what} {p} cannot be written ({e.strerror or e}); {fix}") from e
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return p
