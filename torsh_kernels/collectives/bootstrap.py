"""Out-of-band exchange of connection data through a ``torch.distributed`` store.

Transports that are not a torch process group (NCCL through CuPy, RDMA through pyverbs) still need to
agree on something before their first byte moves: NCCL's 128-byte unique id, RDMA's queue pair numbers,
PSNs, GIDs, LIDs, addresses and keys. They exchange it through a store: the default process group's
(``torchrun``'s TCP store), or any ``TCPStore``/``FileStore`` the caller gives. Each communicator gets a
namespace of its own (``namespace``), so two communicators of the same ranks never read each other's
keys, and every wait on the store is bounded by a timeout that ends in ``CollectiveTimeoutError``.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .. import checks
from ..errors import ArgumentTypeError, CollectiveTimeoutError, InvalidArgumentError
from .protocol import resolve_group

__all__ = ["all_gather_bytes", "broadcast_bytes", "check_timeout", "default_store", "identity", "namespace"]

_counters: dict[tuple, int] = {}
_lock = threading.Lock()


def check_timeout(timeout: object, what: str) -> None:
    """A transport's ``timeout``: a positive, finite number of seconds up to a year (a typed error otherwise)."""
    checks.check_timeout(timeout, what)


def default_store(what: str) -> dist.Store:
    """The store of the default process group (what ``init_process_group``/torchrun set up)."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            f"{what}: no store given and torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first, or pass store=, rank= and world_size="
        )
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def namespace(store: object, kind: str, ranks: Sequence[int], what: str) -> dist.PrefixStore:
    """A prefix of ``store`` private to the ``n``-th communicator of ``kind`` over ``ranks`` made by this
    process. Every member makes its communicators of those ranks in the same order (as with
    ``dist.new_group``), so the members agree on ``n`` without talking."""
    if not isinstance(store, dist.Store):
        raise ArgumentTypeError(f"{what}: store must be a torch.distributed Store, got {type(store).__name__}")
    key = (kind, tuple(ranks))
    with _lock:
        n = _counters.get(key, 0)
        _counters[key] = n + 1
    return dist.PrefixStore(f"torsh/{kind}/{','.join(map(str, ranks))}/{n}/", store)


def _get(store: dist.Store, keys: list[str], timeout: float, what: str) -> list[bytes]:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        return [store.get(k) for k in keys]
    except Exception as e:  # DistStoreError (a RuntimeError) on timeout or a store gone
        raise CollectiveTimeoutError(
            f"{what}: waited {timeout:g} s on the store for {keys[:4]}{'...' if len(keys) > 4 else ''} "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); a peer did not "
            "publish its connection data: it exited, failed before connecting, or is not creating this communicator"
        ) from e


def broadcast_bytes(store: dist.Store, rank: int, root: int, make: Callable[[], bytes], *, timeout: float,
                    what: str, key: str = "root") -> bytes:  # fmt: skip
    """``make()`` on ``root``, published under ``key``; every rank returns those bytes."""
    if rank == root:
        value = make()
        if not isinstance(value, (bytes, bytearray)):
            raise ArgumentTypeError(f"{what}: the value to publish must be bytes, got {type(value).__name__}")
        store.set(key, bytes(value))
        return bytes(value)
    return _get(store, [key], timeout, what)[0]


def all_gather_bytes(store: dist.Store, rank: int, world_size: int, payload: bytes, *, timeout: float, what: str,
                     key: str = "rank") -> list[bytes]:  # fmt: skip
    """Each rank publishes ``payload`` under ``{key}{rank}``; every rank returns all of them, by rank."""
    if not isinstance(payload, (bytes, bytearray)):
        raise ArgumentTypeError(f"{what}: the payload must be bytes, got {type(payload).__name__}")
    store.set(f"{key}{rank}", bytes(payload))
    return _get(store, [f"{key}{r}" for r in range(world_size)], timeout, what)


def identity(group: object, mesh_dim, store: object, rank: object, world_size: object, what: str) -> tuple:
    """(rank, world size, global ranks, the store to exchange through) of a transport made from a process
    group (or DeviceMesh dimension; its store is the default group's) or from a bare store with ``rank=``
    and ``world_size=``; argument errors are typed and come before anything else."""
    if store is not None:
        if group is not None or mesh_dim is not None:
            raise InvalidArgumentError(f"{what}: pass either a group (or mesh) or a store, not both")
        if not isinstance(store, dist.Store):
            raise ArgumentTypeError(f"{what}: store must be a torch.distributed Store, got {type(store).__name__}")
        for name, val in (("rank", rank), ("world_size", world_size)):
            if isinstance(val, bool) or not isinstance(val, int):
                raise InvalidArgumentError(f"{what}: with store=, {name} must be an int, got {val!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"{what}: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        return rank, world_size, list(range(world_size)), store
    if rank is not None or world_size is not None:
        raise InvalidArgumentError(f"{what}: rank= and world_size= go with store=; a group has its own")
    pg = resolve_group(group, mesh_dim, what)
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            f"{what}: torch.distributed is not initialised; call init_process_group first, or pass store=, rank= "
            "and world_size="
        )
    r, w = dist.get_rank(pg), dist.get_world_size(pg)
    if r < 0:
        raise InvalidArgumentError(f"{what}: this process is not a member of the given group")
    ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(w))
    return r, w, ranks, default_store(what)
