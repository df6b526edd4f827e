"""Choosing a transport: :func:`make_communicator` and :func:`transports`, what each transport needs and
whether this machine has it (what ``torsh doctor`` prints).

- ``"torch"``: :class:`~torsh_kernels.collectives.TorchCommunicator` over a ``torch.distributed`` group
  (gloo on CPU, NCCL on GPU); always available where torch.distributed is.
- ``"cupy-nccl"``: :class:`~torsh_kernels.collectives.cupy_nccl.CupyNcclCommunicator`; needs CuPy with an
  NCCL library and a CUDA GPU.
- ``"rdma"``: :class:`~torsh_kernels.collectives.rdma.RdmaCommunicator`; needs pyverbs and an RDMA device
  with an active port.
- ``"auto"``: ``rdma`` where the job's tensors live on the host and an RDMA port is active, else
  ``torch`` (whose NCCL backend already is the best GPU transport; ``cupy-nccl`` is for when torch's is
  not wanted: CUDA graphs, a second communicator beside it). The choice and why are in ``comm.backend``
  and :func:`transports`.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError, TransportUnavailableError
from .communicator import Communicator, TorchCommunicator

__all__ = ["KINDS", "TransportStatus", "make_communicator", "torch_nccl_version", "transports"]

KINDS = ("auto", "torch", "cupy-nccl", "rdma")


@dataclasses.dataclass(kw_only=True, slots=True)
class TransportStatus:
    """Whether one transport can run here."""

    name: str
    """``torch``, ``cupy-nccl`` or ``rdma``."""
    available: bool
    """Whether a communicator of this kind can be made on this machine now."""
    detail: str
    """What was found (versions, devices) or, when not available, why not."""
    fix: str = ""
    """The command or setting that would make it available ('' when it is, or when nothing would)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def torch_nccl_version() -> str | None:
    """The version of the NCCL torch's own NCCL backend uses ("2.21.5"), None without CUDA or NCCL."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _torch_status() -> TransportStatus:
    if not dist.is_available():
        return TransportStatus(name="torch", available=False, detail=f"torch {torch.__version__} was built without "
                               "torch.distributed", fix="install a torch build with distributed support")  # fmt: skip
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    v = torch_nccl_version()
    nccl = f", NCCL {v}" if v else ""
    return TransportStatus(name="torch", available=bool(backends),
                           detail=f"torch.distributed backends: {', '.join(backends) or 'none'}{nccl}",
                           fix="" if backends else "install a torch build with gloo")  # fmt: skip


def _cupy_status() -> TransportStatus:
    from .cupy_nccl import NO_GPU_FIX, load_nccl

    try:
        _, version = load_nccl()
    except TransportUnavailableError as e:
        return TransportStatus(name="cupy-nccl", available=False, detail=e.reason, fix=e.fix)
    import cupy

    found = f"CuPy {cupy.__version__}, NCCL {'.'.join(map(str, version))}"
    if not torch.cuda.is_available():
        return TransportStatus(
            name="cupy-nccl", available=False, detail=f"{found}, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})",
            fix=NO_GPU_FIX,
        )  # fmt: skip
    return TransportStatus(name="cupy-nccl", available=True, detail=f"{found}, {torch.cuda.device_count()} GPU(s)")


def _rdma_status() -> TransportStatus:
    from .rdma_verbs import NO_DEVICE_FIX, PORT_DOWN_FIX, SYSFS, load_verbs, sysfs_devices

    ports = sysfs_devices()
    active = [p for p in ports if p["state"] == "ACTIVE"]
    listing = ", ".join(f"{p['device']}:{p['port']} {p['state']} ({p['link_layer'] or '?'})" for p in ports)
    try:
        load_verbs()
    except TransportUnavailableError as e:
        seen = f"; kernel devices: {listing}" if ports else ""
        return TransportStatus(name="rdma", available=False, detail=e.reason + seen, fix=e.fix)
    if not ports:
        return TransportStatus(
            name="rdma", available=False, detail=f"pyverbs imports, but there is no RDMA device ({SYSFS} "
            f"{'is empty' if SYSFS.is_dir() else 'does not exist'})",
            fix=NO_DEVICE_FIX,
        )  # fmt: skip
    if not active:
        return TransportStatus(
            name="rdma",
            available=False,
            detail=f"no port is ACTIVE: {listing}",
            fix=PORT_DOWN_FIX,
        )
    return TransportStatus(name="rdma", available=True, detail=f"pyverbs; ports: {listing}")


def transports() -> list[TransportStatus]:
    """The status of every transport on this machine (nothing is initialised or connected)."""
    return [_torch_status(), _cupy_status(), _rdma_status()]


def make_communicator(kind: str = "auto", group: object = None, **kwargs) -> Communicator:
    """A communicator of transport ``kind`` (one of :data:`KINDS`) over ``group`` (a process group,
    DeviceMesh with ``mesh_dim=``, ``(mesh, dim)`` or None for the default group); ``kwargs`` go to the
    transport's constructor (``timeout``, ``store``/``rank``/``world_size`` for cupy-nccl and rdma, ...).
    An explicitly named transport that cannot run raises ``TransportUnavailableError`` with the reason
    and the fix; ``"auto"`` takes RDMA for host tensors on a machine with an active RDMA port, else torch.
    """
    if not isinstance(kind, str) or kind not in KINDS:
        raise InvalidArgumentError(f"make_communicator: kind must be one of {KINDS}, got {kind!r}")
    if kind == "auto":
        kind = _auto(group, kwargs)
    if kind == "torch":
        mesh_dim = kwargs.pop("mesh_dim", None)
        return TorchCommunicator(group, dim=mesh_dim, **kwargs)
    if kind == "cupy-nccl":
        from .cupy_nccl import CupyNcclCommunicator

        return CupyNcclCommunicator(group, **kwargs)
    from .rdma import RdmaCommunicator

    return RdmaCommunicator(group, **kwargs)


def _auto(group: object, kwargs: dict) -> str:
    if "store" in kwargs:  # no process group: only the transports that bootstrap from a store
        for st in (_rdma_status(), _cupy_status()):
            if st.available:
                return st.name
        raise TransportUnavailableError(
            "make_communicator(kind='auto', store=...): neither rdma nor cupy-nccl can run here, and torch needs a "
            "process group (init_process_group) rather than a bare store",
            reason="no store-bootstrapped transport available",
            fix="call torch.distributed.init_process_group",
        )
    from .protocol import resolve_group

    pg = resolve_group(group, kwargs.get("mesh_dim"), "make_communicator") if dist.is_initialized() else None
    gpu = dist.is_initialized() and "nccl" in str(dist.get_backend(pg)).lower()
    return "rdma" if not gpu and _rdma_status().available else "torch"


def namespaces_supported() -> tuple[bool, str]:
    """Whether this process can make network namespaces (what ``benchmarks/emulated_hosts.sh`` needs)."""
    import os
    import shutil

    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return False, "the ip command (iproute2) is missing: apt-get install iproute2"
    if os.geteuid() != 0:
        return False, "making namespaces needs root (or CAP_NET_ADMIN): run as root or with sudo"
    if not os.path.exists("/proc/self/ns/net"):
        return False, "the kernel exposes no network namespaces (/proc/self/ns/net is missing)"
    return True, "ip netns, as root" + ("; tc (qdisc) found" if shutil.which("tc") else "; tc missing: apt-get install "
                                        "iproute2")  # fmt: skip
