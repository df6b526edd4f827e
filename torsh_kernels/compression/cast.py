"""Compressors that only cast: :class:`NoCompression` (the tensor as it is), :class:`FP16` and
:class:`BF16` (2 bytes per element). All linear: one all-reduce, one decode with the 1/world scale.

They are elementwise (``elementwise = True``): the value sent for an element depends on that element
alone, so the bucket layer casts a whole bucket as one flat tensor (per-tensor policies and size rules
mean nothing for a cast) and sends it in one all-reduce. Their rounds cast every tensor of a call into
one wire buffer and divide it by the world size in the wire dtype (FP16): ``fp16(fp16(x) / world_size)``,
PyTorch's ``fp16_compress_hook``'s arithmetic, so the results are bitwise PyTorch's. A DDP bucket (one
contiguous tensor) goes through ``ops.wire_cast``: the cast, the division and the finite check in one
pass; a list of tensors through the fused flatten, then the division and the check."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from ..collectives.communicator import Communicator
from ..errors import NonFiniteError
from ..ops import count_nonfinite, flatten, unflatten, wire_cast
from .base import (
    Compressor,
    Payload,
    Rounds,
    check_input,
    check_out,
    check_settings,
    decode_plain,
    itemsize,
    numel_of,
    raise_if_nonfinite,
)

__all__ = ["BF16", "FP16", "NoCompression"]


@dataclass(slots=True)
class _Cast(Compressor):
    _: KW_ONLY
    check_finite: bool = True
    """Raise NonFiniteError if the cast payload holds NaN/Inf (fp16 overflows above 65504)."""
    provider: str | None = None
    """Kernel provider for the fused cast ops (None: automatic)."""

    dtype = torch.float32
    is_linear = True
    elementwise = True
    """The payload of an element depends on that element alone (see the module docstring)."""
    passes = 3.0

    def __post_init__(self) -> None:
        check_settings(self, type(self).__name__)

    def compress(self, tensor, state):
        x = check_input(tensor, f"{type(self).__name__}.compress")
        data, _ = flatten([x], dtype=self.dtype, provider=self.provider)
        if self.check_finite:
            raise_if_nonfinite(data, f"{type(self).__name__}.compress")
        state.step += 1
        return Payload({"data": data}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = check_out(out, payload.numel, f"{type(self).__name__}.decompress")
        decode_plain(payload.tensors["data"], o, alpha, accumulate, self.provider)
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        return numel_of(shape) * itemsize(self.dtype)

    def reduce(self, tensors, states, comm: Communicator, *, link=None) -> tuple[Rounds, str]:
        return self._cast_rounds(tensors, states, comm), "all_reduce"

    def _cast_rounds(self, tensors, states, comm: Communicator) -> Rounds:
        # one cast pass into the wire buffer, the 1/ws prescale in the wire dtype (fp16(fp16(x) / ws), as
        # PyTorch's fp16_compress_hook), one all-reduce, one pass back. A single contiguous tensor (a DDP
        # bucket) reuses the wire buffer its state keeps between calls (taken while in flight, so two
        # reductions sharing a state never share it); a list goes through the fused flatten/unflatten.
        ws = comm.world_size
        st = states[0]
        layout = None
        if len(tensors) == 1 and tensors[0].is_contiguous():  # cast, prescale and finite check in one pass
            x = tensors[0].view(-1)
            data = st.work.pop("wire", None)
            if data is None or data.numel() != x.numel() or data.dtype != self.dtype or data.device != x.device:
                data = torch.empty(x.numel(), dtype=self.dtype, device=x.device)
            try:
                wire_cast(x, divisor=ws if self.prescale else 1, out=data, check_finite=self.check_finite,
                          provider=self.provider)  # fmt: skip
            except NonFiniteError as e:
                raise NonFiniteError(f"{type(self).__name__}.compress: {e}") from None
        else:
            data, layout = flatten(tensors, dtype=self.dtype, provider=self.provider)
            if self.prescale:
                data.div_(ws)
            if self.check_finite:
                raise_if_nonfinite(data, f"{type(self).__name__}.compress")
        for s in states:
            s.step += 1
        yield [comm.all_reduce(data, "sum", async_op=True)], data.numel() * data.element_size()
        alpha = 1.0 if self.prescale else 1.0 / ws
        if layout is None:
            x.copy_(data)
            if alpha != 1.0:
                x.mul_(alpha)
            st.work["wire"] = data
        else:
            unflatten(data, layout, tensors, scale=alpha, provider=self.provider)


@dataclass(slots=True)
class NoCompression(_Cast):
    """Send the tensor as it is (its own dtype); the payload is a view of the input.

    ``check_finite`` checks the all-reduced average, not each rank's input: every rank holds the same
    average, so a NaN/Inf that any rank sent raises :class:`~torsh_kernels.errors.NonFiniteError` on every
    rank alike (with the average, NaN included, in the tensor), where a check of the input would raise on
    the rank that holds it alone and leave the others waiting for its collective."""

    identity = True
    passes = 0.0

    @property
    def kind(self) -> str:
        return "none"

    def compress(self, tensor, state):
        x = check_input(tensor, "NoCompression.compress")
        if self.check_finite:
            raise_if_nonfinite(x, "NoCompression.compress")
        state.step += 1
        return Payload({"data": x}, x.numel())

    def payload_nbytes(self, shape, dtype=torch.float32):
        return numel_of(shape) * itemsize(dtype)

    def reduce(self, tensors, states, comm: Communicator, *, link=None) -> tuple[Rounds, str]:
        return self._rounds(tensors, states, comm), "all_reduce"

    def _rounds(self, tensors, states, comm: Communicator) -> Rounds:
        # the payload is the tensor itself: one fused flatten, all-reduce, unflatten with the 1/ws scale
        for s in states:
            s.step += 1
        flat, layout = (tensors[0].view(-1), None) if len(tensors) == 1 else flatten(tensors)
        yield [comm.all_reduce(flat, "sum", async_op=True)], flat.numel() * flat.element_size()
        if layout is None:
            flat.div_(comm.world_size)
        else:
            unflatten(flat, layout, tensors, scale=1.0 / comm.world_size)
        if self.check_finite and (bad := int(count_nonfinite(flat))):  # the same sum on every rank
            raise NonFiniteError(
                f"compressed_all_reduce (uncompressed): the average holds {bad} non-finite element(s) (NaN/Inf) "
                "sent by some rank; every rank raises this, with the average in the tensor. Skip the step, or "
                "find the rank whose gradients overflowed"
            )


@dataclass(slots=True)
class FP16(_Cast):
    """Cast to fp16 for the wire (PyTorch's fp16_compress_hook): 2 bytes per element. The payload is
    divided by the world size before the all-reduce, as that hook does, so the sum cannot overflow."""

    dtype = torch.float16
    prescale = True


@dataclass(slots=True)
class BF16(_Cast):
    """Cast to bf16 for the wire: 2 bytes per element, fp32's range."""

    dtype = torch.bfloat16
