"""The engine's side of the DDP hook: a bucket's path from :func:`~.hooks.compression_hook` to the communicator.

``hooks.py`` adapts DDP (the hook's state, its arguments, its checkpoints) and hands each bucket here in one
call, :meth:`HookRun.bucket` (or a ``(grad, param)`` pair under compiled autograd's python reducer,
:meth:`HookRun.parameter`). From here the bucket goes one way, down: the engine agrees on its layout and
screens it (:class:`~.engine.BucketCompressor`), the compression driver issues its rounds
(:func:`~torsh_kernels.compression.allreduce.issue`), the compressor encodes and decodes, the ops and the
communicator do the work; this module keeps the iteration's bookkeeping around that path: the pipeline of
multi-round buckets, the one-round buckets' futures, the statistics of the turn, the iteration's end.
Nothing below calls back into the hook.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .. import live, recording
from ..collectives.coalesce import Coalescer
from ..collectives.sparse import all_reduce_sparse, sparse_nbytes
from ..errors import TorshKernelsError
from .engine import BucketCompressor
from .hook_stats import HookStats, Turn, bucket_span, chained, recorded, totals
from .live_step import StepMeter, end_step
from .pipeline import ReductionPipeline

__all__ = ["HookRun"]


class HookRun:
    """One hook state's iterations: the engine, the statistics, and what an iteration has in flight."""

    __slots__ = ("comm", "engine", "futures", "meter", "pipeline", "seen", "signatures", "stats", "task", "turn")

    def __init__(self, engine: BucketCompressor, stats: HookStats) -> None:
        self.engine = engine
        self.stats = stats
        self.signatures = (engine.signature_checks, engine.signature_s)  # exchanges already in stats
        self.pipeline = ReductionPipeline()
        self.futures: list = []  # this iteration's one-round buckets: (the future returned to DDP, reductions)
        self.seen: set[int] = set()  # called per parameter: the parameters of the iteration so far
        self.task: int | None = None  # ... and the autograd graph task (the backward pass) they came from
        self.turn = Turn(stats)
        self.meter = StepMeter("ddp")  # the live metrics' and auto's link following's view of the steps
        self.comm: Coalescer | None = None

    # -- a bucket -------------------------------------------------------------------------------------

    def bucket(self, comm: Coalescer, buf: torch.Tensor, gradients, keys: list[int], index: int, last: bool):
        """Average one DDP bucket (``buf``: its flat buffer; ``gradients``: the bucket's method returning its
        gradients as views of it): the future DDP waits on."""
        engine = self.engine
        turn = self.turn
        try:
            turn.begin(comm)
            if live.publisher is not None or engine.follow is not None:
                self._watch(comm, [buf])
            if buf.layout != torch.strided:  # a sparse gradient: its own bucket, averaged uncompressed
                fut = torch.futures.Future()
                fut.set_result(self._sparse(buf, comm, turn))
            else:
                span = bucket_span(index, gradients(), engine.compressor) if recording.recorder else None
                grads = engine.prepare(gradients, keys, comm, flat=buf)  # a new layout: agree on it first
                nonfinite = engine.screen([buf], comm)
                # While older buckets have rounds to issue (PowerSGD's Q), this bucket's first round and theirs
                # go out as one all-reduce: the collectives issued below (this bucket's, and the older ones' that
                # the pipeline advances) depend only on the bucket sequence, so every rank coalesces the same ones
                with comm.batch() if self.pipeline.multi_round() else contextlib.nullcontext():
                    reductions, finish = engine.start(grads, keys, comm, flat=buf, nonfinite=nonfinite)
                    if engine.auto is not None and self.stats.auto is None and engine.auto.decision is not None:
                        self.stats.auto = engine.auto.decision.as_dict()
                    before = buf.numel() * buf.element_size()
                    fut = None
                    if finish is None and all(r.single_round for r in reductions):
                        if len(reductions) == 1:  # the common case: the statistics in the decode's own callback
                            fut = reductions[0].future(recorded(buf, reductions[0], before, turn, span))
                        else:
                            futs = [r.future() for r in reductions]
                            if all(f is not None for f in futs):
                                fut = chained(futs, buf, reductions, before, turn, span)
                        if fut is not None:
                            self.futures.append((fut, reductions))
                    if fut is None:
                        fut = torch.futures.Future(devices=[buf.device] if buf.device.type == "cuda" else None)

                        def done() -> None:
                            if finish is not None:
                                finish()
                            turn.record(before, totals(reductions), False)
                            fut.set_result(buf)

                        self.pipeline.submit(reductions, done, span)
            if last:
                self.pipeline.drain(comm.batch)
                t0 = time.perf_counter()
                self._wait_one_round()
                blocked = time.perf_counter() - t0
                engine.check_averages()
                self._end_iteration(turn, comm, blocked)
        except BaseException:
            self.start_over()
            raise
        return fut

    def _sparse(self, grad: torch.Tensor, comm: Coalescer, turn: Turn) -> torch.Tensor:
        """A sparse gradient, averaged uncompressed (and synchronously: the result's size depends on every rank)."""
        t0 = time.perf_counter()
        out, sent = all_reduce_sparse(comm, grad)
        self.stats.sparse_buckets += 1
        before = sparse_nbytes(grad)
        turn.record(before, {"bytes_sent": sent, "compress_s": 0.0, "wait_s": time.perf_counter() - t0}, False)
        return out

    # -- a (gradient, parameter) pair: compiled autograd's python reducer ----------------------------

    def parameter(self, comm: Coalescer, grad: torch.Tensor, param: torch.Tensor, key: int) -> torch.Tensor:
        """Average one parameter's gradient in place (see :func:`~.hooks.compression_hook`). An iteration is
        one backward pass (autograd's graph task), whatever parameters it reaches: it is closed when a
        gradient of the next pass arrives, or when ``state_dict()`` or ``iteration`` is read between passes."""
        task = torch._C._current_graph_task_id()  # -1 outside a backward pass (a direct call)
        if self.seen and (task != self.task or (task == -1 and key in self.seen)):
            self.close_parameter_iteration(comm)
        self.task = task
        self.seen.add(key)
        turn = self.turn
        engine = self.engine
        turn.begin(comm)
        try:
            if live.publisher is not None or engine.follow is not None:
                self._watch(comm, [grad])
            if grad.layout != torch.strided:
                param.grad = grad = self._sparse(grad, comm, turn)
            else:
                span = bucket_span(key, [grad], engine.compressor) if recording.recorder else None
                flat = grad.view(-1) if grad.is_contiguous() else None
                engine.prepare([grad], [key], comm, flat=flat)  # a new layout: agree on it first
                nonfinite = engine.screen([grad], comm)
                reductions, finish = engine.start([grad], [key], comm, flat=flat, nonfinite=nonfinite)
                pipeline = ReductionPipeline()
                pipeline.submit(reductions, finish, span)
                pipeline.drain(comm.batch)
                engine.check_averages()
                turn.record(grad.numel() * grad.element_size(), totals(reductions), False)
        except BaseException:
            self.start_over()
            raise
        return grad

    def close_parameter_iteration(self, comm: Coalescer | None = None) -> None:
        """End the iteration the per-parameter call form has open, if any (never inside a backward pass).
        ``comm``: given where every rank closes it at the same point (the next pass's first gradient), so that
        auto's link following may issue its check there; reading ``iteration`` or ``state_dict()`` closes it
        without."""
        if not self.seen or (self.task == torch._C._current_graph_task_id() != -1):
            return
        self.seen = set()
        self.task = None
        self._end_iteration(self.turn, comm)

    # -- the iteration --------------------------------------------------------------------------------

    def _wait_one_round(self) -> None:
        """Wait for the iteration's one-round buckets (their collectives were issued in order before this last
        bucket's), raising the first failure as its typed error: DDP would wait for them right after the last
        bucket, but it turns a future's error into a bare ``RuntimeError``."""
        futs, self.futures = self.futures, []
        for fut, reductions in futs:
            try:
                fut.wait()
            except Exception:
                typed = next((r.error for r in reductions if isinstance(r.error, TorshKernelsError)), None)
                if typed is None:
                    raise
                raise typed from None

    def start_over(self) -> None:
        """After a failure: the collectives of this iteration are out of step with the other ranks, so the
        next call starts a fresh iteration (nothing in flight, nothing noted)."""
        self.pipeline = ReductionPipeline()
        self.futures = []
        self.turn = Turn(self.stats)
        self.seen = set()
        self.task = None
        self.engine.abandon_iteration()
        self._count_signatures(None)

    def _count_signatures(self, turn: Turn | None) -> None:
        """Add the engine's signature exchanges since the last count to the statistics (and the iteration's)."""
        e = self.engine
        n0, s0 = self.signatures
        n, s = e.signature_checks - n0, e.signature_s - s0
        if n:
            self.signatures = (e.signature_checks, e.signature_s)
            self.stats.signature_checks += n
            self.stats.signature_s += s
        if turn is not None:
            with turn.lock:
                turn.figures["signature_checks"] = n
                turn.figures["signature_s"] = s

    def _end_iteration(self, turn: Turn, comm: Coalescer | None = None, blocked: float = 0.0) -> None:
        engine = self.engine
        undone = engine.end_iteration()
        if undone:
            self.stats.nonfinite_steps += 1
        self._count_signatures(turn)
        self.stats.iterations += 1
        self.turn = Turn(self.stats)
        turn.close()
        if live.publisher is not None or engine.follow is not None or self.meter.watched:
            f = turn.figures  # the live record, and auto's check (with comm only: see close_parameter_iteration)
            switch = end_step(self.meter, engine, comm, step=self.stats.iterations - 1, comm_s=f["wait_s"] + blocked,
                              compress_s=f["compress_s"], payload_bytes=f["bytes_before"],
                              sent_bytes=f["bytes_after"], undone=undone)  # fmt: skip
            if switch is not None:
                self.stats.auto = {**engine.auto.decision.as_dict(), "replans": list(engine.replans)}

    # -- the live metrics and auto's link following ---------------------------------------------------

    def _watch(self, comm: Coalescer, tensors: list[torch.Tensor]) -> None:
        """Someone listens, or auto follows the link: time the communicator's collectives; on a sampling step
        add this bucket's gradient norms (before they are reduced) for the compression error."""
        self.comm = comm
        self.meter.watch(comm)
        if self.meter.sampling:
            self.meter.add_gradients(tensors)
