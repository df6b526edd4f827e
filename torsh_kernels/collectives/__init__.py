"""Layer 2: collectives over a :class:`Communicator` (torch.distributed today; CuPy NCCL and RDMA fit the
same protocol), compressed and hierarchical all-reduce, and the alpha-beta cost model."""

from __future__ import annotations

from .communicator import REDUCE_OPS, Communicator, Handle, TorchCommunicator
from .compressed import CompressedReduction, compressed_all_reduce, start_compressed_all_reduce
from .cost_model import (
    Link,
    Plan,
    Topology,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    compressed_time,
    plan,
    probe,
    probe_topology,
)
from .hierarchical import hierarchical_all_reduce, node_groups
from .launch import init_from_env, run_local

__all__ = [
    "REDUCE_OPS",
    "Communicator",
    "CompressedReduction",
    "Handle",
    "Link",
    "Plan",
    "Topology",
    "TorchCommunicator",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "compressed_all_reduce",
    "compressed_time",
    "hierarchical_all_reduce",
    "init_from_env",
    "node_groups",
    "plan",
    "probe",
    "probe_topology",
    "run_local",
    "start_compressed_all_reduce",
]
