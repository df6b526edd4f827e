"""What an expert-parallel MoE layer sends: :class:`ExpertWireSpec` (the row formats of its four all-to-alls) and
the exchange itself (dispatch, local experts, combine), :class:`~torsh_kernels.parallel.ExpertParallelMoE`'s
forward between the routing and the unpermute.

**Formats.** Each of the four all-to-alls of a step carries rows of ``hidden`` values in one format:

- ``None``: the rows in the layer's dtype, as they are (no rounding);
- ``"bf16"``: the rows cast to bfloat16 (2 bytes a value; exact for a bf16 layer; rounding to nearest even,
  relative error at most 2**-9 per value otherwise);
- a :class:`~torsh_kernels.ops.RowQuantSpec` (``"fp8"``/``"e4m3"``, ``"e5m2"``, ``"int8"`` by name): each row
  packed as its codes (1 byte a value) followed by one fp32 scale per ``block`` channels, in one uint8 row of
  :func:`~torsh_kernels.ops.row_wire_bytes` bytes, so the scales travel in the same all-to-all. A value's error
  is at most 2**-4 (e4m3), 2**-3 (e5m2) or 0.5/127 (int8) of its tile's absolute maximum.

The dispatch (tokens to experts) and the combine (expert outputs back) run in the forward; their reverses run in
the backward: ``grad_combine`` (the gradient of the combined rows, tokens to experts) and ``grad_dispatch`` (the
gradient of the dispatched rows, experts to tokens). DeepSeek-V3's recipe is ``ExpertWireSpec(dispatch="e4m3")``
(``wire="fp8"``): dispatch in e4m3 with a scale per 128 channels, the combine in bf16 (``combine="auto"``: bf16
when the dispatch is compressed, else the layer's dtype), the gradients in the layer's dtype.

**Fused passes.** A compressed dispatch quantizes the permuted rows in the pass that permutes them
(``quantize_rows(x, spec, index=routing.token_index)``: no [N, H] copy in the layer's dtype), sends the packed
rows in one all-to-all and decodes them on arrival in the pass that regroups them by local expert
(``dequantize_rows(..., index=regroup)``). The combine encodes the expert outputs in arrival order in one pass
(``index=`` the inverse regroup) and decodes them into the permuted layout that ``moe_unpermute`` reads.

**Autograd.** The quantization is straight-through: the gradient is computed as if each encode-decode were the
identity. The dispatch's backward sends the rows' gradients back (in ``grad_dispatch``) and sums them into their
tokens (the permute's backward, ``moe_unpermute(weights=False)``); the combine's backward sends the gradient of
the combined rows to the experts (in ``grad_combine``), regrouped on arrival.

``wire=None`` (all four None, the default) runs the layer exactly as before this module existed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..ops.moe import Routing, moe_permute, moe_unpermute
from ..specs import Spec
from .live_step import StepMeter

if TYPE_CHECKING:
    from ..ops.rowquant import RowQuantSpec
    from .moe import ExpertParallelMoE

__all__ = ["WIRE_FORMATS", "WIRE_PRESETS", "ExpertWireSpec", "exchange", "wire_format"]

WIRE_FORMATS = ("bf16", "fp8", "e4m3", "e5m2", "int8")
"""The names a wire format field takes besides None and a RowQuantSpec ("fp8" is "e4m3")."""
WIRE_PRESETS = ("fp8", "e4m3", "e5m2", "int8", "bf16")
"""``ExpertParallelMoE(wire=name)``: ``ExpertWireSpec(dispatch=name)`` (the combine in bf16, the gradients in the
layer's dtype)."""


def _rowquant():
    """The row wire ops (imported at the first compressed format: the plain layer does without them)."""
    from ..ops import rowquant

    return rowquant


def wire_format(value: object, what: str, name: str) -> RowQuantSpec | str | None:
    """A wire format field's value resolved: None, "bf16" or a RowQuantSpec (a name made one: "fp8" and "e4m3"
    the e4m3 format, "e5m2", "int8", each with a scale per 128 channels). Anything else is a typed error."""
    if value is None or (isinstance(value, str) and value == "bf16"):
        return value
    if not isinstance(value, str):
        if isinstance(value, _rowquant().RowQuantSpec):
            return value
        raise ArgumentTypeError(
            f"{what}: {name} must be None, a format name or a RowQuantSpec, got {type(value).__name__} {value!r}"
        )
    if value in WIRE_FORMATS:
        return _rowquant().RowQuantSpec(fmt="e4m3" if value == "fp8" else value)
    raise InvalidArgumentError(
        f"{what}: {name}={value!r}; expected None (the layer's dtype), one of {', '.join(map(repr, WIRE_FORMATS))} "
        "or a RowQuantSpec"
    )


def _name(f: RowQuantSpec | str | None) -> str:
    if f is None:
        return "dtype"
    if isinstance(f, str):
        return f
    return f"{f.fmt}/{f.block}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertWireSpec(Spec):
    """The formats of an expert-parallel layer's four all-to-alls (see the module docstring)."""

    dispatch: RowQuantSpec | str | None = None
    """Tokens to experts: None (the layer's dtype), "bf16", or a RowQuantSpec ("fp8"/"e4m3", "e5m2", "int8")."""
    combine: RowQuantSpec | str | None = "auto"
    """Expert outputs back: as dispatch; "auto" (stored resolved): "bf16" when dispatch is set, else None."""
    grad_combine: RowQuantSpec | str | None = None
    """Backward, the combined rows' gradient to the experts: as dispatch (None: the layer's dtype)."""
    grad_dispatch: RowQuantSpec | str | None = None
    """Backward, the dispatched rows' gradient back to their tokens: as dispatch (None: the layer's dtype)."""

    def __post_init__(self) -> None:
        what = "ExpertWireSpec"
        self.normalize("dispatch", wire_format(self.dispatch, what, "dispatch"))
        if self.combine == "auto":
            self.normalize("combine", None if self.dispatch is None else "bf16")
        for name in ("combine", "grad_combine", "grad_dispatch"):
            self.normalize(name, wire_format(getattr(self, name), what, name))

    @classmethod
    def of(cls, wire: object, what: str) -> ExpertWireSpec:
        """The layer's ``wire`` argument as a spec: None (every row in the layer's dtype), an ExpertWireSpec, or
        a preset's name (:data:`WIRE_PRESETS`: the dispatch in that format, the combine in bf16)."""
        if wire is None:
            return cls()
        if isinstance(wire, cls):
            return wire
        if isinstance(wire, str):
            if wire not in WIRE_PRESETS:
                raise InvalidArgumentError(
                    f"{what}: wire={wire!r}; expected None, an ExpertWireSpec or one of "
                    f"{', '.join(map(repr, WIRE_PRESETS))}"
                )
            return cls(dispatch=wire)
        raise ArgumentTypeError(
            f"{what}: wire must be None, an ExpertWireSpec or a format name, got {type(wire).__name__} {wire!r}"
        )

    @property
    def plain(self) -> bool:
        """Every all-to-all in the layer's dtype (the layer as it was before wire formats)."""
        return all(f is None for f in (self.dispatch, self.combine, self.grad_combine, self.grad_dispatch))

    def __str__(self) -> str:
        s = f"dispatch={_name(self.dispatch)}, combine={_name(self.combine)}"
        if self.grad_combine is not None or self.grad_dispatch is not None:
            s += f", grad_combine={_name(self.grad_combine)}, grad_dispatch={_name(self.grad_dispatch)}"
        return s


class _Codec:
    """Rows of ``hidden`` values of ``dtype`` in one wire format: encode (optionally gathering rows, -1 a zero
    row), and decode (optionally gathering) back to ``dtype``."""

    __slots__ = ("dtype", "fmt", "hidden", "row_bytes", "wire_dtype")

    def __init__(self, fmt: RowQuantSpec | str | None, hidden: int, dtype: torch.dtype) -> None:
        self.fmt, self.hidden, self.dtype = fmt, hidden, dtype
        if self.packed:
            self.wire_dtype, self.row_bytes = torch.uint8, _rowquant().row_wire_bytes(hidden, fmt)
        else:
            self.wire_dtype = torch.bfloat16 if fmt == "bf16" else dtype
            self.row_bytes = hidden * self.wire_dtype.itemsize

    @property
    def packed(self) -> bool:
        """Codes and scales in uint8 rows (a RowQuantSpec), not values."""
        return self.fmt is not None and not isinstance(self.fmt, str)

    def encode(self, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            return _rowquant().quantize_rows(x, self.fmt, index=index)
        if index is not None:
            pad = index < 0
            x = x.index_select(0, index.clamp(min=0))
            if x.shape[0] and bool(pad.any()):
                x.masked_fill_(pad[:, None], 0)
        return x.to(self.wire_dtype).contiguous()

    def decode(self, w: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            return _rowquant().dequantize_rows(w, self.fmt, hidden=self.hidden, dtype=self.dtype, index=index)
        if index is not None:
            w = w.index_select(0, index)
        return w.to(self.dtype)


def _all_to_all(comm: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), x.shape[1])
    comm.all_to_all(out, x.contiguous(), out_splits, in_splits)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks in ``in_splits`` order; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = x.new_empty(sum(out_splits), x.shape[1])
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        gi = g.new_empty(sum(ctx.in_splits), g.shape[1])
        ctx.comm.all_to_all(gi, g.contiguous(), ctx.in_splits, ctx.out_splits)
        return gi, None, None, None


class _Dispatch(torch.autograd.Function):
    """Tokens ``x [T, H]`` -> the rows this rank's experts receive, grouped by local expert ``[M, H]``: permute
    and encode in one pass, one all-to-all, decode and regroup in one pass. Straight-through backward: the
    rows' gradients encoded in arrival order, the reverse all-to-all, decoded and summed into their tokens."""

    @staticmethod
    def forward(ctx, x, routing, comm, fwd, bwd, recv_splits, send_splits, regroup, inverse):
        ctx.routing, ctx.comm, ctx.bwd = routing, comm, bwd
        ctx.splits, ctx.inverse = (recv_splits, send_splits), inverse
        sent = fwd.encode(x, routing.token_index)
        return fwd.decode(_all_to_all(comm, sent, recv_splits, send_splits), regroup)

    @staticmethod
    def backward(ctx, g):
        recv_splits, send_splits = ctx.splits
        back = _all_to_all(ctx.comm, ctx.bwd.encode(g.contiguous(), ctx.inverse), send_splits, recv_splits)
        gx = moe_unpermute(ctx.bwd.decode(back), ctx.routing, weights=False)  # the permute's backward
        return gx, *(None,) * 8


class _Combine(torch.autograd.Function):
    """Expert outputs grouped by local expert ``[M, H]`` -> their rows in the permuted layout of the tokens'
    ranks ``[N, H]``: encode in arrival order in one pass, one all-to-all, decode. Straight-through backward:
    the gradient encoded, the reverse all-to-all, decoded and regrouped by local expert in one pass."""

    @staticmethod
    def forward(ctx, y, comm, fwd, bwd, send_splits, recv_splits, regroup, inverse):
        ctx.comm, ctx.bwd, ctx.splits, ctx.regroup = comm, bwd, (send_splits, recv_splits), regroup
        return fwd.decode(_all_to_all(comm, fwd.encode(y, inverse), send_splits, recv_splits))

    @staticmethod
    def backward(ctx, g):
        send_splits, recv_splits = ctx.splits
        back = _all_to_all(ctx.comm, ctx.bwd.encode(g.contiguous()), recv_splits, send_splits)
        return ctx.bwd.decode(back, ctx.regroup), *(None,) * 7


def _wire_bytes(comm: Any, send: list[int], recv: list[int], row_out: int, row_back: int) -> int:
    """Bytes this rank puts on the wire for a dispatch-direction all-to-all of rows of ``row_out`` bytes and a
    combine-direction one of ``row_back`` bytes (its rows to itself excluded)."""
    me = comm.rank
    return (sum(send) - send[me]) * row_out + (sum(recv) - recv[me]) * row_back


def exchange(layer: ExpertParallelMoE, x2: torch.Tensor, r: Routing) -> torch.Tensor:
    """Dispatch the tokens ``x2 [T, H]`` routed by ``r``, run the local experts, combine: the expert outputs in
    the permuted layout ``[N, H]`` (what ``moe_unpermute`` reads). Sets ``layer.last_dispatch``."""
    comm, wire = layer.comm, layer.wire
    W, El, H = comm.world_size, layer.local_experts, layer.spec.hidden
    if r.padded:  # static splits: capacity rows per (rank, expert), no count exchange
        C = r.capacity
        layer._agree_capacity(C)
        send_splits = recv_splits = [El * C] * W
        counts = [W * C] * El
        rows = torch.tensor(counts, device=x2.device)
        regroup = None
        if W > 1 and El > 1:  # arrival (source, expert, row) -> (expert, source, row): a transpose of [W, El] blocks
            regroup = torch.arange(W * El * C, device=x2.device).view(W, El, C).transpose(0, 1).reshape(-1)
    else:
        tpe = r.tokens_per_expert  # [E]
        recv_counts = torch.empty_like(tpe)
        comm.all_to_all(recv_counts, tpe)  # recv_counts[src * El + e]: rows src sends my expert e
        send_splits = tpe.view(W, El).sum(1).tolist()
        rc = recv_counts.view(W, El)
        recv_splits = rc.sum(1).tolist()
        counts = rc.sum(0).tolist()
        rows = rc.sum(0)
        regroup = None
        if W > 1 and El > 1:  # regroup by local expert: (expert 0: src 0, src 1, ...), (expert 1: ...), ...
            sizes = rc.reshape(-1).tolist()  # chunk (src, e) is sizes[src * El + e] rows of the arrival order
            starts = [0, *itertools.accumulate(sizes)]
            chunks = [src * El + e for e in range(El) for src in range(W)]
            regroup = torch.cat([torch.arange(starts[c], starts[c] + sizes[c]) for c in chunks]).to(x2.device)
    if wire.plain:
        yp, row_out, row_back = _plain(layer, x2, r, send_splits, recv_splits, regroup, rows, counts)
        grad_out, grad_back = row_back, row_out
    else:
        inverse = None if regroup is None else torch.argsort(regroup)
        dt = x2.dtype
        fwd, bwd = _Codec(wire.dispatch, H, dt), _Codec(wire.grad_dispatch, H, dt)
        xe = _Dispatch.apply(x2, r, comm, fwd, bwd, recv_splits, send_splits, regroup, inverse)
        ye = layer._experts(xe, rows, counts)
        cf, cb = _Codec(wire.combine, H, ye.dtype), _Codec(wire.grad_combine, H, ye.dtype)
        yp = _Combine.apply(ye, comm, cf, cb, send_splits, recv_splits, regroup, inverse)
        row_out, row_back, grad_out, grad_back = fwd.row_bytes, cf.row_bytes, cb.row_bytes, bwd.row_bytes
    layer.last_dispatch = {
        "sent_rows": send_splits, "received_rows": recv_splits, "dropped": r.num_dropped,
        "bytes_sent": _wire_bytes(comm, send_splits, recv_splits, row_out, row_back),
        "backward_bytes_sent": _wire_bytes(comm, send_splits, recv_splits, grad_out, grad_back),
        "wire": str(wire),
        # what the layer in x's dtype (wire=None) sends for the same rows, forward and backward
        "plain_bytes": 2 * _wire_bytes(comm, send_splits, recv_splits, H * x2.element_size(), H * x2.element_size()),
    }  # fmt: skip
    return yp


_EP_LAYERS = itertools.count()


def publish_step(layer: ExpertParallelMoE, pub) -> None:
    """At a forward's start, while someone listens: the live record of the layer's previous step (its forward
    and backward, from the previous forward's start to now). The all-to-alls are synchronous, so the seconds
    they were in flight are the seconds this rank waited for them (``comm_s``); the codecs' time is not
    measured apart (``compress_s`` null). A second EP layer of the process publishes as source "ep:1", ..."""
    m = layer.__dict__.get("_live_meter")
    if m is None:
        n = next(_EP_LAYERS)
        m = StepMeter("ep" if n == 0 else f"ep:{n}")
        layer.__dict__["_live_meter"] = m
        m.watch(layer.comm)
        m.lap()
        return
    step_s = m.lap()
    wire_b, busy = m.traffic()
    d = layer.last_dispatch
    if not d:
        return
    comm, w = layer.comm, layer.wire
    sent = int(d["bytes_sent"]) + int(d["backward_bytes_sent"])
    pub.publish(m.record(
        step=m.steps, rank=comm.rank, world_size=comm.world_size, step_s=step_s, comm_s=busy, compress_s=None,
        payload_bytes=d["plain_bytes"], sent_bytes=sent, wire_bytes=wire_b, busy_s=busy, nonfinite=False,
        compressor="none" if w.plain else str(w).replace(", ", ",").replace("dispatch=", "").replace("combine=", ""),
    ))  # fmt: skip


def _plain(layer, x2, r, send_splits, recv_splits, regroup, rows, counts):
    """The exchange with every row in the layer's dtype (``wire=None``): permute, all-to-all, regroup, experts,
    the reverse, each a differentiable op. Returns (rows, dispatch row bytes, combine row bytes)."""
    comm, W, El, H = layer.comm, layer.comm.world_size, layer.local_experts, layer.spec.hidden
    xp = moe_permute(x2, r, provider=layer.provider)  # [N, H], grouped by expert = by destination rank
    xr = _AllToAll.apply(xp, comm, recv_splits, send_splits)  # [sum recv, H]: by source, then expert
    if regroup is None:
        yr = layer._experts(xr, rows, counts)
    elif r.padded:  # a transpose of the [W, El] blocks of C rows
        C = r.capacity
        xe = xr.view(W, El, C, H).transpose(0, 1).reshape(El * W * C, H)
        yr = layer._experts(xe, rows, counts).view(El, W, C, H).transpose(0, 1).reshape(W * El * C, H)
    else:
        ye = layer._experts(xr.index_select(0, regroup), rows, counts)
        yr = ye.index_select(0, torch.argsort(regroup))
    yp = _AllToAll.apply(yr, comm, send_splits, recv_splits)
    return yp, H * x2.element_size(), H * yr.element_size()
