"""Gradient compressors with one contract, built on the fused ops in ``torsh_kernels.ops.compress``.

Contract (what the collectives layer and the DDP hooks rely on)::

    state = compressor.new_state()               # per bucket: residuals, PowerSGD's Q, step count
    payload = compressor.compress(tensor, state)  # Payload: tensors to send, .nbytes on the wire
    while not payload.final:                      # PowerSGD: P round, then Q round
        reduce(payload)                           # all-reduce (linear) or all-gather (not linear)
        payload = compressor.advance(payload, state)
    reduce(payload)
    compressor.decompress(payload, state, out, alpha=1 / world_size)

- ``compressor.is_linear``: whether payloads of several ranks may be summed element by element
  (all-reduce) and decompressed once; otherwise they are gathered and decoded with
  ``decompress_sum(payloads, state, out, alpha=...)``.
- ``state.state_dict()`` / ``state.load_state_dict(sd)``: the persistent part of a bucket's state
  (error-feedback residuals, PowerSGD's Q memory, the step count, the seed), bit-exact.
- Error feedback (TopK, Quantize, Sign, PowerSGD): what a step did not send is added to the next step's
  input, so nothing is lost over time. The residual lives in fp32 in the state.
- Non-finite gradients raise :class:`~torsh_kernels.errors.NonFiniteError` before any state changes
  (``check_finite=False`` skips the check).
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import torch

from .errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from .ops.bucket import BucketLayout, flatten, unflatten
from .ops.compress import (
    COMPRESS_DTYPES,
    _count_nonfinite,
    dequantize,
    error_update,
    orthogonalize,
    quantize,
    residual_add,
    sign_compress,
    sign_decompress,
    topk_compress,
    topk_count,
    topk_decompress,
)

__all__ = [
    "BF16",
    "FP16",
    "CompressionState",
    "Compressor",
    "NoCompression",
    "Payload",
    "PowerSGD",
    "Quantize",
    "Sign",
    "TopK",
    "roundtrip",
]


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


class CompressionState:
    """Per-bucket compressor state: persistent tensors (residual, PowerSGD's Q), step count, seed.

    Workspace buffers live beside them and are rebuilt on demand; only the persistent part goes into
    ``state_dict()``.
    """

    __slots__ = ("seed", "step", "tensors", "work")

    def __init__(self, seed: int = 0) -> None:
        self.step = 0
        """Number of compress calls so far."""
        self.seed = seed
        """Seed of the random parts (stochastic rounding noise, PowerSGD's initial Q)."""
        self.tensors: dict[str, torch.Tensor] = {}
        self.work: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "tensors": {k: v.clone() for k, v in self.tensors.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or not {"step", "seed", "tensors"} <= sd.keys():
            raise InvalidArgumentError("CompressionState.load_state_dict: expected a dict from state_dict()")
        self.step = int(sd["step"])
        self.seed = int(sd["seed"])
        self.tensors = {k: v.clone() for k, v in sd["tensors"].items()}
        self.work = {}

    def residual(self, like: torch.Tensor) -> torch.Tensor:
        """The fp32 error-feedback residual for a tensor like ``like`` (zeros the first time)."""
        r = self.tensors.get("residual")
        if r is None or r.numel() != like.numel() or r.device != like.device:
            if r is not None:
                raise ShapeError(
                    f"compression state holds a residual of {r.numel()} elements on {r.device}, the tensor has "
                    f"{like.numel()} on {like.device}; use one state per bucket"
                )
            r = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self.tensors["residual"] = r
        return r

    def buffer(self, name: str, numel: int, device: torch.device, *, zero: bool = False) -> torch.Tensor:
        b = self.work.get(name)
        if b is None or b.numel() != numel or b.device != device:
            b = (torch.zeros if zero else torch.empty)(numel, dtype=torch.float32, device=device)
            self.work[name] = b
        return b

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"CompressionState(step={self.step}, seed={self.seed}, tensors={shapes})"


def _check_input(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in COMPRESS_DTYPES:
        raise InvalidArgumentError(f"{what}: tensor dtype {tensor.dtype}; expected float32, float16 or bfloat16")
    return tensor.detach().reshape(-1)


def _check_out(out: object, numel: int, what: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.numel() != numel:
        raise ShapeError(f"{what}: out has {out.numel()} elements, the payload encodes {numel}")
    if not out.is_contiguous():
        raise ShapeError(f"{what}: out must be contiguous")
    return out.view(-1)


def _numel(shape: int | tuple[int, ...]) -> int:
    return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else shape


def _decode_plain(data: torch.Tensor, out: torch.Tensor, alpha: float, accumulate: bool, provider) -> None:
    """out (+)= alpha * data, cast to out's dtype: the fused unflatten of a one-tensor bucket."""
    unflatten(data, BucketLayout.for_tensors([data]), [out], scale=alpha, accumulate=accumulate, provider=provider)


def _check_finite_tensor(t: torch.Tensor, what: str) -> None:
    bad = int(_count_nonfinite(t))
    if bad:
        raise NonFiniteError(f"{what}: {bad} non-finite element(s) (NaN/Inf) in the tensor or its payload")


class Compressor:
    """Base class: see the module docstring for the contract."""

    is_linear: bool = False
    provider: str | None

    def new_state(self, seed: int = 0) -> CompressionState:
        return CompressionState(seed)

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


@dataclass(slots=True)
class _Cast(Compressor):
    _: KW_ONLY
    check_finite: bool = True
    """Raise NonFiniteError if the cast payload holds NaN/Inf (fp16 overflows above 65504)."""
    provider: str | None = None
    """Kernel provider for the fused cast ops (None: automatic)."""

    dtype = torch.float32
    is_linear = True

    def compress(self, tensor, state):
        x = _check_input(tensor, f"{type(self).__name__}.compress")
        data, _ = flatten([x], dtype=self.dtype, provider=self.provider)
        if self.check_finite:
            _check_finite_tensor(data, f"{type(self).__name__}.compress")
        state.step += 1
        return Payload({"data": data}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = _check_out(out, payload.numel, f"{type(self).__name__}.decompress")
        _decode_plain(payload.tensors["data"], o, alpha, accumulate, self.provider)
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = _numel(shape)
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(slots=True)
class NoCompression(_Cast):
    """Send the tensor as it is (its own dtype); the payload is a view of the input."""

    def compress(self, tensor, state):
        x = _check_input(tensor, "NoCompression.compress")
        if self.check_finite:
            _check_finite_tensor(x, "NoCompression.compress")
        state.step += 1
        return Payload({"data": x}, x.numel())

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = _numel(shape)
        return numel * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class FP16(_Cast):
    """Cast to fp16 for the wire (PyTorch's fp16_compress_hook): 2 bytes per element."""

    dtype = torch.float16


@dataclass(slots=True)
class BF16(_Cast):
    """Cast to bf16 for the wire: 2 bytes per element, fp32's range."""

    dtype = torch.bfloat16


@dataclass(slots=True)
class TopK(Compressor):
    """Send the ratio * n largest magnitudes (values and int32 indices), with error feedback."""

    ratio: float
    """Fraction of elements sent, in (0, 1]."""
    _: KW_ONLY
    exact: bool = False
    """Exact top-k selection instead of the sampled-threshold approximation (see topk_compress)."""
    error_feedback: bool = True
    """Keep what was not sent in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise InvalidArgumentError(f"TopK: ratio must be in (0, 1], got {self.ratio!r}")

    def compress(self, tensor, state):
        x = _check_input(tensor, "TopK.compress")
        r = state.residual(x) if self.error_feedback else None
        values, indices = topk_compress(
            x, ratio=self.ratio, residual=r, exact=self.exact, check_finite=self.check_finite, provider=self.provider
        )
        state.step += 1
        return Payload({"values": values, "indices": indices}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = _check_out(out, payload.numel, "TopK.decompress")
        t = payload.tensors
        topk_decompress(t["values"], t["indices"], payload.numel, out=o, accumulate=accumulate, alpha=alpha,
                        provider=self.provider)  # fmt: skip
        return out

    def decompress_sum(self, payloads, state, out, *, alpha=1.0):
        if not payloads:
            raise InvalidArgumentError("TopK.decompress_sum: no payloads")
        o = _check_out(out, payloads[0].numel, "TopK.decompress_sum")
        values = torch.cat([p.tensors["values"] for p in payloads])
        indices = torch.cat([p.tensors["indices"] for p in payloads])
        o.zero_()
        topk_decompress(values, indices, payloads[0].numel, out=o, accumulate=True, alpha=alpha,
                        provider=self.provider)  # fmt: skip
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = _numel(shape)
        k = topk_count(numel, self.ratio)
        return k * (torch.empty((), dtype=dtype).element_size() + (4 if numel < 2**31 else 8))


@dataclass(slots=True)
class Quantize(Compressor):
    """Blockwise absmax int8 / int4 quantization, optionally stochastic, with error feedback."""

    bits: int = 8
    """8 or 4 bits per element (int4 packed two per byte)."""
    block: int = 256
    """Elements per scale (a power of two)."""
    stochastic: bool = False
    """Stochastic rounding (unbiased), noise from the state's seed and step."""
    _: KW_ONLY
    error_feedback: bool = True
    """Keep the quantization error in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise InvalidArgumentError(f"Quantize: bits must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.block, int) or self.block < 2 or self.block & (self.block - 1):
            raise InvalidArgumentError(f"Quantize: block must be a power of two >= 2, got {self.block!r}")

    def step_seed(self, state: CompressionState) -> int:
        """The stochastic-rounding seed of this step: from the state's seed and step count."""
        return (state.seed * 0x9E3779B97F4A7C15 + state.step) & 0xFFFFFFFFFFFFFFFF

    def compress(self, tensor, state):
        x = _check_input(tensor, "Quantize.compress")
        seed = self.step_seed(state) if self.stochastic else None
        if not self.error_feedback:
            q, s = quantize(x, bits=self.bits, block=self.block, stochastic=self.stochastic, seed=seed,
                            check_finite=self.check_finite, provider=self.provider)  # fmt: skip
        else:
            r = state.residual(x)
            acc = state.buffer("acc", x.numel(), x.device)
            residual_add(x, r, out=acc, check_finite=self.check_finite, provider=self.provider)
            q, s = quantize(acc, bits=self.bits, block=self.block, stochastic=self.stochastic, seed=seed,
                            check_finite=False, provider=self.provider)  # fmt: skip
            # acc - dequantized = the new residual, written over acc; then the buffers swap roles
            dequantize(q, s, block=self.block, numel=x.numel(), out=acc, accumulate=True, alpha=-1.0,
                       provider=self.provider)  # fmt: skip
            state.tensors["residual"], state.work["acc"] = acc, r
        state.step += 1
        return Payload({"q": q, "scales": s}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = _check_out(out, payload.numel, "Quantize.decompress")
        t = payload.tensors
        dequantize(t["q"], t["scales"], block=self.block, numel=payload.numel, out=o, accumulate=accumulate,
                   alpha=alpha, provider=self.provider)  # fmt: skip
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = _numel(shape)
        codes = numel if self.bits == 8 else -(-numel // 2)
        return codes + 4 * -(-numel // self.block)


@dataclass(slots=True)
class Sign(Compressor):
    """1-bit signs plus one scale (mean |v|), with error feedback (EF-SignSGD)."""

    _: KW_ONLY
    error_feedback: bool = True
    """Keep v - scale * sign(v) in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False

    def compress(self, tensor, state):
        x = _check_input(tensor, "Sign.compress")
        r = state.residual(x) if self.error_feedback else None
        bits, scale = sign_compress(x, r, check_finite=self.check_finite, provider=self.provider)
        state.step += 1
        return Payload({"bits": bits, "scale": scale.reshape(1)}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = _check_out(out, payload.numel, "Sign.decompress")
        t = payload.tensors
        sign_decompress(t["bits"], t["scale"], payload.numel, out=o, accumulate=accumulate, alpha=alpha,
                        provider=self.provider)  # fmt: skip
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = _numel(shape)
        return -(-numel // 8) + 4


def matrix_shape(tensor: torch.Tensor) -> tuple[int, int]:
    """PowerSGD's matrix view: [shape[0], rest] for tensors of 2+ dims, a near-square padded one for
    flat tensors (as PyTorch's batched PowerSGD does)."""
    n = tensor.numel()
    if tensor.dim() >= 2 and tensor.shape[0] > 1 and n // tensor.shape[0] > 1:
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

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidArgumentError(f"PowerSGD: rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise InvalidArgumentError(f"PowerSGD: start_iter must be an int >= 0, got {self.start_iter!r}")
        if not isinstance(self.min_compression_rate, (int, float)) or self.min_compression_rate < 0:
            raise InvalidArgumentError(
                f"PowerSGD: min_compression_rate must be >= 0, got {self.min_compression_rate!r}"
            )

    def _plan(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        rows, cols = matrix_shape(tensor)
        r = min(self.rank, rows, cols)
        if rows * cols / ((rows + cols) * r) < self.min_compression_rate:
            return None
        return rows, cols, r

    def compress(self, tensor, state):
        x = _check_input(tensor, "PowerSGD.compress")
        plan = self._plan(tensor) if state.step >= self.start_iter else None
        if plan is None:
            if self.check_finite:
                _check_finite_tensor(x, "PowerSGD.compress")
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
        orthogonalize(p, check_finite=self.check_finite, provider=self.provider)
        m = state.work["m"]
        rows, cols = p.shape[0], m.numel() // p.shape[0]
        state.work["p"] = p
        # Q = M^T P, computed as (P^T M)^T: row-major M is read along its rows (several times faster on CPU)
        return Payload({"q": (p.t() @ m.view(rows, cols)).t().contiguous()}, payload.numel)

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = _check_out(out, payload.numel, "PowerSGD.decompress")
        if "data" in payload.tensors:  # uncompressed round
            _decode_plain(payload.tensors["data"], o, alpha, accumulate, self.provider)
            return out
        if accumulate:
            raise InvalidArgumentError("PowerSGD.decompress: accumulate is not supported (PowerSGD is all-reduced)")
        q = payload.tensors["q"]
        q = q * alpha if alpha != 1.0 else q.clone()  # owned by the state, not the caller's payload
        state.tensors["q"] = q  # the averaged Q: next step's warm start
        p, m = state.work["p"], state.work["m"]
        approx = state.buffer("approx", m.numel(), m.device)
        torch.matmul(p, q.t(), out=approx.view(p.shape[0], -1))
        n = payload.numel
        error_update(m[:n], approx[:n], state.residual(o), out=o, provider=self.provider)
        return out

    def decompress_sum(self, payloads, state, out, *, alpha=1.0):
        raise InvalidArgumentError("PowerSGD is linear: all-reduce its payloads instead of gathering them")

    def payload_nbytes(self, shape, dtype=torch.float32):
        """Steady state (after start_iter): P and Q in fp32, or the fp32 tensor when not worth compressing."""
        t = torch.empty(shape, device="meta")
        plan = self._plan(t)
        if plan is None:
            return 4 * t.numel()
        rows, cols, r = plan
        return 4 * r * (rows + cols)


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
