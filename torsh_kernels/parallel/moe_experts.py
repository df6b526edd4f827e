"""The experts' compute of the MoE layers: one grouped GEMM per projection, or a loop over the experts.

Rows arrive grouped by expert (``counts[e]`` rows for local expert e, in expert order, the layout of
``moe_permute``). Each expert computes ``act(x @ w_in[e]) @ w_out[e]`` on its rows.

- **grouped**: ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` in older torch) once per
  projection, the groups delimited by int32 cumulative row counts computed on the device (no host sync);
  an expert with no rows is an empty group. Its backward is torch's own; it needs a contiguous gradient
  whose row stride is a multiple of 16 bytes (an expanded or transposed one raises inside torch), so the
  gradient reaching each grouped GEMM is made contiguous first (a no-op when it already is).
- **loop**: one matmul pair per expert over ``torch.split`` of the rows (the counts read to the host once).
  The experts' weights are taken with ``unbind`` (one view per expert; their backward stacks the experts'
  gradients once), not indexed one by one: indexing ``w[e]`` in a loop makes each expert's backward write a
  zero-filled gradient of the whole [E, ...] weight, E times (on the shared 2-core VM, E=64, H=F=1024, 8192
  rows: 64-100 s against 17-25 s per forward + backward).

Which one runs (``expert_compute="auto"``) is decided **once per (device, dtype)** by :func:`grouped_supported`:
a probe runs a tiny grouped GEMM (three groups, one of them empty) forward and backward and compares it with
the loop; a raise or a mismatch means the loop. Per call, the grouped path also needs every row stride to be
a multiple of 16 bytes (the widths H, the experts' inner width and, for SwiGLU, twice it, times the element
size) and 16-byte aligned data; otherwise the loop runs. ``expert_compute="grouped"`` forces the grouped GEMM
(a typed error where it cannot run), ``"loop"`` the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError

__all__ = ["EXPERT_COMPUTE", "activation", "grouped_supported", "run_experts"]

EXPERT_COMPUTE = ("auto", "grouped", "loop")

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_PROBED: dict[tuple[str, torch.dtype], tuple[bool, str]] = {}
_LOCK = threading.Lock()


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``h = [gate | up]``; the backward writes both halves of the gradient into one
    tensor (autograd's own would write two and concatenate them: one more pass over [N, 2F])."""

    @staticmethod
    def forward(ctx, h):
        f = h.shape[-1] // 2
        s = F.silu(h[..., :f])
        ctx.save_for_backward(h, s)
        return s * h[..., f:]

    @staticmethod
    def backward(ctx, g):
        h, s = ctx.saved_tensors
        f = h.shape[-1] // 2
        if torch.is_grad_enabled():  # a double backward (create_graph=True): differentiable ops, no out=
            gate = h[..., :f]
            sig = torch.sigmoid(gate)
            return torch.cat([g * h[..., f:] * sig * (1 + gate * (1 - sig)), g * gate * sig], dim=-1)
        gh = torch.empty_like(h)
        torch.mul(g, s, out=gh[..., f:])  # d up
        torch.ops.aten.silu_backward.grad_input(g * h[..., f:], h[..., :f], grad_input=gh[..., :f])  # d gate
        return gh


def activation(h: torch.Tensor, act: str) -> torch.Tensor:
    """The experts' (and the shared expert's) activation of the first projection's output: SwiGLU
    ``silu(gate) * up`` with ``gate, up = h.chunk(2)`` (gate columns first), GELU or ReLU."""
    if act == "swiglu":
        if h.requires_grad and torch.is_grad_enabled():
            return _SwiGLU.apply(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if act == "gelu":
        return F.gelu(h)
    return F.relu(h)


def _probe(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    if _GROUPED_MM is None:
        return False, f"torch {torch.__version__} has no grouped_mm"
    gen = torch.Generator().manual_seed(0)
    counts = [2, 0, 5]
    try:
        with torch.enable_grad():
            x = torch.randn(7, 16, generator=gen).to(device, dtype).requires_grad_()
            w = torch.randn(3, 16, 16, generator=gen).to(device, dtype).requires_grad_()
            gy = torch.randn(7, 16, generator=gen).to(device, dtype)
            offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
            y = _GROUPED_MM(x, w, offs=offs)
            gx, gw = torch.autograd.grad(y, (x, w), gy)
        xf, wf, gf = x.detach().double(), w.detach().double(), gy.double()
        ref = torch.cat([c @ wf[e] for e, c in enumerate(torch.split(xf, counts))])
        rgx = torch.cat([c @ wf[e].t() for e, c in enumerate(torch.split(gf, counts))])
        rgw = torch.stack([xc.t() @ gc for xc, gc in zip(torch.split(xf, counts), torch.split(gf, counts))])
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        for name, a, b in (("output", y, ref), ("input gradient", gx, rgx), ("weight gradient", gw, rgw)):
            err = (a.double() - b).abs().max().item()
            if not err <= tol * max(1.0, b.abs().max().item()):
                return False, f"the grouped GEMM's {name} differs from the loop's by {err:.3g}"
    except Exception as e:  # (any failure means: not on this device and dtype)
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, ""


def grouped_supported(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether torch's grouped GEMM runs (forward and backward, an empty group included) and matches the
    per-expert loop on ``device`` and ``dtype``, probed once per (device, dtype) and remembered for the
    process; with the reason when it does not."""
    device = torch.device(device)
    key = (str(device), dtype)
    r = _PROBED.get(key)
    if r is None:
        if torch.compiler.is_compiling():  # (no probe inside a trace: the loop until an eager call probed)
            return False, "not probed yet (first called while torch.compile traces)"
        with _LOCK:
            r = _PROBED.get(key)
            if r is None:
                r = _PROBED[key] = _probe(device, dtype)
    return r


class _ContiguousGrad(torch.autograd.Function):
    """Identity; its backward makes the gradient contiguous (what the grouped GEMM's backward needs)."""

    @staticmethod
    def forward(ctx, y):
        return y

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    y = _GROUPED_MM(x, w, offs=offs)
    return _ContiguousGrad.apply(y) if y.requires_grad else y


def _aligned(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def grouped_fits(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> str:
    """Why the grouped GEMM cannot take these rows and weights (strides or data not 16-byte aligned), or ""."""
    for name, t in (("the rows", x), ("w_in", w_in), ("w_out", w_out)):
        if not _aligned(t):
            return (
                f"{name} ({tuple(t.shape)}, strides {t.stride()}, {t.dtype}) have a stride or an address that is not "
                "a multiple of 16 bytes (choose widths that are multiples of 16 bytes / the element size)"
            )
    inner = w_out.shape[1]  # the rows between the projections: [N, F]
    if (inner * x.element_size()) % 16:
        return f"the experts' inner width {inner} times {x.element_size()} bytes is not a multiple of 16 bytes"
    return ""


def run_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    act: str,
    mode: str,
    what: str,
    host_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """``x [N, H]``, rows grouped by local expert (``counts [E_local]`` int64 on x's device: the group sizes,
    summing to N) through the experts ``w_in [E_local, H, width]`` and ``w_out [E_local, F, H]``: ``[N, H]``.
    ``mode``: "auto", "grouped" or "loop" (module docstring). ``host_counts``: the counts as ints where the
    caller has them already (the loop then reads nothing from the device)."""
    if mode != "loop":
        ok, why = grouped_supported(x.device, x.dtype)
        if ok:
            why = grouped_fits(x, w_in, w_out)
        if not why:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E_local] ends of the groups, on the device
            return _grouped_mm(activation(_grouped_mm(x, w_in, offs), act), w_out, offs)
        if mode == "grouped":
            raise InvalidArgumentError(
                f"{what}: expert_compute='grouped', but torch's grouped GEMM cannot run here ({x.device}, {x.dtype}): "
                f"{why}; use expert_compute='auto' (the loop where the grouped GEMM cannot run) or 'loop'"
            )
    sizes = list(host_counts) if host_counts is not None else counts.tolist()
    w1, w2 = w_in.unbind(0), w_out.unbind(0)
    outs = [activation(c @ w1[e], act) @ w2[e] for e, c in enumerate(torch.split(x, sizes))]
    return torch.cat(outs) if outs else x.new_empty(0, w_out.shape[-1])
