"""Agreeing before sending: a signature exchange that turns a collective mismatch into an error on every rank.

Ranks whose settings differ (a compressor's ratio or block size, a bucket's shapes, an FSDP2 quantization
format, an MoE layer's expert count) issue collectives of different sizes. On gloo two collectives of the
same kind and different sizes kill a process (``SIGABRT`` inside gloo: "Received data size doesn't match
expected size"); NCCL hangs or reads garbage. The layers above therefore agree on what they are about to
send, once per configuration, before they send it:

1. each rank describes what fixes its collectives as named fields (``agree(comm, topic, fields)``) and
   all-gathers one row of :data:`SLOTS` int64: a marker, the topic's hash, the fields' combined hash, the
   byte length of their readable description and the world size. The row has the same size on every rank
   whatever the fields hold, so the exchange itself cannot mismatch;
2. every rank holds the same gathered table, so every rank decides alike. Equal rows: nothing more
   happens. Otherwise a second all-gather, of the readable descriptions padded to the longest (a length
   the table gave every rank), lets every rank name each field that differs with each rank's value, and
   every rank raises :class:`~torsh_kernels.errors.CollectiveMismatchError` with the same message. Nothing
   mismatched went on the wire, so the group stays usable.

:func:`agree_once` remembers, per communicator (per process group for a
:class:`~torsh_kernels.collectives.TorchCommunicator`), the keys its ranks have agreed on, so a caller
that makes the same call every step exchanges only the first time. The world size and this library's
version are always among the fields. Nothing is exchanged on a single rank or over a
:class:`~torsh_kernels.collectives.ReplicaCommunicator` (its ranks are all this process).

On by default; ``check_signatures=False`` on the objects that exchange, or ``TORSH_KERNELS_CHECK_SIGNATURES=0``
in the environment, turns it off (:func:`enabled`).

Limits. The decision to skip an exchange ("these ranks agreed on this key before", "this bucket layout
has a plan") is local. It is sound while the ranks' histories agree: every rank then reaches the same
exchanges in the same order, and a difference in what they are about to send is caught at the first
exchange after it appears. What it cannot catch is a divergence that makes one rank exchange where another
does not: a checkpoint loaded or a compressor switched on some ranks only, a rank that already saw a
layout its peers see for the first time (a call with other shapes on one rank after identical calls), a
rank running code that does not exchange (another hook, an older version). The exchanging rank then
meets a data collective: against another kind (all-reduce, all-to-all, broadcast) gloo times out with
:class:`~torsh_kernels.errors.CollectiveError` on both sides; against an all-gather of another size gloo
still aborts; against one of the same size the marker does not match and the exchanging ranks raise
``CollectiveMismatchError`` while the other reads the row as data. The per-collective check
(``TorchCommunicator(check_consistency=True)``) covers those cases, at the price of an extra all-gather
per collective.

A setup call every rank must make (``apply_quantized_comm``) first meets its peers through the process
group's store (:func:`rendezvous`, no collective): a rank that did not make it is named after a timeout on
the ranks that did, before their exchange could meet its data all-gather.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..checks import env_flag
from ..env import __version__
from ..errors import ArgumentTypeError, CollectiveMismatchError, CollectiveTimeoutError
from ..specs import plain
from .coalesce import Coalescer
from .communicator import TorchCommunicator
from .replica import ReplicaCommunicator

__all__ = [
    "ENV",
    "SLOTS",
    "agree",
    "agree_on",
    "agree_once",
    "enabled",
    "exchanging",
    "fields_of",
    "layout",
    "plain",
    "rendezvous",
]

ENV = "TORSH_KERNELS_CHECK_SIGNATURES"
"""The environment variable that turns the exchange off (``0``) where an object's ``check_signatures`` is None."""

SLOTS = 8
"""int64 per rank in the exchange: marker, topic, fields' hash, description length, world size, field count, 2 spare."""

_MARKER = 0x746F727368736967  # "torshsig": a row that lacks it was not sent by an exchange
MAX_DESCRIPTION = 1 << 16
"""Bytes of readable description one rank sends at most (longer values are shortened)."""
SHOW = 240
"""Characters of one field's value shown in a message."""
MAX_KEYS = 4096
"""Agreed keys remembered per communicator (the oldest forgotten first, alike on every rank)."""


def enabled(flag: bool | None, what: str) -> bool:
    """Whether to exchange signatures: ``flag`` when given, else the environment (:data:`ENV`, on unless
    ``0``/``false``/``no``/``off``)."""
    if flag is None:
        v = os.environ.get(ENV)
        if v is None or v == "1":  # the common case, in one look-up (asked on every standalone call)
            return True
        return env_flag(ENV, True, what)
    if not isinstance(flag, bool):
        raise ArgumentTypeError(
            f"{what}: check_signatures must be True, False or None (None: the environment's {ENV}), got "
            f"{type(flag).__name__} {flag!r}"
        )
    return flag


def exchanging(comm: object) -> bool:
    """Whether ``comm`` has peers to disagree with (more than one rank, not a local replica): where not,
    :func:`agree` exchanges nothing."""
    inner = comm.inner if isinstance(comm, Coalescer) else comm
    return not isinstance(inner, ReplicaCommunicator) and inner.world_size > 1


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def agree(comm, topic: str, fields: Sequence[tuple[str, object]], *, what: str, fix: str = "") -> None:
    """Exchange this rank's ``fields`` (name, value pairs whose ``repr`` is stable across processes) for
    ``topic`` with every rank of ``comm`` and raise :class:`CollectiveMismatchError` on every rank, naming
    each field that differs and each rank's value, if any rank's differ (see the module docstring). A
    collective: every rank calls it at the same point. ``fix``: what to do about a mismatch, appended to
    the message."""
    if not exchanging(comm):
        return
    ws = comm.world_size
    items = [(str(n), _text(v)) for n, v in fields]
    items += [("world size", str(ws)), ("torsh-kernels version", __version__)]
    hashes = [_hash(f"{n}={v}") for n, v in items]
    combined = _hash(topic + "\x00" + "\x00".join(f"{h:016x}" for h in hashes))
    show = SHOW
    while True:
        desc = json.dumps({"topic": topic, "fields": [[n, v[:show], f"{h:016x}"] for (n, v), h in zip(items, hashes)]},
                          ensure_ascii=True).encode()  # fmt: skip
        if len(desc) <= MAX_DESCRIPTION or show == 0:
            break
        show //= 4
    desc = desc[:MAX_DESCRIPTION]
    dev = comm.device
    row = torch.tensor([_MARKER, _hash(topic), combined, len(desc), ws, len(items), 0, 0], dtype=torch.int64)
    row = row.to(dev)
    table = torch.empty(ws * SLOTS, dtype=torch.int64, device=dev)
    comm.all_gather(table, row)
    rows = table.view(ws, SLOTS).tolist()
    if all(r == rows[0] for r in rows):
        return
    strangers = [r for r, v in enumerate(rows) if v[0] != _MARKER or not 0 < v[3] <= MAX_DESCRIPTION]
    if strangers:
        raise CollectiveMismatchError(
            f"{what}: {_ranks(strangers)} issued another collective where rank {comm.rank} exchanged the signature "
            f"of {topic}: the ranks' sequences of collectives had diverged before this point (a checkpoint loaded "
            "or a compressor switched on some ranks only, a different code path); make every rank issue the same "
            "calls in the same order"
        )
    longest = max(v[3] for v in rows)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(desc)] = torch.frombuffer(bytearray(desc), dtype=torch.uint8)
    gathered = torch.empty(ws * longest, dtype=torch.uint8, device=dev)
    comm.all_gather(gathered, buf.to(dev))
    raw = gathered.cpu().numpy().tobytes()
    descs = []
    for r, v in enumerate(rows):
        try:
            descs.append(json.loads(raw[r * longest : r * longest + v[3]]))
        except ValueError:
            descs.append({"topic": "?", "fields": []})
    raise CollectiveMismatchError(message(what, descs, fix))


def layout(tensors: Sequence[torch.Tensor], count: str = "tensors") -> list[tuple[str, object]]:
    """The fields that fix the collectives of ``tensors``: how many (named ``count``), their element count,
    shapes and dtypes."""
    return [
        (count, len(tensors)),
        ("numel", sum(t.numel() for t in tensors)),
        ("shapes", [tuple(t.shape) for t in tensors]),
        ("dtypes", [str(t.dtype).replace("torch.", "") for t in tensors]),
    ]


def fields_of(
    specs: Mapping[str, object] | None = None,
    tensors: Sequence[torch.Tensor] | None = None,
    extra: Sequence[tuple[str, object]] = (),
    count: str = "tensors",
) -> list[tuple[str, object]]:
    """The fields of one exchange, in one shape for every layer: each spec's signature (a
    :class:`~torsh_kernels.specs.Spec` or a compressor: ``signature_fields(prefix)``, nested fields named by
    path), then the tensors' :func:`layout`, then ``extra`` (values of this call that are neither: an
    iteration count, a state's age)."""
    out: list[tuple[str, object]] = []
    for prefix, spec in (specs or {}).items():
        out += spec.signature_fields(prefix)
    if tensors is not None:
        out += layout(tensors, count)
    return out + list(extra)


def agree_on(
    comm,
    topic: str,
    *,
    specs: Mapping[str, object] | None = None,
    tensors: Sequence[torch.Tensor] | None = None,
    extra: Sequence[tuple[str, object]] = (),
    count: str = "tensors",
    what: str,
    fix: str = "",
) -> None:
    """:func:`agree` on :func:`fields_of` ``(specs, tensors, extra)``: what the DDP hook's engine, the
    synchronizer, FSDP2's comms, the MoE layers and ``compressed_all_reduce`` call, so that no layer lists a
    spec's fields by hand."""
    agree(comm, topic, fields_of(specs, tensors, extra, count), what=what, fix=fix)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _by_value(values: Sequence[tuple[str, str] | None]) -> str:
    """'x on rank 0, y on ranks 1, 2': each distinct value (by hash) with the ranks that hold it."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for r, v in enumerate(values):
        shown, h = v if v is not None else ("(absent)", "")
        groups.setdefault(h, (shown, []))[1].append(r)
    parts = []
    shown_values = [s for s, _ in groups.values()]
    for shown, ranks in groups.values():
        if shown_values.count(shown) > 1:  # equal as shown: the difference lies beyond what is shown
            shown += " (differs further on)"
        parts.append(f"{shown} on {_ranks(ranks)}")
    return ", ".join(parts)


def message(what: str, descs: Sequence[dict], fix: str = "") -> str:
    """The mismatch message every rank builds from the gathered descriptions (the same on every rank)."""
    topics = [d.get("topic", "?") for d in descs]
    if len(set(topics)) > 1:
        body = "they are at different points: " + _by_value([(t, t) for t in topics])
    else:
        per = [{f[0]: (f[1], f[2]) for f in d.get("fields", []) if isinstance(f, list) and len(f) == 3} for d in descs]
        names = list(dict.fromkeys(n for p in per for n in p))
        diffs, differ = [], set()
        for n in names:
            vals = [p.get(n) for p in per]
            if len({v[1] if v is not None else None for v in vals}) > 1:
                differ.add(n)
                if n.rpartition(".")[0] not in differ:  # "x.y" is not named where "x" itself differs
                    diffs.append(f"{n}: {_by_value(vals)}")
        body = "they differ in " + ("; ".join(diffs) if diffs else "(no field: the descriptions are equal)")
    tail = f" {fix}" if fix else ""
    return (
        f"{what}: the ranks were about to issue different collectives for {topics[0]} ({body}); nothing was sent, "
        f"the group is still usable.{tail}"
    )


# -- remembering what was agreed ---------------------------------------------------------------------------

_LOCK = threading.Lock()
_AGREED: dict[int, tuple[object, OrderedDict]] = {}


def _anchor(comm: object) -> object:
    """What identifies ``comm``'s group across the communicator objects made for it: the process group of
    a TorchCommunicator (one is made per call where a ProcessGroup is passed), else the object itself."""
    if isinstance(comm, Coalescer):
        comm = comm.inner
    if isinstance(comm, TorchCommunicator):
        return comm.group if comm.group is not None else dist.group.WORLD
    return comm


def agree_once(comm, key: object, topic: str, fields: Callable[[], Sequence[tuple[str, object]]], *, what: str,
               fix: str = "") -> bool:  # fmt: skip
    """:func:`agree` unless ``comm``'s ranks agreed on ``key`` (hashable, the same on every rank for the
    same settings) before; ``fields()`` is called only when exchanging. Returns whether it exchanged."""
    if not exchanging(comm):
        return False
    anchor = _anchor(comm)
    with _LOCK:
        entry = _AGREED.get(id(anchor))
        if entry is None or entry[0] is not anchor:
            entry = _AGREED[id(anchor)] = (anchor, OrderedDict())  # the anchor is kept: its id stays unique
        seen = entry[1]
        if key in seen:
            seen.move_to_end(key)
            return False
    agree(comm, topic, fields(), what=what, fix=fix)
    with _LOCK:
        seen[key] = None
        while len(seen) > MAX_KEYS:
            seen.popitem(last=False)
    return True


_MET: dict[tuple, int] = {}  # (topic, group ranks) -> rendezvous made, alike on every rank of a correct program


def _store():
    """The default process group's store (every group's ranks can reach it), or None."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)  # private in torch 2.13
    try:
        return get() if get is not None else None
    except Exception:  # no default group (a communicator over another transport)
        return None


def rendezvous(comm, topic: str, *, what: str, fix: str = "", timeout: float | None = None) -> None:
    """Wait until every rank of ``comm`` (a :class:`~torsh_kernels.collectives.TorchCommunicator`) reached this
    call for ``topic``, through the process group's store, without a collective. Made before a setup step's
    first exchange (:func:`apply_quantized_comm`'s): a rank that runs other code at this point issues its
    own collective, and an exchange's small all-gather meeting a data all-gather of another size aborts the
    process in gloo. Here the ranks that came raise :class:`CollectiveTimeoutError` naming those that did
    not, after ``timeout`` seconds (None: the store's own, the process group's timeout), and nothing has
    gone on the wire. Nothing happens on one rank or where no store is reachable."""
    if not isinstance(comm, TorchCommunicator) or not exchanging(comm):
        return
    store = _store()
    if store is None:
        return
    group = comm.group if comm.group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    with _LOCK:
        n = _MET.get((topic, ranks), 0)
        _MET[(topic, ranks)] = n + 1
    prefix = f"torsh/rendezvous/{_hash(topic):016x}/{'-'.join(map(str, ranks))}/{n}/"
    keys = [prefix + str(r) for r in range(len(ranks))]
    wait = datetime.timedelta(seconds=timeout) if timeout is not None else store.timeout
    store.set(keys[comm.rank], b"1")
    try:
        store.wait(keys, wait)
    except Exception as e:  # the store's timeout (DistStoreError, RuntimeError on older torch)
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return  # everyone arrived as the wait gave up
        came = [r for r in range(len(ranks)) if r not in missing]
        raise CollectiveTimeoutError(
            f"{what}: {_ranks(missing)} did not reach {topic} within {wait.total_seconds():g} s, where "
            f"{_ranks(came)} did: they run other code at this point (e.g. the call made on some ranks only) or "
            f"are that much slower; nothing was sent. {fix}".rstrip()
        ) from e
