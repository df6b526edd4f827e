"""The torch peers of ``torsh bench compression`` (:mod:`~torsh_kernels.apps.bench.compression`): the code each
compression op replaces, written in plain torch as users run it, and where torsh's op is a different algorithm
from the obvious torch code, the same algorithm in plain torch (a DGC-style sampled-threshold top-k, CholeskyQR2).
Each is checked against torsh's result before the suite times it."""

from __future__ import annotations

import math

import torch

from ... import compression as cz
from ...errors import InvalidArgumentError
from ...ops.topk import TOPK_REFINE, TOPK_SLACK
from ...ops.topk.api import _TOPK_TARGET, _sample_stride

BLOCK = 256
"""The quantizers' block (the suite's, and torsh's default)."""


def peer_topk_ef(x, r, k):
    acc = x + r
    idx = torch.topk(acc.abs(), k, sorted=False).indices
    vals = acc[idx]
    r.copy_(acc)
    r[idx] = 0
    return vals, idx


class DgcTopk:
    """Torsh's approximate top-k written in plain torch, DGC-style (Deep Gradient Compression, Lin et al.
    2018; GRACE's DgcCompressor): the threshold is the smallest of the top ``target`` of a sample of
    |x + r|, the candidates are the elements at or above it, and the k largest candidates are kept.

    Matched to ``torsh_kernels.topk_compress(exact=False)`` (ops/topk/api.py, read from there, not
    copied): the sample is the strided |x + r|[::stride] with torsh's ``_sample_stride(n, k)`` (at least
    TOPK_MIN_SAMPLE elements, about TOPK_SAMPLE_PER_K expected top-k hits: 102,400 of 6.5M elements at
    25 MiB, 1.6%; of 26M at 100 MiB, 0.4%), the target rank 1.125 k * sample / n, the band [k, k +
    ceil(TOPK_SLACK k)], the re-aim from the observed count, at most TOPK_REFINE rounds, then the exact
    ``torch.topk`` over all n; stride 1 (the sample would hold every element) takes the exact path at once,
    as torsh does. What differs is only how each step runs: torch materialises x + r and |x + r| and
    compacts the candidates with ``nonzero`` (the indices come out in candidate order, not sorted, as
    DGC's do); torsh fuses the sum, the comparison and the compaction into one pass and returns the
    indices ascending. Inside the band every true top-k element is a candidate, so the result is the
    exact top-k up to ties at the threshold. ``calls``, ``rounds`` and ``fallbacks`` count what it ran.
    """

    def __init__(self, n: int, k: int) -> None:
        self.k = k
        self.stride = _sample_stride(n, k)
        self.cap = min(n, k + math.ceil(TOPK_SLACK * k))
        self.ns = -(-n // self.stride)
        self.target = _TOPK_TARGET * k * self.ns / n
        self.calls = self.rounds = self.fallbacks = 0

    def select(self, acc: torch.Tensor) -> torch.Tensor:
        """The indices of the k largest |acc| (int64, in no particular order)."""
        k, ns = self.k, self.ns
        self.calls += 1
        mag = acc.abs()
        if self.stride > 1:
            sample = mag[:: self.stride]
            target = self.target
            for _ in range(TOPK_REFINE):
                self.rounds += 1
                thr = torch.topk(sample, math.ceil(target), sorted=False).values.min()
                cand = torch.nonzero(mag >= thr).view(-1)
                count = cand.numel()
                if k <= count <= self.cap:
                    return cand[torch.topk(mag[cand], k, sorted=False).indices]
                new = target * (_TOPK_TARGET * k) / max(count, 1)  # torsh's re-aim
                if math.ceil(new) == math.ceil(target):
                    new = target + (1 if count < k else -1)
                if new < 1 or new > ns:
                    break
                target = new
            self.fallbacks += 1
        return torch.topk(mag, k, sorted=False).indices

    def __call__(self, x: torch.Tensor, r: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of the top-k of ``x + r``; with ``r``, the residual update (r = x + r, zero
        where sent), as :func:`peer_topk_ef` does it."""
        acc = x + r if r is not None else x
        idx = self.select(acc)
        vals = acc[idx]
        if r is not None:
            r.copy_(acc)
            r[idx] = 0
        return vals, idx

    def stats(self) -> str:
        return f"peer's rounds per call {self.rounds / max(self.calls, 1):.2f}, exact fallbacks {self.fallbacks}"


def check_topk_peer(peer, x: torch.Tensor, k: int, with_residual: bool) -> float:
    """Run ``peer`` once on x (and a random residual) and check it against the exact top-k: the same
    magnitudes (so the same set up to ties), the values x + r at its indices and the residual x + r with
    zeros where sent. Returns the recall of the exact top-k's index set; raises AssertionError when the
    peer is wrong (a wrong peer is not timed)."""
    g = torch.Generator().manual_seed(7)
    r0 = (0.5 * torch.randn(x.numel(), generator=g)).to(x.device) if with_residual else None
    acc = x + r0 if r0 is not None else x
    r = r0.clone() if r0 is not None else None
    vals, idx = peer(x, r) if r is not None else peer(x)
    want = torch.topk(acc.abs(), k, sorted=False)
    if idx.numel() != k or idx.unique().numel() != k:
        raise AssertionError(f"top-k peer: {idx.unique().numel()} distinct indices, expected {k}")
    if not torch.equal(acc.abs()[idx].sort().values, want.values.sort().values):
        raise AssertionError("top-k peer: its selection is not the exact top-k (magnitudes differ); not timing it")
    if not torch.equal(vals, acc[idx]):
        raise AssertionError("top-k peer: values are not x + r at its indices")
    if r is not None:
        expect = acc.clone()
        expect[idx] = 0
        if not torch.equal(r, expect):
            raise AssertionError("top-k peer: the residual is not x + r with zeros where sent")
    hit = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
    hit[want.indices] = True
    return hit[idx].sum().item() / k


def peer_quantize(x, bits, stochastic=False):
    qmax = 127.0 if bits == 8 else 7.0
    blocks = x.view(-1, BLOCK)
    s = blocks.abs().amax(dim=1) / qmax
    y = blocks / s.clamp_min(1e-30)[:, None]
    y = torch.floor(y + torch.rand_like(y)) if stochastic else torch.round(y)
    q = y.clamp_(-qmax, qmax).to(torch.int8)
    if bits == 4:
        q = q.view(-1, 2).to(torch.uint8) & 15
        q = q[:, 0] | (q[:, 1] << 4)
    return q.view(-1), s


def peer_dequantize(q, s, bits):
    if bits == 4:
        b = q.to(torch.int8)
        lo = (b << 4) >> 4  # sign-extend the low nibble
        hi = b >> 4
        q = torch.stack([lo, hi], dim=1)
    return (q.view(-1, BLOCK).float() * s[:, None]).view(-1)


_WEIGHTS = {}


def peer_sign(x, r):
    acc = x + r
    scale = acc.abs().mean()
    pos = acc >= 0
    w = _WEIGHTS.get(x.device)
    if w is None:
        w = _WEIGHTS[x.device] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=x.device)
    bits = (pos.view(-1, 8).to(torch.uint8) * w).sum(dim=1, dtype=torch.uint8)
    r.copy_(acc - torch.where(pos, scale, -scale))
    return bits, scale


def cupy_sign_peer(device: torch.device):
    """DeepSpeed's 1-bit compression step: signs packed with cupy.packbits (CUDA with CuPy only)."""
    if device.type != "cuda":
        return None
    try:
        import cupy
    except Exception:
        return None

    def step(x, r):
        acc = x + r
        scale = acc.norm() / math.sqrt(acc.numel())  # DeepSpeed's compensated scale
        pos = acc >= 0
        bits = torch.from_dlpack(cupy.packbits(cupy.from_dlpack(pos), bitorder="little"))
        r.copy_(acc - torch.where(pos, scale, -scale))
        return bits, scale

    return step


def peer_sign_decompress(bits, scale, n):
    pos = ((bits[:, None] >> torch.arange(8, device=bits.device, dtype=torch.uint8)) & 1).view(-1)[:n]
    return (pos.float() * 2 - 1) * scale


def torch_orthogonalize(p: torch.Tensor) -> None:
    """PyTorch's powerSGD_hook._orthogonalize on a [B, m, r] batch: its Python Gram-Schmidt loop over
    columns for rank <= 2, torch.linalg.qr above."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    _orthogonalize(p, 0)


def torch_gram_schmidt(p: torch.Tensor) -> None:
    """PyTorch's powerSGD_hook._orthogonalize_gram_schmidt on a [B, m, r] batch."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt

    _orthogonalize_gram_schmidt(p, 0)


def peer_cholesky_qr2(p: torch.Tensor) -> None:
    """CholeskyQR2 written in plain torch, in place on a [B, m, r] batch: torsh's algorithm as one would write it
    with torch's batched ops. The Gram matrix in fp64, its Cholesky factor L, Q = P L^-T, stored in P's dtype;
    then, as torsh does, the stored Q's Gram matrix G = I + E: matrices with a column of E above half the unit
    roundoff get a second iteration on that G. torsh's kernels differ in the mechanics (one fused pass per
    iteration, the next Gram matrix summed while the rows are stored, a dependent-column test this peer lacks)."""
    tau = torch.finfo(p.dtype).eps / 4  # half the unit roundoff u (eps = 2u)
    pd = p.double()
    g = pd.transpose(-1, -2) @ pd
    todo = torch.arange(p.shape[0], device=p.device)
    for it in range(2):
        low, info = torch.linalg.cholesky_ex(g)
        if bool(info.any()):
            raise InvalidArgumentError("CholeskyQR2 peer: a Gram matrix is not positive definite (dependent columns)")
        q = torch.linalg.solve_triangular(low, pd.transpose(-1, -2), upper=False).transpose(-1, -2)
        p[todo] = q.to(p.dtype)
        if it == 1:
            break
        pd = p[todo].double()
        g = pd.transpose(-1, -2) @ pd
        e = g - torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
        more = (torch.linalg.vector_norm(e, dim=-2) > tau).any(-1)
        if not bool(more.any()):
            break
        todo, pd, g = todo[more], pd[more], g[more]


CHOLQR2_LABEL = (
    "CholeskyQR2 in plain torch (torsh's algorithm): fp64 Gram, linalg.cholesky_ex, solve_triangular, "
    "a second iteration where the stored Q is not orthonormal to half a rounding"
)


class PeerPowerSGD:
    """The arithmetic of PyTorch's powerSGD_hook for one bucket viewed as a matrix (world size 1)."""

    def __init__(self, x: torch.Tensor, rank: int) -> None:
        self.rows, self.cols = cz.matrix_shape(x)
        n = x.numel()
        self.m = torch.zeros(self.rows * self.cols, device=x.device)
        self.r = torch.zeros(n, device=x.device)
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(self.cols, rank, generator=g).to(x.device)
        self.n = n

    def step(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = self.n
        self.m[:n] = x + self.r  # input_tensor.add_(error)
        mat = self.m.view(self.rows, self.cols)
        p = mat @ self.q
        torch_orthogonalize(p[None])
        self.q = mat.t() @ p
        approx = (p @ self.q.t()).view(-1)[:n]
        self.r.copy_(self.m[:n] - approx)
        out.copy_(approx)
