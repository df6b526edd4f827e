"""The Compressor contract, and the two ways a payload travels that most compressors share.

A compressor says three things, and nothing outside its own module switches on its type:

1. **what it computes** (one rank, one tensor)::

       state = compressor.new_state()               # per bucket: residuals, PowerSGD's Q, step count
       payload = compressor.compress(tensor, state)  # Payload: tensors to send, .nbytes on the wire
       while not payload.final:                      # PowerSGD: P round, then Q round
           reduce(payload)                           # all-reduce (linear) or all-gather (not linear)
           payload = compressor.advance(payload, state)
       reduce(payload)
       compressor.decompress(payload, state, out, alpha=1 / world_size)

   ``compressor.is_linear``: whether payloads of several ranks may be summed element by element
   (all-reduce) and decompressed once; otherwise they are gathered and decoded with
   ``decompress_sum(payloads, state, out, alpha=...)``. ``state.state_dict()`` /
   ``state.load_state_dict(sd)``: the persistent part of a bucket's state (error-feedback residuals,
   PowerSGD's Q memory, the step count, the seed), bit-exact. Error feedback (TopK, Quantize, Sign,
   PowerSGD): what a step did not send is added to the next step's input, so nothing is lost over time;
   the residual lives in fp32 in the state. Non-finite gradients raise
   :class:`~torsh_kernels.errors.NonFiniteError` before any state changes (``check_finite=False`` skips
   the check).

2. **how its payload travels** among the ranks: ``compressor.reduce(tensors, states, comm)`` returns a
   generator of rounds (each round issues its collectives asynchronously and yields their handles and
   the bytes this rank sent) and the scheme's name. The default is :func:`linear_rounds` (one flat
   all-reduce per round) for linear compressors and :func:`gathered_rounds` (one all-gather of packed
   payloads) for the others; a compressor with a scheme of its own (sign's two phases, quantize's shared
   scale) overrides ``reduce``. The collectives a call issues depend only on the compressor, the
   tensors' shapes and the states' step counts, never on timing or on the data, so ranks that make the
   same calls issue the same collectives in the same order.

3. **what it costs**: ``compressor.schemes(shape, dtype, world_size)`` lists the ways its payload can
   travel, each as the collectives it runs and the bytes each rank puts into them
   (:class:`~torsh_kernels.collectives.cost_model.Round`), which the planner prices with the alpha-beta
   model; ``compressor.passes`` is its compute cost in fp32-tensor-sized passes over memory.

The bucket layer (DDP hooks, the synchronizer) reads ``warmup()`` and ``per_tensor()`` for the
warm-up and size rules it applies per tensor, ``identity`` to skip compression altogether, and
``name`` (the canonical name, for plans and tables) and ``kind`` (the class, for traces and statistics).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..checks import check_bool
from ..collectives.agreement import plain
from ..collectives.communicator import Communicator
from ..collectives.cost_model import Round
from ..errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from ..ops import COMPRESS_DTYPES, PROVIDERS, BucketLayout, count_nonfinite, flatten, unflatten
from .state import STATE_TENSORS as STATE_TENSORS  # (defined in .state, importable from here as before)
from .state import CompressionState as CompressionState
from .state import check_seed

__all__ = [
    "STATE_TENSORS",
    "CompressionState",
    "Compressor",
    "Payload",
    "Rounds",
    "gathered_rounds",
    "linear_rounds",
    "lockstep",
    "roundtrip",
]

Rounds = Iterator[tuple[list, int]]
"""A reduction's rounds: each ``next()`` issues one round's collectives and yields (their handles, the
payload bytes this rank sent); the caller waits on the handles before asking for the next round."""


@dataclass(slots=True)
class Payload:
    """What one rank puts on the wire for one bucket."""

    tensors: dict[str, torch.Tensor]
    """The tensors to all-reduce (linear) or all-gather (not linear), by name."""
    numel: int
    """Elements of the tensor this payload encodes."""
    final: bool = True
    """False if the compressor needs another round (``advance``) after this payload is reduced."""

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for this rank."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self) -> str:
        """The tensors' shapes and dtypes, not their values."""
        ts = ", ".join(f"{k!r}: {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for k, t in self.tensors.items())
        return f"Payload(tensors={{{ts}}}, numel={self.numel}, final={self.final}, nbytes={self.nbytes})"


def check_settings(c: object, what: str) -> None:
    """The settings most compressors share: ``check_finite`` and ``error_feedback`` (where present) bools,
    ``provider`` None or a provider's name."""
    for name in ("check_finite", "error_feedback"):
        if hasattr(c, name):
            check_bool(getattr(c, name), what, name)
    p = getattr(c, "provider", None)
    if p is not None and not isinstance(p, str):
        raise ArgumentTypeError(f"{what}: provider must be None or a provider's name, got {type(p).__name__} {p!r}")
    if p is not None and p not in PROVIDERS:
        raise InvalidArgumentError(f"{what}: provider {p!r} is not one of {', '.join(PROVIDERS)} (or None: automatic)")


_SIGNATURE_FIELDS: dict[type, tuple[str, ...]] = {}


def _signature_fields(cls: type) -> tuple[str, ...]:
    names = _SIGNATURE_FIELDS.get(cls)
    if names is None:
        fs = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
        names = tuple(f.name for f in fs if f.name != "provider" and not f.name.startswith("_"))
        _SIGNATURE_FIELDS[cls] = names
    return names


def check_input(tensor: object, what: str) -> torch.Tensor:
    """The tensor to compress, flat and detached; a typed error for anything else."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in COMPRESS_DTYPES:
        raise InvalidArgumentError(f"{what}: tensor dtype {tensor.dtype}; expected float32, float16 or bfloat16")
    return tensor.detach().reshape(-1)


def check_out(out: object, numel: int, what: str) -> torch.Tensor:
    """``out`` flat, after checking it can take ``numel`` decompressed elements."""
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.numel() != numel:
        raise ShapeError(f"{what}: out has {out.numel()} elements, the payload encodes {numel}")
    if not out.is_contiguous():
        raise ShapeError(f"{what}: out must be contiguous")
    return out.view(-1)


def numel_of(shape: int | tuple[int, ...]) -> int:
    """Elements of a shape, or the count itself."""
    return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def decode_plain(data: torch.Tensor, out: torch.Tensor, alpha: float, accumulate: bool, provider) -> None:
    """out (+)= alpha * data, cast to out's dtype: the fused unflatten of a one-tensor bucket."""
    unflatten(data, BucketLayout.for_tensors([data]), [out], scale=alpha, accumulate=accumulate, provider=provider)


def raise_if_nonfinite(t: torch.Tensor, what: str) -> None:
    """NonFiniteError naming ``what`` if ``t`` holds NaN or Inf."""
    bad = int(count_nonfinite(t))
    if bad:
        raise NonFiniteError(f"{what}: {bad} non-finite element(s) (NaN/Inf) in the tensor or its payload")


def raise_if_reduced_nonfinite(t: torch.Tensor, compressor: Compressor) -> None:
    """NonFiniteError if an all-reduced payload holds NaN or Inf although every rank checked its own input:
    a sum that overflowed, or a payload corrupted on the way. Every rank holds the same sum, so every rank
    raises, before anything is decoded into the output or the compressor's state. (Gathered payloads are
    not checked: top-k's values and int8's scales are finite when the input is, and their decode runs in
    a completion callback, where a host read would wait for the collective on a GPU.)"""
    bad = int(count_nonfinite(t))
    if bad:
        raise NonFiniteError(
            f"compressed_all_reduce ({compressor.kind}): the reduced payload holds {bad} non-finite element(s) "
            "(NaN/Inf) although each rank's input was checked: a rank's payload turned non-finite on the way "
            "(an overflow, a corrupted buffer); nothing was decoded and every rank raises this. Skip the step, "
            "or pass check_finite=False to the compressor to let it through"
        )


# -- the contract ---------------------------------------------------------------------------------------


class Compressor:
    """Base class: see the module docstring for the contract."""

    is_linear: bool = False
    """Payloads of several ranks may be summed element by element (all-reduced) and decoded once."""
    identity: bool = False
    """Sends the tensor as it is: the bucket layer then skips compression planning altogether."""
    prescale: bool = False
    """Linear payloads are divided by the world size before the sum (so a narrow dtype cannot overflow)."""
    passes: float = 5.0
    """Compress + decompress cost in fp32-tensor-sized passes over memory (a rough estimate, for the
    planner's compute term)."""
    provider: str | None

    @property
    def name(self) -> str:
        """The canonical name: the string that builds an equal compressor (``"int8"``, ``"topk:0.01"``,
        ``"powersgd:4"``; see :mod:`~torsh_kernels.compression.names`), as plans, ``auto``'s table and its
        choice show it. A class outside the registry is named by its class, lower case."""
        from .names import compressor_name

        return compressor_name(self)

    @property
    def kind(self) -> str:
        """How traces and the bucket statistics tag it (``"TopK round 1"``, a bucket's ``compressor``): the
        class's name, ``"none"`` for the uncompressed path (what ``torsh report`` reads)."""
        return type(self).__name__

    def label(self) -> str:
        """The canonical :attr:`name` (kept for callers of the former short label)."""
        return self.name

    @property
    def stateful(self) -> bool:
        """Needs its own state per tensor, kept across steps (error feedback, warm starts): every
        non-linear compressor; a linear one that keeps state says so."""
        return not self.is_linear

    def signature(self) -> tuple[tuple[str, object], ...]:
        """What ranks must share for their collectives to match, as (name, value) pairs: the class, then
        every field of a dataclass compressor except ``provider`` (a kernel provider changes no byte on the
        wire). Values that are not plain (numbers, strings, None, dtypes, tuples of them) stand as their
        type's name, so that every rank describes them alike. The driver and the bucket layer exchange it
        once per configuration (:mod:`~torsh_kernels.collectives.agreement`); a compressor with settings
        outside its fields that change its collectives adds them by overriding this."""
        cls = type(self)
        return (("class", f"{cls.__module__}.{cls.__qualname__}"),
                *((n, plain(getattr(self, n))) for n in _signature_fields(cls)))  # fmt: skip

    def describe(self) -> str:
        """The signature as one line: ``TopK(ratio=0.01, exact=False, ...)``."""
        sig = self.signature()
        return f"{type(self).__name__}(" + ", ".join(f"{n}={v!r}" for n, v in sig[1:]) + ")"

    def signature_fields(self, prefix: str = "compressor") -> list[tuple[str, object]]:
        """The signature as fields of an exchange: ``prefix`` (the class's name), then ``prefix.setting``
        for each setting (a mismatch message names the class alone when it differs)."""
        sig = self.signature()
        return [(prefix, type(self).__name__ if sig[0][1].endswith("." + type(self).__qualname__) else sig[0][1]),
                *((f"{prefix}.{n}", v) for n, v in sig[1:])]  # fmt: skip

    def phase(self, state: CompressionState) -> int:
        """A small number that, with the signature and the tensors' shapes, fixes the collectives
        ``reduce`` issues for a tensor with this ``state``: 0 unless they depend on the state (PowerSGD's
        seed broadcast on a fresh state, its uncompressed steps before ``start_iter``). Ranks must agree
        on it; the driver exchanges it with the signature."""
        return 0

    # -- what it computes --------------------------------------------------------------------------

    def new_state(self, seed: int = 0) -> CompressionState:
        return CompressionState(check_seed(seed, f"{type(self).__name__}.new_state"), type(self).__name__)

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        raise NotImplementedError

    def advance(self, payload: Payload, state: CompressionState) -> Payload:
        raise InvalidArgumentError(f"{type(self).__name__} sends one round; advance() is only for payload.final=False")

    def decompress(
        self, payload: Payload, state: CompressionState, out: torch.Tensor, *, alpha: float = 1.0,
        accumulate: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError

    def decompress_sum(
        self, payloads: list[Payload], state: CompressionState, out: torch.Tensor, *, alpha: float = 1.0
    ) -> torch.Tensor:
        """``out = alpha * sum of the payloads' decompressions`` (the gathered payloads of all ranks)."""
        if not payloads:
            raise InvalidArgumentError(f"{type(self).__name__}.decompress_sum: no payloads")
        for i, p in enumerate(payloads):
            self.decompress(p, state, out, alpha=alpha, accumulate=i > 0)
        return out

    def payload_nbytes(self, shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Bytes one rank sends, all rounds together, for a tensor of this shape (or element count) and
        dtype: the cost model's input."""
        raise NotImplementedError

    # -- how it travels ----------------------------------------------------------------------------

    carries_plain: bool = False
    """``reduce`` takes ``plain=``: tensors averaged uncompressed in the first round's collective
    (:func:`linear_rounds`, :func:`gathered_rounds`), so a bucket's 1-D and small tensors need no
    collective of their own."""

    def reduce(
        self, tensors: list[torch.Tensor], states: list[CompressionState], comm: Communicator, *,
        link=None, plain: Sequence[torch.Tensor] = (),
    ) -> tuple[Rounds, str]:  # fmt: skip
        """The rounds that average ``tensors`` (non-empty, validated, one state each) over ``comm`` in
        place, and the scheme's name. ``link`` informs a compressor with several schemes that picks one by
        the cost model (its own setting, e.g. ``Quantize(scheme="auto")``); the others ignore it.
        ``plain``: see ``carries_plain`` (a compressor that overrides ``reduce`` without it leaves
        ``carries_plain`` False)."""
        if self.is_linear:
            return linear_rounds(tensors, states, comm, self, plain), "all_reduce"
        return gathered_rounds(tensors, states, comm, self, plain), "all_gather"

    # -- what it costs -------------------------------------------------------------------------------

    def schemes(
        self, shape: int | tuple[int, ...], dtype: torch.dtype, world_size: int
    ) -> dict[str, tuple[Round, ...]]:
        """The ways this compressor's payload for a tensor of ``shape`` can travel, by name, each as the
        collectives it runs in order with the bytes each rank puts in. A linear compressor's scheme is
        named 'all_reduce' (the planner names it after the all-reduce algorithm it prices)."""
        nb = self.payload_nbytes(shape, dtype)
        if self.is_linear:
            return {"all_reduce": (Round("all_reduce", nb),)}
        return {"all_gather": (Round("all_gather", nb),)}

    # -- how the bucket layer applies it -------------------------------------------------------------

    def warmup(self) -> tuple[int, float]:
        """(start_iter, min_compression_rate) that the bucket layer applies per tensor unless told
        otherwise: steps sent uncompressed first, and the bytes-in / bytes-on-the-wire ratio below which
        a tensor is sent uncompressed."""
        return 0, 2.0

    def per_tensor(self, min_compression_rate: float) -> Compressor:
        """This compressor as the bucket layer runs it, once that layer applies the warm-up and the size
        rule itself (a compressor that applies them on its own returns a copy that does not)."""
        return self


# -- shared schemes ---------------------------------------------------------------------------------------


def lockstep(gens: Sequence[Rounds]) -> Rounds:
    """Run several per-tensor round generators together: round k of tensor 0, then of tensor 1, ..."""
    live = list(gens)
    while live:
        handles, nbytes, nxt = [], 0, []
        for g in live:
            try:
                hs, nb = next(g)
            except StopIteration:
                continue
            handles += hs
            nbytes += nb
            nxt.append(g)
        live = nxt
        if live:
            yield handles, nbytes


def linear_rounds(tensors, states, comm: Communicator, compressor: Compressor, plain=()) -> Rounds:
    """Linear compressors: per round, every tensor's payload in one flat all-reduce per dtype. ``plain``
    tensors (uncompressed, averaged in place) join the first round's all-reduce of their dtype."""
    ws = comm.world_size
    check = getattr(compressor, "check_finite", False)
    prescaled = compressor.prescale  # divided by ws before the sum so the payload dtype cannot overflow
    if plain and prescaled:
        raise InvalidArgumentError("linear_rounds: plain tensors cannot ride along a prescaled payload")
    payloads = [compressor.compress(t, s) for t, s in zip(tensors, states)]
    active = list(range(len(tensors)))
    while active:
        groups: dict[torch.dtype, list[tuple[int, str, torch.Tensor]]] = {}
        for i in active:
            for name, t in payloads[i].tensors.items():
                groups.setdefault(t.dtype, []).append((i, name, t))
        for t in plain:  # the first round only: index -1 marks them
            groups.setdefault(t.dtype, []).append((-1, "", t))
        handles, bufs, nbytes = [], [], 0
        for items in groups.values():
            ts = [t for _, _, t in items]
            if len(ts) == 1 and ts[0].is_contiguous():
                flat, layout = ts[0], None
                if prescaled:
                    flat.div_(ws)
            else:
                flat, layout = flatten(ts, scale=1.0 / ws if prescaled else 1.0)
            nbytes += flat.numel() * flat.element_size()
            handles.append(comm.all_reduce(flat, "sum", async_op=True))
            bufs.append((items, flat, layout))
        yield handles, nbytes
        if check:  # every rank holds the same sums: all raise alike, before anything is decoded
            for _, flat, _ in bufs:
                raise_if_reduced_nonfinite(flat, compressor)
        for items, flat, layout in bufs:
            if layout is not None:
                for (i, name, t), v in zip(items, layout.views(flat)):
                    if i < 0:
                        torch.div(v.view(t.shape), ws, out=t)  # as a plain all-reduce's average
                    else:
                        payloads[i].tensors[name] = v
            elif items[0][0] < 0:
                flat.div_(ws)  # a lone plain tensor, reduced in place
        plain = ()
        nxt = []
        for i in active:
            if payloads[i].final:
                compressor.decompress(payloads[i], states[i], tensors[i], alpha=1.0 if prescaled else 1.0 / ws)
            else:
                payloads[i] = compressor.advance(payloads[i], states[i])
                nxt.append(i)
        active = nxt


def gathered_rounds(tensors, states, comm: Communicator, compressor: Compressor, plain=()) -> Rounds:
    """Non-linear compressors (top-k, gathered int8/int4): every tensor's payload packed into one byte
    buffer, one all-gather, then each tensor decoded from every rank's segment. ``plain`` tensors (one
    dtype, uncompressed, averaged in place) travel at the end of the same buffer; each rank sums the
    ranks' copies in rank order."""
    ws = comm.world_size
    payloads = [compressor.compress(t, s) for t, s in zip(tensors, states)]
    if not all(p.final for p in payloads):
        raise InvalidArgumentError(
            "compressed_all_reduce: a non-linear compressor with several rounds is not supported"
        )
    packs = [_pack(p) for p in payloads]
    bufs = [b for b, _ in packs]
    if plain:
        flat, layout = flatten(plain)
        bufs.append(flat.view(torch.uint8))
        pad = -flat.nbytes % 8  # so the ranks' segments stay aligned
        if pad:
            bufs.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
    buf = bufs[0] if len(bufs) == 1 else torch.cat(bufs)
    gathered = torch.empty(ws * buf.numel(), dtype=torch.uint8, device=buf.device)
    yield [comm.all_gather(gathered, buf, async_op=True)], buf.numel()
    seg = buf.numel()
    off = 0
    for t, s, p, (b, spec) in zip(tensors, states, payloads, packs):
        parts = [_unpack(gathered[r * seg + off : r * seg + off + b.numel()], spec, p.numel) for r in range(ws)]
        compressor.decompress_sum(parts, s, t, alpha=1.0 / ws)
        off += b.numel()
    if plain:
        n = flat.nbytes
        acc = gathered[off : off + n].view(flat.dtype).clone()
        for r in range(1, ws):
            acc += gathered[r * seg + off : r * seg + off + n].view(flat.dtype)
        acc.div_(ws)  # as a plain all-reduce's average
        unflatten(acc, layout, plain)


def _pack(payload: Payload) -> tuple[torch.Tensor, list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]:
    """The payload's tensors as one uint8 buffer (largest elements first, so every view stays aligned;
    the length padded to 8 so the ranks' segments do too), and how to read it back."""
    items = sorted(payload.tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    spec, off = [], 0
    for name, t in items:
        nb = t.numel() * t.element_size()
        spec.append((name, t.dtype, tuple(t.shape), off, nb))
        off += nb
    total = -(-off // 8) * 8
    dev = items[0][1].device if items else torch.device("cpu")
    buf = (torch.zeros if total != off else torch.empty)(total, dtype=torch.uint8, device=dev)
    for (_, t), (_, _, _, o, nb) in zip(items, spec):
        if nb:
            buf[o : o + nb].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf, spec


def _unpack(seg: torch.Tensor, spec, numel: int) -> Payload:
    tensors = {}
    for name, dtype, shape, o, nb in spec:
        tensors[name] = seg[o : o + nb].view(dtype).view(shape)
    return Payload(tensors, numel)


def roundtrip(
    compressor: Compressor, tensor: torch.Tensor, state: CompressionState, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[Payload]]:
    """Compress and decompress on one process (world size 1: every reduction is the identity).
    Returns the decompressed tensor and the payload of each round."""
    payloads = [compressor.compress(tensor, state)]
    while not payloads[-1].final:
        payloads.append(compressor.advance(payloads[-1], state))
    if out is None:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return compressor.decompress(payloads[-1], state, out), payloads
