"""The order in which buckets' reductions advance (:class:`ReductionPipeline`, see
:mod:`torsh_kernels.parallel.engine`'s docstring), and whether a
GradScaler is in use (what ``nonfinite="auto"`` resolves by)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import deque
from collections.abc import Callable

import torch

from ..compression import CompressedReduction, Compressor

__all__ = ["ReductionPipeline", "grad_scaler_in_use", "summing", "unchecked"]


class ReductionPipeline:
    """Buckets' reductions in flight, advanced in a rank-independent order (see the module docstring)."""

    __slots__ = ("_inflight",)

    def __init__(self) -> None:
        self._inflight: deque[tuple[list[CompressedReduction], Callable[[], None] | None, object]] = deque()

    def __len__(self) -> int:
        return len(self._inflight)

    def submit(self, reductions: list[CompressedReduction], on_done: Callable[[], None] | None = None,
               span=None) -> None:  # fmt: skip
        """Add a started bucket; every older bucket in flight with more rounds to issue then advances by
        one round. Older one-round buckets are finished only if their collectives have completed (their
        decode issues nothing, so this poll cannot change the order of collectives). ``span``: the
        bucket's timeline interval (from :func:`bucket_span`), ended when the bucket is done."""
        if self._inflight:
            for rs, _, _ in self._inflight:
                for r in rs:
                    if not r.done and (not r.single_round or r.ready()):
                        r.step()
        self._inflight.append((reductions, on_done, span))
        self._reap()

    def multi_round(self) -> bool:
        """Whether a bucket in flight still has rounds to issue. The same on every rank at the same point of
        the bucket sequence: a multi-round reduction finishes only in ``step()``, which the pipeline calls
        in a rank-independent order (one-round buckets, polled by timing, issue nothing)."""
        for rs, _, _ in self._inflight:
            for r in rs:
                if not r.done and not r.single_round:
                    return True
        return False

    def drain(self, batch: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """Advance every bucket, oldest first, round by round, until all are done. ``batch``: a
        ``Coalescer.batch`` under which each pass runs, so the rounds one pass issues go out together."""
        while self._inflight:
            with batch() if batch is not None and self.multi_round() else contextlib.nullcontext():
                for rs, _, _ in list(self._inflight):
                    for r in rs:
                        r.step()
            self._reap()

    def _reap(self) -> None:
        while self._inflight and all(r.done for r in self._inflight[0][0]):
            _, on_done, span = self._inflight.popleft()
            if on_done is not None:
                on_done()
            if span is not None:
                span.end()


def grad_scaler_in_use() -> bool:
    """Whether this process holds an enabled ``torch.amp.GradScaler`` (or a subclass's instance): what
    ``nonfinite="auto"`` resolves to "propagate" by. One look at the objects that refer to the scaler
    classes (their instances), made once per hook state or synchronizer."""
    base = torch.amp.GradScaler
    classes, todo = [], [base]
    while todo:
        k = todo.pop()
        classes.append(k)
        todo.extend(k.__subclasses__())
    return any(isinstance(o, base) and o.is_enabled() for o in gc.get_referrers(*classes))


def summing(gen, tensors: list[torch.Tensor], sink: list):
    """``gen``'s rounds, then (average, its sum in fp32) of each tensor appended to ``sink`` (a list append:
    safe from the backend's completion thread)."""
    yield from gen
    for t in tensors:
        sink.append((t.sum(dtype=torch.float32).reshape(1), t))


def unchecked(c: Compressor) -> Compressor:
    """``c`` without its NaN/Inf check (under "propagate" the bucket layer has screened the input)."""
    if getattr(c, "check_finite", False):
        return dataclasses.replace(c, check_finite=False)
    return c
