"""The error hierarchy.

Every error the library raises on purpose derives from :class:`TorshKernelsError`, and also from the
built-in exception a caller would naturally catch (``ValueError``, ``TypeError`` or ``RuntimeError``), so
both ``except TorshKernelsError`` and ``except ValueError`` work. Messages say what was given, what was
expected and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigMappingError",
    "DTypeError",
    "DeviceMismatchError",
    "FileAccessError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "NonFiniteError",
    "ProviderError",
    "ProviderUnavailableError",
    "RankFailedError",
    "ShapeError",
    "TorshKernelsError",
    "TraceFormatError",
    "TransportUnavailableError",
]


class TorshKernelsError(Exception):
    """Base class of every error raised by torsh_kernels."""


class InvalidArgumentError(TorshKernelsError, ValueError):
    """An argument has a value outside what the function accepts."""


class ArgumentTypeError(TorshKernelsError, TypeError):
    """An argument is of the wrong Python type (e.g. a tensor where a list of tensors is expected)."""


class DTypeError(TorshKernelsError, TypeError):
    """A tensor has a dtype the operation does not accept (e.g. an integer tensor where floats are needed)."""


class DeviceMismatchError(TorshKernelsError, ValueError):
    """Tensors that must live on one device do not."""


class ShapeError(TorshKernelsError, ValueError):
    """A tensor's shape, size or memory layout does not fit the operation."""


class LayoutMismatchError(ShapeError):
    """Tensors do not match the bucket layout they are used with."""


class ProviderError(TorshKernelsError, ValueError):
    """An unknown provider name was requested (argument or ``TORSH_KERNELS_PROVIDER``)."""


class ProviderUnavailableError(TorshKernelsError, RuntimeError):
    """An explicitly requested provider cannot run here (missing package, no GPU, wrong device)."""


class NonFiniteError(TorshKernelsError, FloatingPointError):
    """An input holds NaN or Inf where the operation would otherwise spread it silently (compression)."""


class CollectiveError(TorshKernelsError, RuntimeError):
    """A collective failed on the network: a peer exited or raised, or the operation timed out."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its communicator's timeout (the transport was then aborted)."""


class TransportUnavailableError(TorshKernelsError, RuntimeError):
    """A communication transport cannot run here: its library is missing, or no device or port is usable.

    ``reason`` says what is missing, ``fix`` the command or setting that would provide it."""

    def __init__(self, message: str, *, reason: str = "", fix: str = ""):
        super().__init__(message)
        self.reason = reason or message
        """What is missing, in one line."""
        self.fix = fix
        """The command or setting that would make the transport available ('' where none would)."""


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives (operation, size or dtype) at the same point of the sequence."""


class RankFailedError(CollectiveError):
    """Another rank failed: a rank of a locally launched job raised or exited (``run_local``; the message
    carries its error and traceback), or a peer's offloaded optimizer step failed, so this rank rolled its own
    back (``OffloadedOptimizer``; ``failures`` names each failed rank's error)."""

    def __init__(self, message: str, *, values: list | None = None, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.values = values or []
        """Return value of each rank that finished (None for the others), by rank."""
        self.failures = failures or {}
        """Error line of each rank that raised, exited or was terminated."""


class TraceFormatError(TorshKernelsError, ValueError):
    """A trace file is malformed, truncated or not a trace; the message names the file and the problem."""


class FileAccessError(TorshKernelsError, OSError):
    """A file the library writes on its own account (the tuning cache, a trace) cannot be written where it is
    asked to go: the place is not a writable directory, a symlink or other non-regular file sits where the
    library's lock file goes, or another process holds the lock too long. The message names the path."""


class ConfigMappingError(TorshKernelsError, ValueError):
    """A configuration from elsewhere (DeepSpeed, Megatron-Core, a PyTorch comm hook) holds settings torsh
    cannot map: unknown keys, values torsh has no equivalent for, wrong types. Raised once the whole
    configuration was examined; ``keys`` names every offending one."""

    def __init__(self, message: str, *, keys: dict[str, str] | None = None):
        super().__init__(message)
        self.keys = dict(keys or {})
        """Each offending dotted key (``"zero_optimization.offload_optimizer.device"``) and why it cannot be
        mapped, in the order they were found."""
