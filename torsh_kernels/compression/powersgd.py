"""Rank-r PowerSGD (Vogels et al.) with error feedback and warm start: two linear rounds, P then Q.

Both rounds are all-reduced: the summed P is orthogonalised by the fused kernel, and every rank ends
with the same estimate ``P Q^T``. That needs the same initial Q on every rank: on a fresh state's first
call, rank 0's seed is broadcast and adopted by all. (PyTorch's PowerSGD hook on gloo with several
buckets fails with "Received data size doesn't match expected size"; the rounds here do not.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass

import torch

from ..checks import check_bool, check_int, check_number
from ..collectives.communicator import Communicator
from ..collectives.cost_model import Round
from ..errors import InvalidArgumentError
from ..ops import error_update, orthogonalize, residual_add
from .base import (
    CompressionState,
    Compressor,
    Payload,
    Rounds,
    check_input,
    check_out,
    check_settings,
    decode_plain,
    linear_rounds,
    raise_if_nonfinite,
)

__all__ = ["PowerSGD", "matrix_shape"]

_TINY = 2.0**-60
"""Below this magnitude P is scaled up before its orthogonalisation (see ``PowerSGD._orthogonalize_live``)."""


def matrix_shape(tensor: torch.Tensor) -> tuple[int, int]:
    """PowerSGD's matrix view: [shape[0], rest] for tensors of 2+ dims, as PyTorch's ``powerSGD_hook``
    (``[n, 1]`` and ``[1, n]`` included: a rank-1 approximation of them is exact); a near-square padded
    one for flat tensors (as PyTorch's batched PowerSGD does) and empty ones."""
    n = tensor.numel()
    if tensor.dim() >= 2 and n > 0:
        return tensor.shape[0], n // tensor.shape[0]
    side = max(1, math.ceil(math.sqrt(n)))
    return side, max(1, -(-n // side))


@dataclass(slots=True)
class PowerSGD(Compressor):
    """Rank-r PowerSGD (Vogels et al.) with error feedback and warm start: two linear rounds (P, then Q).

    Before ``start_iter`` compress steps, and for tensors where ``rows * cols / ((rows + cols) * rank)``
    is below ``min_compression_rate``, the tensor is sent uncompressed in fp32 (one round), as in
    PyTorch's powerSGD_hook. The orthogonalisation between the rounds is the fused kernel.
    """

    rank: int = 1
    """Rank of the approximation P Q^T."""
    start_iter: int = 0
    """Compress steps sent uncompressed before compression starts."""
    warm_start: bool = True
    """Reuse the last step's Q (else draw a fresh random Q each step)."""
    min_compression_rate: float = 2.0
    """Send uncompressed when the compression rate of a tensor would be below this."""
    _: KW_ONLY
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = True
    stateful = True  # the error-feedback residual and the warm-start Q
    carries_plain = True
    passes = 7.0

    def __post_init__(self) -> None:
        self.rank = check_int(self.rank, "PowerSGD", "rank", 1)
        self.start_iter = check_int(self.start_iter, "PowerSGD", "start_iter", 0)
        check_bool(self.warm_start, "PowerSGD", "warm_start")
        check_number(self.min_compression_rate, "PowerSGD", "min_compression_rate", lo=0.0)
        check_settings(self, "PowerSGD")

    def phase(self, state: CompressionState) -> int:
        """1 while the state is fresh (its first call broadcasts rank 0's seed), plus 2 once it is past
        ``start_iter`` (compressed: P and Q instead of the tensor)."""
        return int(state.step == 0 and "q" not in state.tensors) + 2 * (state.step >= self.start_iter)

    def _plan(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        rows, cols = matrix_shape(tensor)
        r = min(self.rank, rows, cols)
        if rows * cols / ((rows + cols) * r) < self.min_compression_rate:
            return None
        return rows, cols, r

    def compress(self, tensor, state):
        x = check_input(tensor, "PowerSGD.compress")
        plan = self._plan(tensor) if state.step >= self.start_iter else None
        if plan is None:
            if self.check_finite:
                raise_if_nonfinite(x, "PowerSGD.compress")
            state.step += 1
            return Payload({"data": x.float() if x.dtype != torch.float32 else x.clone()}, x.numel())
        rows, cols, r = plan
        n = x.numel()
        res = state.residual(x)
        m = state.buffer("m", rows * cols, x.device, zero=True)  # padding stays zero
        residual_add(x, res, out=m[:n], check_finite=self.check_finite, provider=self.provider)
        q = state.tensors.get("q")
        if q is None or q.shape != (cols, r) or not self.warm_start:
            g = torch.Generator(device="cpu")
            g.manual_seed((state.seed * 1_000_003 + (0 if self.warm_start else state.step)) & 0x7FFFFFFFFFFFFFFF)
            q = torch.randn(cols, r, generator=g).to(x.device)
            state.tensors["q"] = q
        p = m.view(rows, cols) @ q
        state.step += 1
        return Payload({"p": p}, n, final=False)

    def advance(self, payload, state):
        p = payload.tensors.get("p")
        if p is None or "m" not in state.work:
            raise InvalidArgumentError("PowerSGD.advance: expects the reduced P payload of this state's compress()")
        self._orthogonalize(p)
        m = state.work["m"]
        rows, cols = p.shape[0], m.numel() // p.shape[0]
        state.work["p"] = p
        # Q = M^T P, computed as (P^T M)^T: row-major M is read along its rows (several times faster on CPU)
        return Payload({"q": (p.t() @ m.view(rows, cols)).t().contiguous()}, payload.numel)

    def _orthogonalize(self, p: torch.Tensor) -> None:
        """Orthonormalise P's columns in place. On the host, zero columns are set aside first: a zero
        column stays zero and changes no other column (the orthogonalisation leaves it out), and with
        warm start a column that died stays dead (its Q column is zero from then on), which deep
        networks with vanishing gradients show on most layers. The live columns alone then usually take
        the fast Householder path instead of the per-column CholeskyQR fallback; an all-zero P is left
        as it is. NaN/Inf count as live, so the check still reports them."""
        if not p.is_cpu:
            orthogonalize(p, check_finite=self.check_finite, provider=self.provider)
            return
        if p.shape[1] > 1:
            nonzero = torch.count_nonzero(p, dim=0).tolist()
            if 0 in nonzero:
                live = [j for j, n in enumerate(nonzero) if n]
                if live:
                    sub = p[:, live]  # a copy, contiguous
                    self._orthogonalize_live(sub)
                    p[:, live] = sub
                return
        self._orthogonalize_live(p)

    def _orthogonalize_live(self, p: torch.Tensor) -> None:
        # The result does not depend on the columns' scale. Columns so small that their squares underflow
        # in fp32 (vanishing gradients) would fail the fast path's norm test and take the slow fp64 one:
        # scale them up by a power of two first (exact) so the fast path applies.
        top = float(p.abs().max())  # NaN: no scaling, the check below reports it
        if 0.0 < top < _TINY:
            k = -math.floor(math.log2(top))  # 2^k * top in [1, 2)
            p.mul_(2.0 ** (k // 2)).mul_(2.0 ** (k - k // 2))  # two steps: 2^k alone may overflow fp32
        orthogonalize(p, check_finite=self.check_finite, provider=self.provider)

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = check_out(out, payload.numel, "PowerSGD.decompress")
        if "data" in payload.tensors:  # uncompressed round
            decode_plain(payload.tensors["data"], o, alpha, accumulate, self.provider)
            return out
        if accumulate:
            raise InvalidArgumentError("PowerSGD.decompress: accumulate is not supported (PowerSGD is all-reduced)")
        q = payload.tensors["q"]
        q = q * alpha if alpha != 1.0 else q.clone()  # owned by the state, not the caller's payload
        state.tensors["q"] = q  # the averaged Q: next step's warm start
        p, m = state.work["p"], state.work["m"]
        n = payload.numel
        res = state.residual(o)
        if n == m.numel() and o.dtype == torch.float32 and o.is_contiguous() and not o.requires_grad:
            # no padding and an fp32 output: P Q^T straight into it, then residual = M - it (what
            # error_update computes from a separate approximation buffer, one pass over the matrix less)
            torch.matmul(p, q.t(), out=o.view(p.shape[0], -1))
            torch.sub(m, o.view(-1), out=res)
            return out
        approx = state.buffer("approx", m.numel(), m.device)
        torch.matmul(p, q.t(), out=approx.view(p.shape[0], -1))
        error_update(m[:n], approx[:n], res, out=o, provider=self.provider)
        return out

    def decompress_sum(self, payloads, state, out, *, alpha=1.0):
        raise InvalidArgumentError("PowerSGD is linear: all-reduce its payloads instead of gathering them")

    def payload_nbytes(self, shape, dtype=torch.float32):
        """Steady state (after start_iter): P and Q in fp32, or the fp32 tensor when not worth compressing."""
        return sum(r.nbytes for r in self.schemes(shape, dtype, 1)["all_reduce"])

    # -- on the wire ---------------------------------------------------------------------------------

    def schemes(self, shape, dtype, world_size):
        """Steady state: an all-reduce of P (rows x r) then one of Q (cols x r), in fp32; or one fp32
        all-reduce of the tensor when it is not worth compressing."""
        t = torch.empty(shape, device="meta")
        plan = self._plan(t)
        if plan is None:
            return {"all_reduce": (Round("all_reduce", 4 * t.numel()),)}
        rows, cols, r = plan
        return {"all_reduce": (Round("all_reduce", 4 * rows * r), Round("all_reduce", 4 * cols * r))}

    def reduce(self, tensors, states, comm: Communicator, *, link=None, plain=()) -> tuple[Rounds, str]:
        return self._rounds(tensors, states, comm, plain), "all_reduce"

    def _rounds(self, tensors, states, comm: Communicator, plain=()) -> Rounds:
        fresh = [s for s in states if s.step == 0 and "q" not in s.tensors]
        if fresh:
            # P = sum_r M_r Q needs one Q on every rank: agree on rank 0's seeds once per fresh state
            seeds = torch.tensor([s.seed for s in fresh], dtype=torch.int64, device=tensors[0].device)
            yield [comm.broadcast(seeds, 0, async_op=True)], 0  # bookkeeping, not payload
            for s, v in zip(fresh, seeds.tolist()):
                s.seed = int(v)
        yield from linear_rounds(tensors, states, comm, self, plain)  # plain: with the P all-reduce

    # -- under the bucket layer ------------------------------------------------------------------------

    def warmup(self) -> tuple[int, float]:
        return self.start_iter, self.min_compression_rate

    def per_tensor(self, min_compression_rate: float) -> PowerSGD:
        # the bucket layer decides the warm-up and the size rule per tensor; this copy must not repeat them
        return dataclasses.replace(self, start_iter=0, min_compression_rate=min_compression_rate)
