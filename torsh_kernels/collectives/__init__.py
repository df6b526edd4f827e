"""Layer 2: collectives over a :class:`Communicator` (torch.distributed, NCCL through CuPy, RDMA through
pyverbs; :func:`make_communicator` picks one), hierarchical all-reduce, and the alpha-beta cost of plain
collectives. Nothing here
knows of compressors: the compressed all-reduce and its planner live one layer up, in
:mod:`torsh_kernels.compression`."""

from __future__ import annotations

from .coalesce import Coalescer
from .communicator import (
    REDUCE_OPS,
    Communicator,
    CommunicatorBase,
    Handle,
    TorchCommunicator,
    as_communicator,
)
from .cost_model import (
    Link,
    Round,
    Topology,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    probe,
    probe_topology,
    rounds_time,
)
from .cupy_nccl import CupyNcclCommunicator
from .hierarchical import hierarchical_all_reduce, node_groups
from .launch import init_from_env, run_local
from .rdma import RdmaCommunicator
from .sparse import all_reduce_sparse
from .traffic import Traffic, wire_bytes
from .transports import TransportStatus, make_communicator, transports

__all__ = [
    "REDUCE_OPS",
    "Coalescer",
    "Communicator",
    "CommunicatorBase",
    "CupyNcclCommunicator",
    "Handle",
    "Link",
    "RdmaCommunicator",
    "Round",
    "Topology",
    "TorchCommunicator",
    "Traffic",
    "TransportStatus",
    "all_gather_time",
    "all_reduce_sparse",
    "all_reduce_time",
    "all_to_all_time",
    "as_communicator",
    "hierarchical_all_reduce",
    "init_from_env",
    "make_communicator",
    "node_groups",
    "probe",
    "probe_topology",
    "rounds_time",
    "run_local",
    "transports",
    "wire_bytes",
]

_MOVED = {
    "CompressedReduction", "compressed_all_reduce", "start_compressed_all_reduce", "compressed_time", "plan", "Plan",
}  # fmt: skip


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(
            f"torsh_kernels.collectives.{name} moved to torsh_kernels.compression.{name} (the compressed all-reduce "
            "and its planner are layer 3); import it from there (docs/migration.md lists every move)"
        )
    raise AttributeError(f"module 'torsh_kernels.collectives' has no attribute {name!r}")
