"""The expert-parallel layer's compressed all-to-alls (ExpertWireSpec) on real gloo processes, world 2 and 4.

Each case runs three ways on the same weights and tokens:

- the ExpertParallelMoE with the wire formats (every rank its own tokens);
- an emulation on one process: the single-process layer's own pieces (route, permute, experts, unpermute) with
  each all-to-all replaced by encoding and decoding its rows in place, straight-through (forward: the rows
  encoded and decoded; backward: the gradient encoded and decoded in the backward's format). The EP layer must
  match it to float rounding (the dispatch, the regroup, the combine and the autograd plumbing are right);
- the uncompressed single-process layer: the EP output must lie within a bound derived from the formats (below),
  the gradients within the formats' error, and the straight-through gradient must match finite differences of
  the unquantized layer (in float64) within the formats' error.

The output bound. A value x_i of a tile whose scale is s = amax/fmt.max decodes with an error at most
2**-4 |x_i| + 2**-10 s (e4m3: 3 mantissa bits, round to nearest; the second term the subnormals' half step),
2**-3 |x_i| + 2**-17 s (e5m2), s/2 = 0.5/127 amax (int8), 2**-9 |x_i| (bf16), plus a 2**-20 amax allowance for
the fp32 division and product. Through an expert (exact interval arithmetic on absolute values): the first
projection's error is at most D @ |W_in| (D the input's error bound); relu is 1-Lipschitz, gelu 1.13-Lipschitz,
and swiglu's silu(g) u moves by at most 1.1 |dg| (|u| + |du|) + |silu(g)| |du| (silu's slope is below 1.1); the
second projection's at most that @ |W_out|. The combine's format then errs by its own bound on the expert's
output (its magnitude at most |y| plus the propagated error), and a token's output adds its K rows weighted by
the router's weights (the router and the shared expert see the unquantized tokens).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_named_on_every_rank, count_calls
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.ops import moe_permute, moe_unpermute
from torsh_kernels.ops.rowquant import RowQuantSpec, row_wire_bytes
from torsh_kernels.parallel import ExpertParallelMoE, MoELayer
from torsh_kernels.parallel.moe_wire import ExpertWireSpec, _Codec

H, FFN = 40, 24  # H not a multiple of the block: a partial last tile
BLOCK = 16

# error of one decoded value: (relative to |x|, relative to the tile's scale s, s = amax / max)
_ERR = {"e4m3": (2**-4, 2**-10, 448.0), "e5m2": (2**-3, 2**-17, 57344.0), "int8": (0.0, 0.5, 127.0)}


def _err_bound(x: torch.Tensor, fmt) -> torch.Tensor:
    """Elementwise bound on |decode(encode(x)) - x| for rows x [N, H] (float64), per the module docstring."""
    if fmt is None:
        return torch.zeros_like(x)
    if fmt == "bf16":
        return x.abs() * 2**-9
    rel, sub, mx = _ERR[fmt.fmt]
    n, h = x.shape
    t = -(-h // fmt.block)
    amax = F.pad(x.abs(), (0, t * fmt.block - h)).view(n, t, fmt.block).amax(-1)
    amax = amax.repeat_interleave(fmt.block, dim=1)[:, :h]
    return rel * x.abs() + sub * amax / mx + 2**-20 * amax


def _output_bound(layer: MoELayer, x: torch.Tensor, wire: ExpertWireSpec) -> torch.Tensor:
    """[T, H] bound on |y_wire - y| for the tokens x (module docstring), in float64."""
    x = x.detach().double().view(-1, H)
    with torch.no_grad():
        r = layer._route(x.float(), "bound", None)[1]
    idx, w, kept = r.indices, r.weights.detach().double(), r.row_map >= 0
    dx = _err_bound(x, wire.dispatch)
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        t, j = torch.where((idx == e) & kept)
        if not len(t):
            continue
        wi, wo = layer.w_in[e].detach().double(), layer.w_out[e].detach().double()
        h, bh = x[t] @ wi, dx[t] @ wi.abs()
        if layer.activation == "swiglu":
            (g, u), (bg, bu) = h.chunk(2, -1), bh.chunk(2, -1)
            a = F.silu(g) * u
            ba = 1.1 * bg * (u.abs() + bu) + F.silu(g).abs() * bu
        else:
            a = F.gelu(h) if layer.activation == "gelu" else F.relu(h)
            ba = bh * (1.13 if layer.activation == "gelu" else 1.0)
        y, by = a @ wo, ba @ wo.abs()
        by = by + _err_bound(y.abs() + by, wire.combine)
        out.index_add_(0, t, by * w[t, j, None].abs())
    return out


class _QDQ(torch.autograd.Function):
    """Rows encoded and decoded in one format (forward) and their gradient in another (backward): what an
    all-to-all in those formats does to the rows, without the all-to-all (the emulation)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        c = _Codec(fwd, x.shape[1], x.dtype)
        return c.decode(c.encode(x))

    @staticmethod
    def backward(ctx, g):
        c = _Codec(ctx.bwd, g.shape[1], g.dtype)
        return c.decode(c.encode(g.contiguous())), None, None


def _emulated(layer: MoELayer, x: torch.Tensor, wire: ExpertWireSpec) -> torch.Tensor:
    """The single-process layer with each all-to-all's encode and decode in place (the module docstring)."""
    x2, r = layer._route(x, "emulation", None)
    xp = _QDQ.apply(moe_permute(x2, r), wire.dispatch, wire.grad_dispatch)
    ye = _QDQ.apply(layer._experts(xp, r.rows_per_expert), wire.combine, wire.grad_combine)
    return layer._add_shared(moe_unpermute(ye, r), x2).view(x.shape)


def _inputs(rank: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(91 + rank)
    x = torch.randn(T, H, generator=g) * (1 + 3 * torch.rand(T, 1, generator=g))  # rows of different scales
    return x, torch.randn(T, H, generator=g)


def _run(layer, x, g):
    """Output, input gradient and every parameter's gradient of sum(y * g) + aux."""
    x = x.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    ((y * g).sum() + layer.aux_loss).backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _fd(ref: MoELayer, xs, gs, rank: int, gx: torch.Tensor, gw: torch.Tensor) -> list[tuple[float, float, float]]:
    """Central differences (float64, the written-out layer of test_moe_layers) of the unquantized loss along
    random directions of this rank's tokens and of this rank's first local expert's w_in, against the
    straight-through gradient: (finite difference, <gradient, direction>, sum |gradient * direction|)."""
    from tests.parallel.test_moe_layers import _mixtral_reference

    d = types.SimpleNamespace(k=ref.k, num_experts=ref.num_experts, activation=ref.activation, shared_experts=0,
                              router=types.SimpleNamespace(weight=ref.router.weight.detach().double()),
                              w_in=ref.w_in.detach().double(), w_out=ref.w_out.detach().double())  # fmt: skip

    def loss(xr, w_in):
        d.w_in = w_in
        return sum((_mixtral_reference(d, (xr if i == rank else x).double()) * g.double()).sum()
                   for i, (x, g) in enumerate(zip(xs, gs))).item()  # fmt: skip

    out, gen, e = [], torch.Generator().manual_seed(5 + rank), rank * (ref.num_experts // len(xs))
    w0, h = ref.w_in.detach().double(), 1e-4
    for _ in range(2):
        v = torch.randn(xs[rank].shape, generator=gen, dtype=torch.float64)
        fd = (loss(xs[rank] + h * v, w0) - loss(xs[rank] - h * v, w0)) / (2 * h)
        out.append((fd, (gx.double() * v).sum().item(), (gx.double() * v).abs().sum().item()))
        V = torch.zeros_like(w0)
        V[e] = torch.randn(w0[e].shape, generator=gen, dtype=torch.float64)
        fd = (loss(xs[rank], w0 + h * V) - loss(xs[rank], w0 - h * V)) / (2 * h)
        out.append((fd, (gw.double() * V[e]).sum().item(), (gw.double() * V[e]).abs().sum().item()))
    return out


CASES = {  # name: (wire, E, K, layer options, tokens per rank)
    "fp8": ("fp8", 8, 2, dict(activation="swiglu"), "uneven"),
    "int8-all": (dict(dispatch="int8", combine="int8", grad_combine="int8", grad_dispatch="int8"), 8, 2,
                 dict(activation="gelu", shared_experts=1), "uneven"),
    "e5m2-bf16-grads": (dict(dispatch="e5m2", grad_combine="bf16", grad_dispatch="e4m3"), 4, 2,
                        dict(activation="relu"), "uneven"),
    "fp8-padded": ("fp8", 8, 2, dict(capacity_factor=1.5, pad_to_capacity=True), "even"),
}  # fmt: skip
TOKENS = {2: {"uneven": [21, 9], "even": [16, 16]}, 4: {"uneven": [13, 0, 19, 6], "even": [12] * 4}}


def _wire(w) -> ExpertWireSpec:
    w = ExpertWireSpec.of(w, "test") if not isinstance(w, dict) else ExpertWireSpec(**w)
    fix = {n: RowQuantSpec(fmt=f.fmt, block=BLOCK) for n, f in w.fields().items() if isinstance(f, RowQuantSpec)}
    return w.replace(**fix)


def _case(comm, name: str) -> dict:
    from torsh_kernels.collectives.communicator import TorchCommunicator

    wire, E, K, options, tokens = CASES[name]
    wire = _wire(wire)
    W, rank = comm.world_size, comm.rank
    torch.manual_seed(17)
    ref = MoELayer(H, FFN, E, K, aux_loss_coef=0.0, **options)  # (the finite differences leave the aux loss out)
    ep = ExpertParallelMoE.from_layer(ref, comm, wire=wire)
    xs, gs = zip(*(_inputs(r, n) for r, n in enumerate(TOKENS[W][tokens])))
    with count_calls(TorchCommunicator, "all_to_all") as calls:
        y, gx, grads = _run(ep, xs[rank], gs[rank])
    ep.reduce_gradients()
    grads = {n: p.grad.clone() for n, p in ep.named_parameters()}
    lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
    emu, plain = {}, {}  # this rank's output and input gradient; the parameters' gradients over every rank's tokens
    for out, fn in ((emu, lambda x: _emulated(ref, x, wire)), (plain, ref)):
        ref.zero_grad()
        for r, (x, g) in enumerate(zip(xs, gs)):
            x = x.clone().requires_grad_()
            yr = fn(x)
            ((yr * g).sum() + ref.aux_loss).backward()
            if r == rank:
                out["y"], out["x"] = yr.detach(), x.grad
        out["w_in"], out["w_out"] = ref.w_in.grad[lo:hi].clone(), ref.w_out.grad[lo:hi].clone()
        out["router.weight"] = ref.router.weight.grad.clone()
        if ref.shared_experts:
            out["shared_w_in"] = ref.shared_w_in.grad.clone()
    ours = {"y": y, "x": gx, **{n: grads[n] for n in emu if n not in ("y", "x")}}
    fd = None  # (the written-out layer has no capacity and no shared expert)
    if not ref.shared_experts and ref.capacity_factor is None:
        fd = _fd(ref, xs, gs, rank, gx, grads["w_in"][0])
    return {
        "ours": ours, "emu": emu, "plain": plain, "bound": _output_bound(ref, xs[rank], wire).float(),
        "dispatch": ep.last_dispatch, "a2a": calls["all_to_all"], "repr": repr(ep), "fd": fd,
        "row bytes": tuple(_Codec(getattr(wire, n), H, torch.float32).row_bytes
                           for n in ("dispatch", "combine", "grad_combine", "grad_dispatch")),
        "replicated": [p.grad.clone() for p in ep._replicated()],
    }  # fmt: skip


def _worker(comm) -> dict:
    return {name: _case(comm, name) for name in CASES}


def _eps(wire: ExpertWireSpec) -> float:
    """The largest relative error (of a tile's absolute maximum) of the formats the case uses."""
    e = {None: 0.0, "bf16": 2**-9, "e4m3": 2**-4, "e5m2": 2**-3, "int8": 0.5 / 127}
    return max(e[getattr(f, "fmt", f)] for f in wire.fields().values())


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_expert_parallel_layer(world):
    results = run_local(_worker, world, timeout=240, threads=1)
    for name, (wire, *_rest) in CASES.items():
        wire, per_rank = _wire(wire), [res[name] for res in results]
        eps = _eps(wire)
        for rank, res in enumerate(per_rank):
            ours, emu, plain = res["ours"], res["emu"], res["plain"]
            # 1. the emulation, to float rounding (a rounding flip of one code where a value lies on a tie of
            # the format's grid within fp32 noise is allowed in a few values: at most one step)
            for key, a in ours.items():
                if not a.numel():  # (a rank without tokens)
                    continue
                b, scale = emu[key], max(1.0, emu[key].abs().max().item())
                d = (a - b).abs()
                assert d.max().item() <= 2 * eps * scale + 1e-5 * scale, (name, rank, key, d.max().item())
                assert (d > 1e-5 * scale).float().mean().item() <= 0.02, (name, rank, key)
            # 2. the output within the derived bound of the uncompressed layer's (a worst case: the errors
            # seen are 3 to 9 % of it), and changed by the formats
            if ours["y"].numel():
                err = (ours["y"] - plain["y"]).abs()
                bound = res["bound"] + 1e-5 * max(1.0, plain["y"].abs().max().item())
                assert (err <= bound).all() and err.max() > 0, (name, rank, (err - bound).max().item())
            # 3. gradients within the formats' error of the uncompressed layer's (relative to their scale): the
            # straight-through gradient is the uncompressed layer's at inputs moved by at most eps of a tile's
            # absmax, plus the gradient rows' own rounding; 8 eps covers both for these unit-scale layers
            for key in ours:
                if key == "y" or not ours[key].numel():
                    continue
                scale = plain[key].abs().max().item()
                d = (ours[key] - plain[key]).abs().max().item()
                assert d <= 8 * eps * scale + 1e-5, (name, rank, key, d / scale)
            # 4. finite differences of the unquantized layer (float64) vs the straight-through gradient along a
            # direction v: the difference is first order in the inputs' relative error, at most eps of
            # sum |g * v| (seen: below 0.07 eps)
            for fd, dot, mag in res["fd"] or ():
                assert abs(fd - dot) <= eps * mag + 1e-4, (name, rank, fd, dot, mag)
            # 5. the wire bytes: rows to the other ranks times each direction's row size
            disp, (rd, rc, rgc, rgd) = res["dispatch"], res["row bytes"]
            out_rows = sum(disp["sent_rows"]) - disp["sent_rows"][rank]
            back_rows = sum(disp["received_rows"]) - disp["received_rows"][rank]
            assert disp["bytes_sent"] == out_rows * rd + back_rows * rc, (name, rank)
            assert disp["backward_bytes_sent"] == out_rows * rgc + back_rows * rgd, (name, rank)
            assert disp["wire"] == str(wire) and f"wire=({wire})" in res["repr"]
            # 6. one all-to-all per direction (plus the counts' exchange when unpadded), forward and backward
            padded = "padded" in name
            assert res["a2a"] == (4 if padded else 5), (name, rank, res["a2a"])
        # 7. the replicated parameters' gradients are the same on every rank after reduce_gradients
        for rank, res in enumerate(per_rank[1:], 1):
            for a, b in zip(res["replicated"], per_rank[0]["replicated"]):
                assert torch.equal(a, b), (name, rank)


def test_wire_spec_values_and_errors():
    s = ExpertWireSpec(dispatch="fp8")
    assert s.dispatch == RowQuantSpec(fmt="e4m3") and s.combine == "bf16" and s.grad_dispatch is None
    assert ExpertWireSpec().plain and ExpertWireSpec().combine is None and not s.plain
    assert ExpertWireSpec(dispatch="int8", combine=None).combine is None  # explicit None: the layer's dtype
    assert ExpertWireSpec.of("int8", "x") == ExpertWireSpec(dispatch=RowQuantSpec(fmt="int8"), combine="bf16")
    assert ExpertWireSpec.of(None, "x") == ExpertWireSpec() and ExpertWireSpec.of(s, "x") is s
    assert ExpertWireSpec(dispatch="e5m2", grad_combine="e4m3").signature() == (
        ("spec", "ExpertWireSpec"), ("dispatch", RowQuantSpec(fmt="e5m2").signature()), ("combine", "bf16"),
        ("grad_combine", RowQuantSpec(fmt="e4m3").signature()), ("grad_dispatch", None))  # fmt: skip
    assert str(s) == "dispatch=e4m3/128, combine=bf16"
    with pytest.raises(InvalidArgumentError, match="ExpertWireSpec: dispatch='fp4'; expected None"):
        ExpertWireSpec(dispatch="fp4")
    with pytest.raises(ArgumentTypeError, match="ExpertWireSpec: grad_combine must be None, a format name or a Row"):
        ExpertWireSpec(grad_combine=8)
    with pytest.raises(InvalidArgumentError, match="ExpertWireSpec: grad_dispatch='auto'; expected None"):
        ExpertWireSpec(grad_dispatch="auto")  # "auto" is the combine's alone
    from torsh_kernels.collectives.replica import ReplicaCommunicator

    comm = ReplicaCommunicator(1)
    with pytest.raises(InvalidArgumentError, match="ExpertParallelMoE: wire='fp16'; expected None, an ExpertWire"):
        ExpertParallelMoE(H, FFN, 4, 2, comm, wire="fp16")
    with pytest.raises(ArgumentTypeError, match="ExpertParallelMoE: wire must be None, an ExpertWireSpec or a"):
        ExpertParallelMoE(H, FFN, 4, 2, comm, wire=RowQuantSpec())
    assert "wire=" not in repr(ExpertParallelMoE(H, FFN, 4, 2, comm))
    assert "wire=(dispatch=int8/128, combine=bf16)" in repr(ExpertParallelMoE(H, FFN, 4, 2, comm, wire="int8"))


def test_wire_bytes_per_row():
    """What a row costs on the wire: H values of the layer's dtype, or its codes (4-byte aligned) and scales."""
    assert _Codec(None, 1024, torch.float32).row_bytes == 4096 and _Codec("bf16", 1024, torch.float32).row_bytes == 2048
    assert _Codec(RowQuantSpec(), 1024, torch.bfloat16).row_bytes == row_wire_bytes(1024, RowQuantSpec()) == 1056
    assert _Codec(RowQuantSpec(fmt="int8", block=16), 40, torch.float32).row_bytes == 40 + 4 * 3


def _default_worker(comm) -> dict:
    """wire=None and ExpertWireSpec() (all four None) take the plain path: the same bits, no row quantization."""
    from torsh_kernels.parallel import moe_wire

    torch.manual_seed(3)
    ref = MoELayer(H, FFN, 4, 2)
    out = []
    for wire in (None, ExpertWireSpec(), ExpertWireSpec(combine=None)):
        ep = ExpertParallelMoE.from_layer(ref, comm, wire=wire)
        with count_calls(moe_wire._Codec, "encode") as calls:
            y, gx, grads = _run(ep, *_inputs(comm.rank, 11 + 4 * comm.rank))
        out.append((y, gx, grads, calls["encode"], ep.last_dispatch))
    return out


def _mismatch_worker(comm) -> dict:
    from torsh_kernels.errors import CollectiveMismatchError

    odd = comm.rank == 1
    cases = {"plain vs fp8": "fp8" if odd else None, "fp8 vs int8": "int8" if odd else "fp8",
             "grads": ExpertWireSpec(dispatch="fp8", grad_dispatch="e5m2" if odd else None)}  # fmt: skip
    out = {}
    for name, wire in cases.items():
        try:
            ExpertParallelMoE(H, FFN, 4, 2, comm, wire=wire)
            out[name] = None
        except CollectiveMismatchError as e:
            out[name] = str(e)
    out["default"] = _default_worker(comm)
    return out


def test_default_wire_is_the_plain_layer_and_ranks_that_differ_raise():
    out = run_local(_mismatch_worker, 2, timeout=120, threads=1)
    named = {"plain vs fp8": "wire.dispatch: None on rank 0, (absent) on rank 1",
             "fp8 vs int8": "wire.dispatch.fmt: e4m3 on rank 0, int8 on rank 1",
             "grads": "wire.grad_dispatch: None on rank 0, (absent) on rank 1"}  # fmt: skip
    assert_named_on_every_rank(out, named)
    for rank, res in enumerate(out):
        (y, gx, grads, calls, disp), *others = res["default"]
        assert calls == 0 and disp["wire"] == "dispatch=dtype, combine=dtype"
        # the bytes: the dispatch's rows to the other ranks, and the combine's (the rows received, sent back)
        out_rows = sum(disp["sent_rows"]) - disp["sent_rows"][rank]
        back_rows = sum(disp["received_rows"]) - disp["received_rows"][rank]
        assert out_rows != back_rows and disp["bytes_sent"] == (out_rows + back_rows) * H * 4
        assert disp["backward_bytes_sent"] == disp["bytes_sent"]
        for y2, gx2, grads2, calls2, _ in others:
            assert calls2 == 0 and torch.equal(y, y2) and torch.equal(gx, gx2)
            assert all(torch.equal(grads[n], grads2[n]) for n in grads)
