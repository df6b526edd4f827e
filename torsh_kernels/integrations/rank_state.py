"""Per-rank checkpoint files for what only one rank may load: a compression hook's error-feedback residuals and
PowerSGD's Q memory differ from rank to rank (:meth:`CompressionHookState.state_dict` records its rank and refuses
to load on another), while Lightning, Accelerate and the Hugging Face ``Trainer`` write their checkpoint from rank 0
only. Each rank therefore writes its own file beside the framework's checkpoint, ``DIR/rank{R}-of-{W}.pt``, whole
or not at all (:func:`~torsh_kernels.files.write_atomic`), and each reads its own back, so nothing is gathered
(a residual is as large as the model's gradients, per rank). DIR must be visible to the rank that writes it and
to the same rank when it resumes (a local or shared file system; object stores are not supported).

:func:`save` and :func:`load` take anything with ``state_dict()``/``load_state_dict()`` whose state is per rank
(:class:`~torsh_kernels.parallel.CompressionHookState`, :class:`~torsh_kernels.parallel.GradientSynchronizer`).
A missing file is a typed :class:`~torsh_kernels.errors.FileAccessError` naming it (a checkpoint written without
torsh, or by another world size): resuming never silently restarts error feedback from zero.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ArgumentTypeError, FileAccessError, InvalidArgumentError
from ..files import write_atomic

FORMAT = "torsh-rank-state/1"


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the world size of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def path(directory: str | os.PathLike, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` keeps its state under ``directory``."""
    return Path(directory) / f"rank{rank}-of-{world_size}.pt"


def _check(obj: object, directory: object, what: str) -> Path:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise ArgumentTypeError(
            f"{what}: expected an object with state_dict() and load_state_dict() (a CompressionHookState, a "
            f"GradientSynchronizer), got {type(obj).__name__}"
        )
    if not isinstance(directory, (str, os.PathLike)):
        raise ArgumentTypeError(f"{what}: the directory must be a str or path, got {type(directory).__name__}")
    d = os.fspath(directory)
    if "://" in str(d):
        raise InvalidArgumentError(f"{what}: {d} is a URL; per-rank states are written to a local or shared file "
                                   "system only")  # fmt: skip
    return Path(d)


def save(obj: object, directory: str | os.PathLike, *, what: str = "rank_state.save") -> Path:
    """Write ``obj.state_dict()`` to this rank's file under ``directory`` (created if missing); every rank calls it
    with the same directory. Returns the file's path."""
    d = _check(obj, directory, what)
    rank, ws = rank_and_size()
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "rank": rank, "world_size": ws, "state": obj.state_dict()}, buf)
    return write_atomic(path(d, rank, ws), buf.getvalue(), what="per-rank torsh state")


def load(obj: object, directory: str | os.PathLike, *, what: str = "rank_state.load") -> Path:
    """Load this rank's file under ``directory`` into ``obj`` (``obj.load_state_dict``, which checks it). A missing
    file, or one saved by another world size, is a typed error naming what is there."""
    d = _check(obj, directory, what)
    rank, ws = rank_and_size()
    p = path(d, rank, ws)
    if not p.is_file():
        there = sorted(x.name for x in d.glob("rank*-of-*.pt")) if d.is_dir() else []
        found = f"it holds {', '.join(there)}" if there else "there is no per-rank torsh state there"
        raise FileAccessError(
            f"{what}: no torsh state for rank {rank} of {ws} at {p} ({found}): the checkpoint was written without "
            "torsh's compression, or by another number of ranks. Resume with the same number of ranks, or start the "
            "compressor's state afresh explicitly (the integration's restore=False)"
        )
    try:
        saved = torch.load(p, map_location=None, weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise FileAccessError(f"{what}: {p} cannot be read as a torsh per-rank state: {e}") from e
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise FileAccessError(f"{what}: {p} is not a torsh per-rank state (format {FORMAT!r})")
    obj.load_state_dict(saved["state"])
    return p


def remove(directory: str | os.PathLike) -> None:
    """Remove this rank's file under ``directory``, and the directory once it is empty (each rank removes its own;
    a checkpoint that is deleted takes its per-rank states with it)."""
    rank, ws = rank_and_size()
    p = path(directory, rank, ws)
    p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # other ranks' files are still there, or it is gone
        os.rmdir(directory)


__all__ = ["FORMAT", "load", "path", "remove", "save"]
