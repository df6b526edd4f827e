"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with ZeRO++-style quantized communication.

FSDP2 lets a module replace its all-gather and reduce-scatter (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``, the ``AllGather`` / ``ReduceScatter`` interfaces of
``torch.distributed.fsdp._fully_shard._fsdp_api``: ``allocate(size, *, dtype, device)`` and
``__call__(output_tensor, input_tensor, group, [op,] async_op=False)``, flat 1-D buffers, the input
``1 / world_size`` of the output). Here they are implemented on torsh's blockwise quantize/dequantize
kernels, as DeepSpeed ZeRO++ does inside its own engine:

- :class:`QuantizedAllGather` (qwZ): each rank quantizes its shard once per all-gather (absmax per block
  of ``block`` elements, int8 or packed int4, one fp32 scale per block), the payloads (codes and scales
  in one byte buffer per rank) are all-gathered, and every rank's segment is dequantized straight into
  FSDP2's output buffer, its own included, so every rank computes with the same weights. Under
  ``reshard_after_forward=<int>`` (ZeRO++'s hpZ) the backward all-gathers within the smaller group move
  the forward's dequantized weights unquantized (``shard_group_size``).
- :class:`QuantizedReduceScatter` (qgZ): each rank adds its error-feedback residual to the gradient
  (optional), quantizes the ``world_size`` chunks, sends chunk ``r`` to rank ``r`` in one all-to-all, and
  sums the chunks it receives in fp32 (never in int8), then applies FSDP2's reduce op (sum, average, or
  the pre-multiplied sum of a gradient divide factor). The residual (what quantizing lost, kept in fp32
  per rank) is a buffer of the FSDP module, a ``DTensor`` sharded over the module's mesh, so it is in the
  module's ``state_dict`` and checkpoints per rank through ``torch.distributed.checkpoint``.
- :func:`apply_quantized_comm` installs them on every ``FSDPModule`` of a model.

Bytes on the wire per element: int8 ``1 + 4 / block``, int4 ``0.5 + 4 / block`` against 4 (fp32) or 2
(bf16) for FSDP2's own collectives. Inputs that are not floating point (FSDP2 all-gathers uint8 only
when the parameters of one group have different dtypes) go through the plain collective, unchanged.

Agreement: before its first call with a new configuration (format, block, shard size, dtypes, the reduce
op), each comm exchanges that configuration's signature with the ranks of FSDP2's group (one small
all-gather, :func:`~torsh_kernels.collectives.agreement.agree`), and :func:`apply_quantized_comm` exchanges
its settings once; ranks prepared differently then all raise
:class:`~torsh_kernels.errors.CollectiveMismatchError` naming the difference instead of one aborting in
gloo. ``check_signatures=False`` (or ``TORSH_KERNELS_CHECK_SIGNATURES=0``) turns it off. Before its
exchange, :func:`apply_quantized_comm` waits (through the process group's store, no collective) until every
rank of the shard group called it: where one did not (its model runs FSDP2's own comms), the ranks that
did raise :class:`~torsh_kernels.errors.CollectiveTimeoutError` naming it after the timeout instead of
meeting its all-gather (which aborts the process in gloo); that rank itself runs none of this code and
gets torch's own error from its collective.

Failures: ``apply_quantized_comm(timeout=)`` bounds every collective of the installed comms (a peer that
raised and stays alive ends this rank's next one with ``CollectiveError`` within the timeout, where the
process group's default is 30 minutes). A residual with NaN or Inf in a checkpoint is refused with
:class:`~torsh_kernels.errors.NonFiniteError` on the rank that loads it: at ``load_state_dict`` (DCP's
``set_state_dict`` included), else (``dcp.load`` into the state dict alone) before its first send.

Meta device: a model built on ``torch.device("meta")`` (torchtitan's trainer, ``fully_shard`` then ``to_empty``)
gets its residual buffers on meta, and ``to_empty`` leaves them uninitialised. The reduce-scatter's residual is the
module's buffer, checked at every call: until :func:`reset_residuals` zeroes the materialised buffers or a checkpoint
is loaded into them (``load_state_dict``, ``set_model_state_dict``), a reduce-scatter raises
:class:`~torsh_kernels.errors.InvalidArgumentError` before anything is sent, rather than using uninitialised memory
or a residual of its own that the ``state_dict`` would not hold (``torsh_kernels.integrations.torchtitan`` resets
them after torchtitan's ``init_weights``). The same holds for a buffer replaced otherwise (``.to()`` another device).

Streams: on a GPU, FSDP2 calls the all-gather inside its all-gather stream and the reduce-scatter inside
its reduce-scatter stream; the kernels here are launched on the current stream, so they order with the
collectives and with FSDP2's own copies as its default collectives do. With ``async_op=True`` (FSDP2's
``unshard(async_op=True)``) the all-gather returns a ``dist.Work`` whose completion includes the
dequantization, and the reduce-scatter one whose completion includes the fp32 reduction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import check_timeout
from ..collectives.agreement import agree_on, enabled, rendezvous
from ..collectives.communicator import TorchCommunicator, as_communicator, is_communicator
from ..compression import Compressor, NoCompression, compressed_all_reduce
from ..compression.names import as_compressor
from ..errors import ArgumentTypeError, InvalidArgumentError
from .fsdp_comms import LiveSteps, QuantizedAllGather, QuantizedReduceScatter, counting_default_comms
from .fsdp_format import FORMATS, QuantizedCommSpec, QuantizedFormat, encoded_nbytes

__all__ = [
    "FORMATS",
    "Installed",
    "QuantizedAllGather",
    "QuantizedCommSpec",
    "QuantizedFormat",
    "QuantizedReduceScatter",
    "ReplicaAllReduce",
    "apply_quantized_comm",
    "count_traffic",
    "counting_default_comms",
    "encoded_nbytes",
    "managed_parameters",
    "reset_residuals",
]

RESIDUAL = "torsh_rs_residual"
"""Name of the error-feedback residual buffer :func:`apply_quantized_comm` registers on an FSDP module."""


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as e:  # pragma: no cover - torch without FSDP2
        raise InvalidArgumentError(
            "apply_quantized_comm: this torch has no FSDP2 (torch.distributed.fsdp.FSDPModule)"
        ) from e
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"apply_quantized_comm: module must be an nn.Module, got {type(module).__name__}")
    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise InvalidArgumentError(
            "apply_quantized_comm: no FSDPModule in this model; apply torch.distributed.fsdp.fully_shard to its "
            "layers and to the root first (then call this)"
        )
    return mods


def managed_parameters(fsdp_mod: nn.Module) -> list[torch.Tensor]:
    """The parameters one FSDP module shards: those of its subtree not under a nested FSDP module, each once (a tied
    parameter, such as GPT-2's embedding and output weight, is one parameter to FSDP2 and one in its reduce-scatter)."""
    from torch.distributed.fsdp import FSDPModule

    out, seen, stack = [], set(), [fsdp_mod]
    while stack:
        m = stack.pop()
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        stack += [c for c in m.children() if not isinstance(c, FSDPModule)]
    return out


def _groups(mods: list[nn.Module]) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """The FSDP modules' parameter groups, each as (its first module, the parameters it shards), those with
    parameters only. One ``fully_shard([a, b])`` call (torchtitan groups the final norm with the output layer so)
    makes one group for several modules: one all-gather and one reduce-scatter over all their parameters, whose
    comms are set through any of them (the last set wins), so they are installed once per group."""
    groups: dict[int, tuple[nn.Module, list[torch.Tensor]]] = {}
    for m in mods:
        get_state = getattr(m, "_get_fsdp_state", None)  # private in torch 2.13: shared by one call's modules
        key = id(get_state()) if get_state is not None else id(m)
        groups.setdefault(key, (m, []))[1].extend(managed_parameters(m))
    return [g for g in groups.values() if g[1]]


def _shard_group_size(params: list[torch.Tensor]) -> int | None:
    """How many ranks FSDP2 shards these parameters over: the last dimension of their mesh (HSDP's
    ``(replicate, shard)`` included)."""
    mesh = next((p.device_mesh for p in params if hasattr(p, "device_mesh")), None)
    return mesh.size(-1) if mesh is not None else None


def _residual_buffer(fsdp_mod: nn.Module, params: list[torch.Tensor]) -> torch.Tensor | None:
    """Register (or reuse) the module's error-feedback residual: per rank, one fp32 element per element
    of the reduce-scatter input (every parameter's dim 0 padded to a multiple of the shard group's size),
    as a DTensor sharded over the parameters' mesh. Returns its local tensor."""
    from torch.distributed.tensor import DTensor, Shard

    dts = [p for p in params if isinstance(p, DTensor)]
    if not dts:
        return None
    mesh = dts[0].device_mesh
    shard_ws = _shard_group_size(dts)  # FSDP2 shards over the mesh's last dimension (HSDP: (replicate, shard))
    numel = 0
    for p in dts:
        d0 = p.shape[0] if p.dim() else 1
        numel += -(-d0 // shard_ws) * shard_ws * (math.prod(p.shape[1:]) if p.dim() > 1 else 1)
    existing = getattr(fsdp_mod, RESIDUAL, None)
    if isinstance(existing, DTensor) and existing.to_local().numel() == numel:
        return existing.to_local()
    local = torch.zeros(numel, dtype=torch.float32, device=dts[0].to_local().device)
    buf = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False)
    fsdp_mod.register_buffer(RESIDUAL, buf, persistent=True)
    return buf.to_local()


@dataclass(frozen=True, slots=True)
class Installed:
    """What :func:`apply_quantized_comm` installed on one FSDP module: its all-gather, reduce-scatter and replica
    all-reduce, each counting its own traffic (``installed.all_gather.bytes_sent``, ``.calls``). Where one
    ``fully_shard`` call took several modules (one parameter group, one all-gather and one reduce-scatter for them
    all), once, on the first of them (``module``), with the residual buffer sized for the whole group."""

    module: nn.Module
    all_gather: QuantizedAllGather | None
    reduce_scatter: QuantizedReduceScatter | None
    replica_all_reduce: ReplicaAllReduce | None = None

    def __repr__(self) -> str:
        """The module by its class name (not its whole tree), then what was installed on it."""
        return (
            f"Installed(module={type(self.module).__name__}, all_gather={self.all_gather!r}, "
            f"reduce_scatter={self.reduce_scatter!r}, replica_all_reduce={self.replica_all_reduce!r})"
        )


class ReplicaAllReduce:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) that averages the reduce-scattered
    gradient shard over the replicas of an HSDP job through any torsh compressor: FSDP2 shards over one
    mesh dimension (its reduce-scatter averages over the shard group), and this hook averages the result
    over the other (``comm``: the replicate dimension's communicator), compressed. One compression state
    per FSDP module (error feedback where the compressor keeps it)."""

    def __init__(self, comm, compressor, *, check_signatures: bool | None = None) -> None:
        if compressor is not None and not isinstance(compressor, Compressor):
            raise ArgumentTypeError(
                f"apply_quantized_comm: hsdp_grads must be a torsh Compressor, got {type(compressor).__name__}"
            )
        self.check_signatures = enabled(check_signatures, "ReplicaAllReduce")
        self.comm = comm
        self.compressor = compressor
        self.state = compressor.new_state(seed=comm.rank) if compressor is not None else None
        self.calls = 0

    def __repr__(self) -> str:
        return (
            f"ReplicaAllReduce(compressor={self.compressor!r}, world_size={self.comm.world_size}, calls={self.calls})"
        )

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.calls += 1
        compressed_all_reduce(reduce_output.view(-1), self.comm, self.compressor, self.state,
                              check_signatures=self.check_signatures)  # fmt: skip


def _hsdp_replicate(mods: list[nn.Module], replicate: object, what: str) -> object:
    """The replicas' dimension for ``hsdp_grads``: ``replicate`` when given, else ``(root mesh, other dim)``
    of a model sharded over one dimension of a 2-D named mesh; typed errors for FSDP2's native HSDP (its
    own all-reduce would run as well) and for a mesh with no other dimension."""
    mesh = next((p.device_mesh for m in mods for p in managed_parameters(m) if hasattr(p, "device_mesh")), None)
    if mesh is None:
        raise InvalidArgumentError(f"{what}: hsdp_grads: no sharded parameter found; apply fully_shard first")
    if mesh.ndim != 1:
        raise InvalidArgumentError(
            f"{what}: hsdp_grads: this model is sharded on a {mesh.ndim}-D mesh {mesh.mesh_dim_names} (FSDP2's "
            "native HSDP), which all-reduces over the replicate dimension itself, uncompressed, before any hook "
            "runs. For a compressed replica all-reduce shard over the shard dimension only, "
            "fully_shard(m, mesh=mesh['shard']), then pass hsdp_grads= (the replicas' dimension is the other one)"
        )
    if replicate is not None:
        return replicate
    get_root = getattr(mesh, "_get_root_mesh", None)  # private in torch 2.13: the mesh a sub-mesh was sliced from
    root = get_root() if get_root is not None else mesh
    names = mesh.mesh_dim_names or ()
    others = [n for n in (root.mesh_dim_names or ()) if n not in names]
    if root is mesh or len(others) != 1:
        raise InvalidArgumentError(
            f"{what}: hsdp_grads: the model's mesh {names or '(unnamed)'} is not one dimension of a 2-D named "
            "mesh, so the replicas' dimension is unknown; pass replicate= (a communicator, a process group, "
            "a 1-D DeviceMesh or (mesh, 'replicate'))"
        )
    return root, others[0]


def _agree_install(mods, spec: QuantizedCommSpec, hsdp_grads, comm, timeout: float | None, what: str) -> None:
    """:func:`apply_quantized_comm`'s settings and the sharded modules, agreed over the shard group (the
    mesh dimension FSDP2 shards over) before anything is installed; first, every rank of the group must
    reach this call (a rank that did not call it would meet the exchange with FSDP2's own all-gather)."""
    params = [p for m in mods for p in managed_parameters(m)]
    mesh = next((p.device_mesh for p in params if hasattr(p, "device_mesh")), None)
    if mesh is None:
        return  # nothing sharded: no collective will run
    shard = TorchCommunicator(mesh.get_group(mesh.ndim - 1), timeout=timeout)
    rendezvous(shard, "apply_quantized_comm", what=what, timeout=timeout,
               fix="Call apply_quantized_comm on every rank's model, sharded alike.")  # fmt: skip
    specs = {"comms": spec} if hsdp_grads is None else {"comms": spec, "hsdp_grads": hsdp_grads}
    extra = [
        ("hsdp", hsdp_grads is not None),
        # the transport the collectives take, not the class that carries them (a wrapper around the same
        # transport, e.g. a tracing or fault-injecting one on a single rank, issues the same collectives)
        ("transport", shard.backend if comm is None else str(getattr(comm, "backend", type(comm).__name__))),
        ("FSDP modules", len(_groups(mods))),
    ]
    agree_on(shard, "the quantized comms to install", specs=specs, tensors=params, count="parameters", extra=extra,
             what=what,
          fix="Call it with the same settings on every rank, on models sharded alike.")  # fmt: skip


def apply_quantized_comm(
    module: nn.Module,
    spec: QuantizedCommSpec | None = None,
    *,
    hsdp_grads: object = None,
    replicate: object = None,
    comm: object = None,
    timeout: float | None = None,
    check_signatures: bool | None = None,
    **options: object,
) -> list[Installed]:
    """Install :class:`QuantizedAllGather` (``weights``: "int8", "int4" or None) and
    :class:`QuantizedReduceScatter` (``grads``: "int8", "int4" or None) on every ``FSDPModule`` of
    ``module`` (after ``fully_shard``, before training). With gradient quantization and
    ``error_feedback``, each FSDP module gets a persistent buffer ``torsh_rs_residual`` (see
    :class:`QuantizedReduceScatter`), so load checkpoints into a model prepared the same way. Returns
    what it installed per FSDP module that holds parameters (:class:`Installed`; one per ``fully_shard`` call
    that took several modules). On a model built on the meta device, call :func:`reset_residuals` after
    ``to_empty`` (or load a checkpoint) before the first backward.

    HSDP with a compressed replica all-reduce: shard the model over the shard dimension only
    (``fully_shard(m, mesh=mesh["shard"])`` of a 2-D mesh) and pass ``hsdp_grads``, a torsh compressor
    (``FP16()``, ``TopK(0.01)``, ``Quantize(8)``, ...; ``NoCompression()`` for a plain all-reduce) or its
    name (``"fp16"``, ``"topk:0.01"``, ``"int8"``, ``"none"``; the same names as ``weights``/``grads``): each
    FSDP module's reduce-scattered gradient is then averaged over the replicas through it, in FSDP2's
    all-reduce hook (:class:`ReplicaAllReduce`). The replicas' dimension is the mesh's other one, or
    ``replicate`` (a Communicator, a ProcessGroup, a 1-D DeviceMesh or ``(mesh, "replicate")``). FSDP2's
    native HSDP (``fully_shard`` on the 2-D mesh) all-reduces uncompressed before any hook, so
    ``hsdp_grads`` refuses it with a typed error; the quantized all-gather and reduce-scatter work
    there (over the shard dimension). The compressors' states (error feedback) are not part of the
    ``state_dict``.

    ``comm``: a torsh Communicator over the ranks FSDP2 shards over, to carry the quantized weights and
    gradients instead of FSDP2's process group (``make_communicator("cupy-nccl")``, ...); None: FSDP2's.

    ``timeout``: seconds any one collective of the installed comms (and of this call's agreement) may take
    before it fails with a typed ``CollectiveError`` on this rank, e.g. while a peer that raised stays
    alive; None: the process group's timeout (30 minutes by default). A ``comm`` given brings its own.
    FSDP2's own collectives (where ``weights`` or ``grads`` is None, and its other collectives) keep
    the process group's. Every rank must call this function: a rank that does not is named, after the
    timeout, with ``CollectiveTimeoutError`` on the ranks that did (through the store, before anything
    is sent), where gloo would abort the process.

    ``check_signatures``: agree with the ranks of the shard group on these settings and the sharded modules
    before installing anything (one small all-gather; every rank raises ``CollectiveMismatchError`` naming
    what differs otherwise, and the model is left as it was), and let the installed comms agree on each
    new call configuration (see the module docstring). None: on unless ``TORSH_KERNELS_CHECK_SIGNATURES=0``."""
    what = "apply_quantized_comm"
    spec = QuantizedCommSpec.build(spec, options, what)
    hsdp_grads = as_compressor(hsdp_grads, f"{what}: hsdp_grads")  # a name: "fp16", "int8", "topk:0.01"
    check = _check_arguments(hsdp_grads, replicate, comm, check_signatures, what)
    timeout = None if timeout is None else check_timeout(timeout, what)
    mods = _fsdp_modules(module)
    rep = None
    if hsdp_grads is not None:
        replicate = _hsdp_replicate(mods, replicate, what)
        rep = as_communicator(replicate, what, needs=("rank", "world_size", "device", "all_reduce", "all_gather"),
                              timeout=timeout)  # fmt: skip
    if check:
        _agree_install(mods, spec, hsdp_grads, comm, timeout, what)
    if isinstance(hsdp_grads, NoCompression):
        hsdp_grads = None
    changed = []
    steps = LiveSteps()  # the live metrics' record of this model's steps, shared by the comms installed here
    steps.label = ",".join(f"{k}={v}" for k in ("weights", "grads") if (v := getattr(spec, k)) is not None) or "none"
    for m, params in _groups(mods):  # a root that only groups FSDP children has none: FSDP2 runs no collective
        changed.append(_install(m, params, spec, (comm, timeout), rep, hsdp_grads, check))
        for c in (changed[-1].all_gather, changed[-1].reduce_scatter):
            if c is not None:
                c.live = steps
    if changed:
        module.register_forward_pre_hook(steps.boundary)
    return changed


def _check_arguments(hsdp_grads: object, replicate: object, comm: object, check_signatures: bool | None,
                     what: str) -> bool:  # fmt: skip
    """:func:`apply_quantized_comm`'s keyword arguments, each checked (typed errors before the model is looked
    at); returns whether signatures are checked."""
    if hsdp_grads is None and replicate is not None:
        raise InvalidArgumentError(
            f"{what}: replicate= is the replicas' dimension of hsdp_grads; pass hsdp_grads= too (a torsh "
            "compressor, NoCompression() for a plain all-reduce)"
        )
    if hsdp_grads is not None and not isinstance(hsdp_grads, Compressor):
        raise ArgumentTypeError(
            f"{what}: hsdp_grads must be a torsh Compressor (FP16(), TopK(0.01), ...) or its name ('fp16', "
            f"'topk:0.01', ...), got {type(hsdp_grads).__name__}"
        )
    check = enabled(check_signatures, what)
    if comm is not None and not is_communicator(comm, ("all_gather", "all_to_all", "world_size")):
        raise ArgumentTypeError(
            f"{what}: comm must be a torsh Communicator (CupyNcclCommunicator, RdmaCommunicator, ...) or None, "
            f"got {type(comm).__name__}"
        )
    return check


def _install(m: nn.Module, params: list[torch.Tensor], spec: QuantizedCommSpec, transport: tuple, rep: object,
             hsdp_grads: Compressor | None, check: bool) -> Installed:  # fmt: skip
    """Install on one FSDP module (which shards ``params``) the comms ``spec`` asks for over ``transport``
    (comm, timeout), and the replica all-reduce hook over ``rep`` when there is one."""
    comm, timeout = transport
    ag = rs = None
    if (f := spec.format("weights")) is not None:
        ag = QuantizedAllGather(bits=f.bits, block=f.block, fmt=f.fmt, shard_group_size=_shard_group_size(params),
                                comm=comm, timeout=timeout, check_signatures=check)  # fmt: skip
        m.set_custom_all_gather(ag)
    if (f := spec.format("grads")) is not None:
        res = _residual_buffer(m, params) if spec.error_feedback else None
        rs = QuantizedReduceScatter(bits=f.bits, block=f.block, fmt=f.fmt, error_feedback=spec.error_feedback,
                                    residual=res, comm=comm, timeout=timeout, check_signatures=check)  # fmt: skip
        if res is not None:
            rs.bind_buffer(m, RESIDUAL)  # the residual stays the buffer's memory (checked at every call)
        m.set_custom_reduce_scatter(rs)
    m.__dict__[_RS_ATTR] = rs if rs is not None and rs.residual is not None else None
    _on_load(m, rs if rs is not None and rs.residual is not None else None)
    hook = None
    if rep is not None:
        hook = ReplicaAllReduce(rep, hsdp_grads, check_signatures=check)
        m.set_all_reduce_hook(hook)
    return Installed(m, ag, rs, hook)


_LOAD_HOOK = "_torsh_rs_load_hook"
_RS_ATTR = "_torsh_rs_comm"  # the module's QuantizedReduceScatter whose residual is its RESIDUAL buffer


def _on_load(m: nn.Module, rs: QuantizedReduceScatter | None) -> None:
    """After ``m.load_state_dict`` (DCP's ``set_state_dict`` included), hand the residual buffer the
    checkpoint filled to ``rs`` and check it there (finite), so a damaged checkpoint fails at load, typed,
    and a load that replaced the buffer (``assign=True``) is not ignored. One hook per module (the last
    install's)."""
    old = getattr(m, _LOAD_HOOK, None)
    if old is not None:
        old.remove()
    if rs is None:
        return

    def hook(module: nn.Module, incompatible) -> None:
        buf = getattr(module, RESIDUAL, None)
        if buf is not None:
            with torch.no_grad():
                local = buf.to_local() if hasattr(buf, "to_local") else buf
            if local.is_meta:
                return  # loaded into a model not materialised yet: nothing to take (its first use says so)
            rs.use_residual(local.view(-1), f"loaded into {type(module).__name__}.{RESIDUAL}")

    setattr(m, _LOAD_HOOK, m.register_load_state_dict_post_hook(hook))


def reset_residuals(module: nn.Module) -> int:
    """Zero the error-feedback residuals (``torsh_rs_residual`` buffers) :func:`apply_quantized_comm` registered on
    ``module``'s FSDP modules, and hand each to its reduce-scatter: error feedback starts from zero. Call it after
    materialising a model built on the meta device (``model.to_empty(device=...)``, as torchtitan's trainer does;
    ``torsh_kernels.integrations.torchtitan`` does it for you), where the buffers hold uninitialised memory: a
    quantized reduce-scatter refuses to run on a residual that was neither reset nor loaded from a checkpoint
    since (``InvalidArgumentError``). Loading a checkpoint (``load_state_dict``, ``set_model_state_dict``)
    afterwards restores the saved residuals. Returns how many residuals were zeroed (0 where no error-feedback
    residual is installed)."""
    what = "reset_residuals"
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"{what}: module must be an nn.Module, got {type(module).__name__}")
    count = 0
    for m in module.modules():
        buf = m._buffers.get(RESIDUAL)
        if buf is None:
            continue
        with torch.no_grad():
            local = buf.to_local() if hasattr(buf, "to_local") else buf
            if local.is_meta:
                raise InvalidArgumentError(
                    f"{what}: {type(m).__name__}.{RESIDUAL} is on the meta device; materialise the model first "
                    "(model.to_empty(device=...)), then reset the residuals"
                )
            local.zero_()
        rs = m.__dict__.get(_RS_ATTR)
        if rs is not None:
            rs.use_residual(local.view(-1), f"reset in {type(m).__name__}.{RESIDUAL}")
        count += 1
    return count


def count_traffic(module: nn.Module, installed: Sequence[Installed] = ()) -> list:
    """Every comm that will run for ``module``'s FSDP modules, each with ``bytes_sent``: the quantized ones
    ``installed`` by :func:`apply_quantized_comm`, and FSDP2's defaults with counters
    (:func:`counting_default_comms`) installed wherever it left FSDP2's own. Sum their ``bytes_sent``
    before and after a step for the bytes this rank sent."""
    ag_cls, rs_cls = counting_default_comms()
    by_mod = {id(i.module): i for i in installed}
    comms = []
    for m, _ in _groups(_fsdp_modules(module)):
        i = by_mod.get(id(m))
        ag = i.all_gather if i is not None and i.all_gather is not None else None
        rs = i.reduce_scatter if i is not None and i.reduce_scatter is not None else None
        if ag is None:
            ag = ag_cls()
            m.set_custom_all_gather(ag)
        if rs is None:
            rs = rs_cls()
            m.set_custom_reduce_scatter(rs)
        comms += [ag, rs]
    return comms
