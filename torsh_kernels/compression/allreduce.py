"""The compressed all-reduce driver: every rank ends with the average of the ranks' compressed
contributions.

``compressed_all_reduce(tensor, comm, compressor, state)`` overwrites ``tensor`` with the average. It
validates, then runs the rounds the compressor describes (``compressor.reduce``, see
:mod:`~torsh_kernels.compression.base`): linear compressors all-reduce each round's payloads (PowerSGD's
P and Q; FP16 divided by the world size first so the sum cannot overflow), the others all-gather them,
and compressors with a scheme of their own run it (sign's two phases, quantize's shared scale). This
module knows no compressor by name: a new compressor needs no change here.

Ordering: the collectives a call issues depend only on the compressor, the tensors' shapes and the
states' step counts, never on timing or on the data, so ranks that make the same calls issue the same
collectives in the same order, whatever the number of buckets.

Each rank keeps its own ``state`` per bucket (error-feedback residuals are per rank by design).

Agreement: before the first call with a new configuration on a communicator (compressor class and
settings, its scheme among them, ``link``, the tensors' shapes and dtypes, the states' phases), the ranks
exchange its signature (:func:`~torsh_kernels.collectives.agreement.agree_once`: one small all-gather of a
fixed size, remembered per process group) and every rank raises
:class:`~torsh_kernels.errors.CollectiveMismatchError` naming what differs if any rank's differs, before
anything else is sent; later calls with the same configuration exchange nothing.
``check_signatures=False`` (or ``TORSH_KERNELS_CHECK_SIGNATURES=0``) skips it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .. import recording
from ..collectives.agreement import agree_once, enabled, exchanging, fields_of
from ..collectives.communicator import Communicator, as_communicator, reject_dtensor
from ..collectives.cost_model import Link
from ..env import fmt_bytes
from ..errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError, ShapeError, TorshKernelsError
from ..ops import COMPRESS_DTYPES
from .base import CompressionState, Compressor
from .cast import NoCompression
from .names import as_compressor
from .quantize import SCHEMES as QUANTIZE_MODES
from .quantize import apply_quantize_mode

__all__ = ["QUANTIZE_MODES", "CompressedReduction", "compressed_all_reduce", "start_compressed_all_reduce"]

_UNCOMPRESSED = NoCompression()
"""What ``compressor=None`` runs (stateless, so one instance serves every call)."""


class CompressedReduction:
    """A compressed all-reduce in flight. Each round's collectives are issued asynchronously; ``step()``
    waits for the current round and issues the next (or finishes), ``wait()`` runs to the end.

    Several reductions may be in flight at once (one per bucket): as long as every rank starts them and
    steps them in the same order, every rank issues the same collectives in the same order. The DDP
    hook and the gradient synchronizer pipeline them that way (PowerSGD's P round of one bucket travels
    while the Q round of the one before is computed)."""

    __slots__ = ("_gen", "_pending", "_trace_args", "bytes_sent", "compute_s", "done", "error", "rounds",
                 "single_round", "tensors", "wait_s")  # fmt: skip

    def __init__(
        self, tensors: list[torch.Tensor], gen, compressor: str = "none", algorithm: str = "all_reduce", *,
        single_round: bool = False,
    ) -> None:  # fmt: skip
        self.tensors = tensors
        """The tensors being averaged in place (the result lands in them)."""
        self.bytes_sent = 0
        """Payload bytes this rank has put on the wire so far (each collective's input, summed)."""
        self.rounds = 0
        """Rounds of collectives issued so far."""
        self.compute_s = 0.0
        """Seconds spent compressing and decompressing (this rank, wall clock)."""
        self.wait_s = 0.0
        """Seconds spent waiting for collectives to complete."""
        self.done = False
        self.single_round = single_round
        """The caller knows the reduction has one round: no collective follows the first, so its decode may
        run from the collective's completion callback (:meth:`future`)."""
        self.error: BaseException | None = None
        """Why the reduction failed in :meth:`future`'s completion callback (a ``CollectiveError``, the
        decode's ``NonFiniteError``, ...). torch's futures turn an exception raised in a callback into a
        ``RuntimeError`` that names it; a caller waiting on the future re-raises this one instead."""
        self._gen = gen
        self._pending: list = []
        self._trace_args = (compressor, algorithm)
        self._resume()

    def __repr__(self) -> str:
        c, alg = self._trace_args
        return (
            f"CompressedReduction({c}, {alg}, tensors={len(self.tensors)}, rounds={self.rounds}, done={self.done}, "
            f"sent {fmt_bytes(self.bytes_sent)}, compute {self.compute_s:.3g} s, wait {self.wait_s:.3g} s)"
        )

    def _resume(self) -> None:
        rec = recording.recorder
        if rec is not None:
            c, alg = self._trace_args
            dev = self.tensors[0].device if self.tensors else None
            # compressing this round, issuing its collectives (which inherit compressor and algorithm from
            # this span) and decompressing the previous one; uncompressed reductions only issue
            name = f"{c} round {self.rounds + 1}" if c != "none" else "issue all_reduce"
            cat = "compression" if c != "none" else "issue"
            with rec.span(name, cat, {"compressor": c, "algorithm": alg, "round": self.rounds + 1}, device=dev):
                self._advance()
        else:
            self._advance()

    def _advance(self) -> None:
        t0 = time.perf_counter()
        try:
            self._pending, nbytes = next(self._gen)  # each round: its handles and the bytes it sends
            self.bytes_sent += nbytes
            self.rounds += 1
        except StopIteration:
            self._pending, self.done, self._gen = [], True, None
        finally:
            self.compute_s += time.perf_counter() - t0

    def step(self) -> bool:
        """Wait for the current round, then issue the next one or finish. Returns ``done``."""
        if self.done:
            return True
        t0 = time.perf_counter()
        rec = recording.recorder
        if rec is not None and self._pending:
            with rec.span("wait", "wait", {"compressor": self._trace_args[0], "round": self.rounds}):
                for h in self._pending:
                    h.wait()
        else:
            for h in self._pending:
                h.wait()
        self.wait_s += time.perf_counter() - t0
        self._resume()
        return self.done

    def ready(self) -> bool:
        """Whether the current round's collectives have completed (``step()`` would not block on them)."""
        return all(h.is_completed() for h in self._pending)

    def wait(self) -> list[torch.Tensor]:
        """Run to the end; returns the averaged tensors."""
        while not self.step():
            pass
        return self.tensors

    def future(self, then: Callable[[], object] | None = None) -> torch.futures.Future | None:
        """For a ``single_round`` reduction: a ``torch.futures.Future`` of the averaged tensors whose
        decode runs in the completion callback of the round's collectives (on the backend's thread for
        gloo), so nobody blocks; None where a handle offers no future (``Handle.future()``) or the
        reduction has more rounds (those must be issued by the caller, in order). Do not ``step()`` a
        reduction after taking its future. ``then``: called after the decode, in the same callback; the
        future's value is then what it returns (the DDP hook's statistics and bucket, without a further
        ``.then`` layer)."""
        if self.done:
            f: torch.futures.Future = torch.futures.Future()
            f.set_result(self.tensors if then is None else then())
            return f
        if not self.single_round:
            return None
        futs = []
        for h in self._pending:
            get = getattr(h, "future", None)
            f = get() if get is not None else None
            if f is None:
                return None
            futs.append(f)
        if len(futs) == 1:
            fut = futs[0]
        elif futs:
            fut = torch.futures.collect_all(futs)
        else:
            fut = torch.futures.Future()
            fut.set_result(None)
        n = len(futs)

        def finish(f: torch.futures.Future) -> list[torch.Tensor]:
            try:
                v = f.value()  # raises the collective's error
                if n > 1:
                    for x in v:
                        x.value()
                self._pending = []
                self._resume()  # the decode
                if not self.done:
                    raise InvalidArgumentError(
                        "CompressedReduction.future: the reduction issued a second round from a completion "
                        "callback; it was marked single_round wrongly"
                    )
                return self.tensors if then is None else then()
            except BaseException as e:
                self.error = typed_error(e, self._pending)
                raise

        return fut.then(finish)


def typed_error(e: BaseException, handles: Sequence[object] = ()) -> BaseException:
    """``e`` if it is a torsh error, else the typed error one of ``handles`` failed with (torch's futures
    hand a callback's exception on as a ``RuntimeError`` naming it), else ``e``."""
    if isinstance(e, TorshKernelsError):
        return e
    for h in handles:
        err = getattr(h, "error", None)
        if err is not None:
            return err
    return e


def compressed_all_reduce(
    tensor: torch.Tensor | Sequence[torch.Tensor],
    comm: Communicator,
    compressor: Compressor | str | None = None,
    state: CompressionState | Sequence[CompressionState] | None = None,
    *,
    link: Link | None = None,
    check_signatures: bool | None = None,
    quantize_mode: str | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Average ``tensor`` over the ranks of ``comm`` (a Communicator, or a ProcessGroup, a 1-D DeviceMesh
    or ``(mesh, dim)``) through ``compressor`` (or its name, ``"int8"``, ``"topk:0.01"``:
    :mod:`~torsh_kernels.compression.names`; None: uncompressed), in place; returns ``tensor``.
    ``state`` is this rank's state for this tensor (bucket), from ``compressor.new_state()``; it may
    be None only for stateless compressors (none, FP16, BF16).
    ``link`` (e.g. from ``probe``) informs a compressor that picks its scheme by the cost model
    (``Quantize(scheme="auto")``). ``quantize_mode``: deprecated, ``Quantize(scheme=...)`` replaces it
    (:func:`~torsh_kernels.compression.quantize.apply_quantize_mode`). ``check_signatures``: exchange the
    call's signature with the other ranks the first time a configuration is used (see the module
    docstring; None: on unless ``TORSH_KERNELS_CHECK_SIGNATURES=0``).

    ``tensor`` may also be a list of tensors with a list of states (one per tensor): each tensor is
    compressed on its own, and the payloads of a round share one collective where the compressor
    allows it (linear compressors: one flat all-reduce per round; top-k and gathered int8/int4: one
    all-gather)."""
    r = start_compressed_all_reduce(tensor, comm, compressor, state, link=link, check_signatures=check_signatures,
                                    quantize_mode=quantize_mode)  # fmt: skip
    r.wait()
    return tensor


def start_compressed_all_reduce(
    tensor: torch.Tensor | Sequence[torch.Tensor],
    comm: Communicator,
    compressor: Compressor | str | None = None,
    state: CompressionState | Sequence[CompressionState] | None = None,
    *,
    link: Link | None = None,
    check_signatures: bool | None = None,
    quantize_mode: str | None = None,
) -> CompressedReduction:
    """Validate, compress and issue the first round of :func:`compressed_all_reduce`; returns the
    :class:`CompressedReduction` to ``step()`` or ``wait()`` on. Arguments as for
    ``compressed_all_reduce``."""
    what = "compressed_all_reduce"
    single = isinstance(tensor, torch.Tensor)
    if single:
        tensors = [tensor]
    elif isinstance(tensor, (list, tuple)):
        tensors = list(tensor)
    else:
        raise ArgumentTypeError(f"{what}: expected a torch.Tensor or a list of them, got {type(tensor).__name__}")
    comm = as_communicator(comm, what, needs=("rank", "world_size", "device", "all_reduce", "all_gather"))
    dev = comm.device
    for i, t in enumerate(tensors):
        name = "tensor" if single else f"tensor[{i}]"
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{what}: {name} is a {type(t).__name__}, expected a torch.Tensor")
        reject_dtensor(t, what, name)
        if t.dtype not in COMPRESS_DTYPES:
            raise InvalidArgumentError(f"{what}: {name} dtype {t.dtype}; expected float32, float16 or bfloat16")
        if not t.is_contiguous():
            raise ShapeError(f"{what}: {name} must be contiguous (the average is written into it)")
        if t.device.type != dev.type or (dev.type == "cuda" and t.device.index != dev.index):
            raise DeviceMismatchError(f"{what}: {name} is on {t.device}, the communicator moves tensors on {dev}")
    if isinstance(compressor, str):  # a name: "int8", "topk:0.01"
        compressor = as_compressor(compressor, f"{what}: compressor")
    if compressor is None:
        compressor = _UNCOMPRESSED
    if not isinstance(compressor, Compressor):
        raise ArgumentTypeError(
            f"{what}: compressor must be a Compressor, a compressor's name (e.g. 'int8') or None, got "
            f"{type(compressor).__name__}"
        )
    if quantize_mode is not None:
        compressor = apply_quantize_mode(compressor, quantize_mode, what)
    stateful = compressor.stateful
    if single:
        states = [state]
    elif state is None:
        states = [None] * len(tensors)
    elif isinstance(state, (list, tuple)) and len(state) == len(tensors):
        states = list(state)
    else:
        got = f"{len(state)} states" if isinstance(state, (list, tuple)) else type(state).__name__
        raise InvalidArgumentError(f"{what}: {len(tensors)} tensors need a list of {len(tensors)} states, got {got}")
    for i, s in enumerate(states):
        if s is None:
            if stateful:
                raise InvalidArgumentError(
                    f"{what}: {type(compressor).__name__} keeps state (error feedback); pass "
                    "state=compressor.new_state() (one per tensor) and reuse it for that tensor on every step"
                )
            states[i] = compressor.new_state()
        elif not isinstance(s, CompressionState):
            raise ArgumentTypeError(f"{what}: state must be a CompressionState, got {type(s).__name__}")
    if stateful and len({id(s) for s in states}) != len(states):
        raise InvalidArgumentError(f"{what}: each tensor needs its own state; the same state was given twice")
    if link is not None and not isinstance(link, Link):
        raise ArgumentTypeError(f"{what}: link must be a Link (e.g. from probe()) or None, got {type(link).__name__}")
    if enabled(check_signatures, what):
        agree_call(comm, tensors, states, compressor, link)
    return issue(tensors, states, comm, compressor, link=link)


def agree_call(comm: Communicator, tensors: Sequence[torch.Tensor], states: Sequence[CompressionState],
               compressor: Compressor, link: Link | None = None) -> bool:  # fmt: skip
    """The signature exchange of :func:`start_compressed_all_reduce` (once per configuration and process
    group, see the module docstring); returns whether it exchanged."""
    if not exchanging(comm):
        return False
    layout = tuple((t.shape, t.dtype) for t in tensors)
    phases = tuple(compressor.phase(s) for s in states)
    key = ("compressed_all_reduce", compressor.signature(), link, layout, phases)

    def fields() -> list[tuple[str, object]]:
        return fields_of({"compressor": compressor}, tensors, [("link", link), ("state phases", list(phases))])

    return agree_once(
        comm, key, "a compressed all-reduce", fields, what="compressed_all_reduce",
        fix="Call it on every rank at the same point with the same compressor (class and settings), "
        "link, tensor shapes and dtypes, and states of the same age.",
    )  # fmt: skip


def issue(
    tensors: list[torch.Tensor], states: list[CompressionState], comm: Communicator, compressor: Compressor, *,
    link: Link | None = None, single_round: bool = False,
    plain: Sequence[torch.Tensor] = (),
) -> CompressedReduction:  # fmt: skip
    """:func:`start_compressed_all_reduce` without its checks, for callers that validated the tensors,
    states and arguments once and reuse them every step (the bucket layer caches that per bucket).
    ``plain``: tensors averaged uncompressed in the first round's collective (only for a compressor
    that ``carries_plain``, with non-empty ``tensors``)."""
    if plain:
        gen, alg = compressor.reduce(tensors, states, comm, link=link, plain=plain)
        return CompressedReduction([*tensors, *plain], gen, compressor.kind, alg, single_round=single_round)
    if all(t.numel() for t in tensors):
        gen, alg = compressor.reduce(tensors, states, comm, link=link)
    else:
        live = [(t, s) for t, s in zip(tensors, states) if t.numel()]
        if live:
            gen, alg = compressor.reduce([t for t, _ in live], [s for _, s in live], comm, link=link)
        else:
            gen, alg = iter(()), "none"
    return CompressedReduction(tensors, gen, compressor.kind, alg, single_round=single_round)
