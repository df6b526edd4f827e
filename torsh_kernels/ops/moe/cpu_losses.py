"""CPU kernels (Numba's CPU target) of the MoE router losses (see losses.py), imported on the cpu
provider's first loss.

The z-loss per token (logsumexp); the aux loss per group of consecutive tokens (the counts of the group's
chosen experts, the sum of its probabilities), its backward per token from the group's counts. The aux loss
reads torch's sigmoid values from :data:`TORCH_AUX_SCORES_FROM` scores up and torch's softmax probabilities
from :data:`TORCH_AUX_SOFTMAX_EXPERTS` experts up too (the ``*_GIVEN`` modes), and scores the logits itself
below. Sums in fp64, results rounded to fp32.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ShapeError
from ..cpu_common import carray, jit, p_f32, p_f64, p_i64
from .cpu import PROBS, SIGMOID, SIGMOID_GIVEN, SOFTMAX, SOFTMAX_GIVEN, i64, row_max, sigmoid_row, softmax_row


@jit
def z_loss_arrays(x, lse):
    """mean_t lse_t**2 with ``lse`` [T] written (a row's max shifts its exponentials; an infinite max
    shifts by 0, as torch.logsumexp does)."""
    T, E = x.shape
    total = 0.0
    for t in range(T):
        row = x[t]
        m = row_max(row)
        sh = m if np.isfinite(m) else np.float32(0.0)
        s = np.float32(0.0)
        for e in range(E):
            s += np.exp(row[e] - sh)
        v = np.log(s) + sh
        lse[t] = v
        total += np.float64(v) * np.float64(v)
    return np.float32(total / T)


@jit
def z_loss_bwd_arrays(x, lse, gscale, grad):
    """d/dx of the z-loss times the incoming gradient: ``gscale * lse_t * softmax(x_t)`` with
    ``gscale = g * 2 / T``."""
    T, E = x.shape
    for t in range(T):
        c = np.float32(gscale) * lse[t]
        lt = lse[t]
        for e in range(E):
            grad[t, e] = c * np.exp(x[t, e] - lt)


@jit
def _probs_row(row, mode, p):
    """The row's probabilities into p: softmax, normalised sigmoid (of the logits, or of the sigmoid values
    the row holds), or the row itself (PROBS, SOFTMAX_GIVEN)."""
    if mode == SOFTMAX:
        softmax_row(row, p)
    elif mode in (SIGMOID, SIGMOID_GIVEN):
        if mode == SIGMOID:
            tot = sigmoid_row(row, p)
        else:
            tot = np.float32(0.0)
            for e in range(row.size):
                p[e] = row[e]
                tot += row[e]
        for e in range(row.size):
            p[e] = p[e] / tot
    else:
        for e in range(row.size):
            p[e] = row[e]


@jit
def _group_span(offs, G, T, g):
    """Tokens [lo, hi) of group g: ``offs`` [G+1] holds the bounds, G = 0 means one group of all T."""
    if G == 0:
        return 0, T
    return offs[g], offs[g + 1]


@jit
def aux_loss_arrays(x, mode, idx, K, kf, offs, G, counts):
    """(mean over groups of E * sum_e c_ge * P_ge / (kf * S_g), -1): ``counts`` [max(G, 1), E] (fp64)
    receives the assignments per group and expert of ``idx`` [T*K]; (NaN, i) when idx[i] is not an expert
    (nothing counted). Groups: see :func:`_group_span`."""
    T, E = x.shape
    counts[:] = 0.0
    for i in range(idx.size):
        if idx[i] < 0 or idx[i] >= E:
            return np.float32(np.nan), i
    p = np.empty(E, np.float32)
    psum = np.empty(E)
    total = 0.0
    for g in range(max(G, 1)):
        lo, hi = _group_span(offs, G, T, g)
        c = counts[g]
        for i in range(lo * K, hi * K):
            c[idx[i]] += 1.0
        psum[:] = 0.0
        for t in range(lo, hi):
            _probs_row(x[t], mode, p)
            for e in range(E):
                psum[e] += p[e]
        part = 0.0
        for e in range(E):
            part += c[e] * psum[e]
        n = np.float64(hi - lo)
        total += part / (n * n)
    return np.float32(E * total / (kf * max(G, 1))), -1


@jit
def aux_loss_bwd_arrays(x, mode, counts, offs, G, gscale, grad):
    """d/d logits (d/d x for PROBS) of the aux loss times the incoming gradient: in group g,
    ``a_e = gscale * counts_ge / S_g**2`` is d loss / d p_te (``gscale = g * E / (kf * G)``); ``x`` is what
    the forward read (logits, or the scores of the *_GIVEN modes)."""
    T, E = x.shape
    a = np.empty(E, np.float32)
    p = np.empty(E, np.float32)
    sg = np.empty(E, np.float32)
    for g in range(max(G, 1)):
        lo, hi = _group_span(offs, G, T, g)
        n = np.float64(hi - lo)
        for e in range(E):
            a[e] = np.float32(gscale * counts[g, e] / (n * n))
        for t in range(lo, hi):
            row = x[t]
            if mode == PROBS:
                for e in range(E):
                    grad[t, e] = a[e]
                continue
            tot = np.float32(1.0)
            if mode == SOFTMAX:
                softmax_row(row, p)
            elif mode == SOFTMAX_GIVEN:
                for e in range(E):
                    p[e] = row[e]
            else:  # p = s / sum(s), s = sigmoid(logits): computed here (SIGMOID) or the row (SIGMOID_GIVEN)
                if mode == SIGMOID:
                    tot = sigmoid_row(row, sg)
                else:
                    tot = np.float32(0.0)
                    for e in range(E):
                        sg[e] = row[e]
                        tot += row[e]
                for e in range(E):
                    p[e] = sg[e] / tot
            dot = np.float32(0.0)
            for e in range(E):
                dot += a[e] * p[e]
            if mode in (SOFTMAX, SOFTMAX_GIVEN):
                for e in range(E):
                    grad[t, e] = p[e] * (a[e] - dot)
            else:
                for e in range(E):
                    grad[t, e] = (a[e] - dot) / tot * sg[e] * (np.float32(1.0) - sg[e])


@jit
def z_loss_ptr(xp, T, E, lp):
    """:func:`z_loss_arrays` on addresses: fp32 logits [T, E], lse [T]."""
    return z_loss_arrays(carray(p_f32(xp), (T, E)), carray(p_f32(lp), (T,)))


@jit
def z_loss_bwd_ptr(xp, T, E, lp, gscale, gp):
    z_loss_bwd_arrays(carray(p_f32(xp), (T, E)), carray(p_f32(lp), (T,)), gscale, carray(p_f32(gp), (T, E)))


@jit
def aux_loss_ptr(xp, T, E, mode, ip, K, kf, op, G, cp):
    """:func:`aux_loss_arrays` on addresses: fp32 [T, E], int64 indices [T*K], int64 group bounds [G+1]
    (G = 0: one group; the address is then not read), fp64 counts [max(G, 1), E]."""
    return aux_loss_arrays(carray(p_f32(xp), (T, E)), mode, carray(p_i64(ip), (T * K,)), K, kf,
                           carray(p_i64(op), (G + 1,)), G, carray(p_f64(cp), (max(G, 1), E)))  # fmt: skip


@jit
def aux_loss_bwd_ptr(xp, T, E, mode, cp, op, G, gscale, gp):
    aux_loss_bwd_arrays(carray(p_f32(xp), (T, E)), mode, carray(p_f64(cp), (max(G, 1), E)), carray(p_i64(op), (G + 1,)),
                        G, gscale, carray(p_f32(gp), (T, E)))  # fmt: skip


def _z_forward(x: torch.Tensor) -> tuple[float, torch.Tensor]:
    lse = torch.empty(x.shape[0])
    return z_loss_ptr(x.data_ptr(), x.shape[0], x.shape[1], lse.data_ptr()), lse


_NO_GROUPS = torch.zeros(1, dtype=torch.int64)  # the group bounds passed for one group (never read)


def group_bounds(groups: int | tuple[int, ...] | None, T: int) -> tuple[torch.Tensor, int]:
    """(int64 bounds [G+1] of the groups of T tokens, G); (a placeholder, 0) for one group of all T. ``groups``
    as the aux loss checked it: None, a size dividing T, or lengths summing to T."""
    if groups is None:
        return _NO_GROUPS, 0
    if isinstance(groups, int):
        return torch.arange(0, T + 1, groups, dtype=torch.int64), T // groups
    offs = torch.zeros(len(groups) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(groups, dtype=torch.int64), 0, out=offs[1:])
    return offs, len(groups)


def _aux_forward(x: torch.Tensor, mode: int, idx: torch.Tensor, kf: int, offs: torch.Tensor,
                 G: int) -> tuple[float, torch.Tensor]:  # fmt: skip
    idx = i64(idx)
    counts = torch.empty(max(G, 1), x.shape[1], dtype=torch.float64)
    loss, bad = aux_loss_ptr(x.data_ptr(), x.shape[0], x.shape[1], mode, idx.data_ptr(), idx.shape[1], kf,
                             offs.data_ptr(), G, counts.data_ptr())  # fmt: skip
    if bad >= 0:
        raise ShapeError(
            f"torsh_kernels.moe_aux_loss: routing.indices holds {int(idx.reshape(-1)[bad])}, not an expert of "
            f"[0, {x.shape[1]}); pass the Routing that moe_route returned for these logits"
        )
    return loss, counts


class ZLoss(torch.autograd.Function):
    """The z-loss of fp32 CPU logits [T, E], forward and backward on the kernels above (a backward that
    must itself be differentiable, ``create_graph=True``, is computed with torch ops instead)."""

    @staticmethod
    def forward(ctx, x):
        z, lse = _z_forward(x)
        ctx.save_for_backward(x, lse)
        return torch.scalar_tensor(z)

    @staticmethod
    def backward(ctx, g):
        x, lse = ctx.saved_tensors
        T, E = x.shape
        if torch.is_grad_enabled():  # create_graph: the same gradient in torch ops, differentiable again
            return g * (2.0 / T) * torch.logsumexp(x, -1, keepdim=True) * torch.softmax(x, -1)
        grad = torch.empty_like(x)
        z_loss_bwd_ptr(x.data_ptr(), T, E, lse.data_ptr(), float(g) * 2.0 / T, grad.data_ptr())
        return grad


# The aux loss's kernels read scores torch computed (one vectorised pass; the kernels' exp is scalar): sigmoid
# values from this many scores up, softmax probabilities from this many experts up too (torch's softmax over
# rows of fewer experts is slower than the kernels'). Measured on the 2-core VM, fp32, T=4096, one thread:
# the forward's scoring at E=64 takes 1.4 ms in the kernel, 0.27 ms in torch; at E=8, 0.22 ms and 0.63 ms.
TORCH_AUX_SCORES_FROM = 1 << 10
TORCH_AUX_SOFTMAX_EXPERTS = 16


def _aux_scores(x: torch.Tensor, mode: int) -> tuple[torch.Tensor, int]:
    """(what the aux-loss kernels read, their mode) for fp32 contiguous ``x`` in ``mode`` (no gradient taken)."""
    if x.numel() >= TORCH_AUX_SCORES_FROM:
        if mode == SIGMOID:
            return torch.sigmoid(x.detach()), SIGMOID_GIVEN
        if mode == SOFTMAX and x.shape[1] >= TORCH_AUX_SOFTMAX_EXPERTS:
            return torch.softmax(x.detach(), -1), SOFTMAX_GIVEN
    return x, mode


class AuxLoss(torch.autograd.Function):
    """The load-balancing loss of fp32 CPU scores [T, E] (``mode``: SOFTMAX, SIGMOID or PROBS) and the
    routing's chosen experts [T, K], over the ``groups`` of tokens (see :func:`group_bounds`; ``kf``: K or 1,
    the scale), forward and backward on the kernels above."""

    @staticmethod
    def forward(ctx, x, mode, idx, kf, groups):
        offs, G = group_bounds(groups, x.shape[0])
        s, smode = _aux_scores(x, mode)
        loss, counts = _aux_forward(s, smode, idx, kf, offs, G)
        if s is x and not G:  # (the common case saves what it needs only: a saved tensor costs time per call)
            ctx.save_for_backward(x, counts)
        else:
            ctx.save_for_backward(x, counts, s, offs)
        ctx.mode, ctx.smode, ctx.G, ctx.gscale = mode, smode, G, x.shape[1] / (kf * max(G, 1))
        return torch.scalar_tensor(loss)

    @staticmethod
    def backward(ctx, g):
        x, counts, *rest = ctx.saved_tensors
        s, offs = rest if rest else (x, _NO_GROUPS)
        T, E = x.shape
        if torch.is_grad_enabled():  # create_graph: the same gradient in torch ops, differentiable again
            sizes = (offs[1:] - offs[:-1]) if ctx.G else torch.tensor([T])
            per = (counts / sizes[:, None].double().square()).to(torch.float32)  # [G, E]
            a = (g * ctx.gscale) * (per.repeat_interleave(sizes, 0) if ctx.G else per)  # [T, E] or [1, E]
            none = (None,) * 4
            if ctx.mode == PROBS:
                return (a.expand(T, E), *none)
            if ctx.mode == SOFTMAX:
                p = torch.softmax(x, -1)
                return (p * (a - (p * a).sum(-1, keepdim=True)), *none)
            sg = torch.sigmoid(x)
            tot = sg.sum(-1, keepdim=True)
            return ((a - (sg / tot * a).sum(-1, keepdim=True)) / tot * sg * (1.0 - sg), *none)
        grad = torch.empty_like(x)
        aux_loss_bwd_ptr(s.data_ptr(), T, E, ctx.smode, counts.data_ptr(), offs.data_ptr(), ctx.G,
                         float(g) * ctx.gscale, grad.data_ptr())  # fmt: skip
        return grad, None, None, None, None


def z_loss(x: torch.Tensor) -> torch.Tensor:
    """The z-loss of contiguous fp32 CPU logits: through the autograd Function when a gradient is needed."""
    if x.requires_grad and torch.is_grad_enabled():
        return ZLoss.apply(x)
    return torch.scalar_tensor(_z_forward(x)[0])


def aux_loss(x: torch.Tensor, mode: int, idx: torch.Tensor, kf: int,
             groups: int | tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """The aux loss of contiguous fp32 CPU scores (``kf``: K for the balanced-one scale, 1 for "hf";
    ``groups`` as checked by moe_aux_loss): through the autograd Function when a gradient is needed."""
    if x.requires_grad and torch.is_grad_enabled():
        return AuxLoss.apply(x, mode, idx, kf, groups)
    offs, G = group_bounds(groups, x.shape[0])
    s, smode = _aux_scores(x, mode)
    return torch.scalar_tensor(_aux_forward(s, smode, idx, kf, offs, G)[0])
