"""Launch tables of the bucket kernels: how one Triton or Numba launch sees N tensors of any layout.

Numba: a table in device memory holds, per tensor, its address (Numba: its element offset from the lowest
address, see ``numba_common.py``), size, offset in the flat buffer, first tile and (for non-contiguous tensors)
up to ``MAX_DIMS`` coalesced sizes and strides; a second table maps each tile (program) to its tensor, in
the manner of Triton's grouped-GEMM tutorial. Tables are cached per (device, stream, geometry,
addresses), so steady-state training steps do not rebuild or re-upload them. Also here: the grouping of
tensors into launches (one per dtype; for Numba also per address alignment) and the stand-ins for
tensors whose strides need more than ``MAX_DIMS`` dimensions.

Triton: a copy plan (:func:`copy_plan`, cached the same way, with the flat buffer's address modulo 16) splits
each dtype group into at most three launches, each a constexpr variant of its kernel (``triton.py``):

- ``segments``, both sides aligned: element ranges of contiguous tensors that start where the source and the
  destination address are both 16-byte aligned and whose length is a multiple of 16 elements; the kernel
  states that (``tl.multiple_of``), so every access is 128-bit;
- ``segments``, one side aligned: the same for tensors whose source and destination disagree modulo 16 bytes
  (e.g. every tensor after an odd-sized one), aligned on the side that moves more bytes: 128-bit accesses
  there, on the other as wide as the alignment all its segments share (64-bit at an 8-byte shift);
- ``gather``: the rest, with the strided index math: strided tensors (the tensor's side strided, the flat
  side contiguous), and as 1-D rows the heads and tails (< 16 elements) of the contiguous tensors and the
  contiguous tensors that fit in one gather tile; 32-bit index math unless a row's extent needs 64, and only
  as many dimensions as its rows need.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..common import cached_table, stream_key

MAX_DIMS = 4
NCOLS = 12  # table columns: addr, numel, flat_off, first_tile, contig, size1..3, stride0..3


def _geometry(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """(contiguous flag, 4 sizes, 4 strides) after dropping size-1 dims and merging adjacent dims;
    None if more than MAX_DIMS dims remain."""
    dims: list[list[int]] = []
    for s, st in zip(t.shape, t.stride()):
        if s == 1:
            continue
        if dims and dims[-1][1] == s * st:
            dims[-1][0] *= s
            dims[-1][1] = st
        else:
            dims.append([s, st])
    if not dims:
        dims = [[1, 1]]
    if len(dims) > MAX_DIMS:
        return None
    contig = int(len(dims) == 1 and dims[0][1] == 1)
    pad = [[1, 0]] * (MAX_DIMS - len(dims))
    dims = pad + dims
    return contig, tuple(d[0] for d in dims), tuple(d[1] for d in dims)


def _rows(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int], addrs: Sequence[int], tile: int
) -> tuple[list[tuple[int, ...]], list[int]]:
    rows, tiles = [], []
    first = 0
    for t, off, addr in zip(tensors, offsets, addrs):
        n = t.numel()
        g = _geometry(t)
        assert g is not None  # callers replace tensors of more than MAX_DIMS dims first
        contig, sizes, strides = g
        rows.append((addr, n, off, first, contig, sizes[1], sizes[2], sizes[3], *strides))
        k = -(-n // tile)
        tiles.append(k)
        first += k
    return rows, tiles


def launch_tables(
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    addrs: Sequence[int],
    tile: int,
    device: torch.device,
    tag: str,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tensor table [R, NCOLS] int64, tile -> row map [n_tiles] int32, n_tiles) on ``device``.

    Cached under a key of addresses, shapes, strides and offsets, which determine the tables' contents
    entirely, so a hit is always correct and steady-state steps skip the per-tensor geometry work and
    the upload. The stream is in the key, so a table is only used on the stream that uploaded it.
    """
    key = (
        tag, device, stream_key(device), tile, tuple(addrs), tuple(t.shape for t in tensors),
        tuple(t.stride() for t in tensors), tuple(offsets),
    )  # fmt: skip

    def build() -> tuple[torch.Tensor, torch.Tensor, int]:
        rows, tiles = _rows(tensors, offsets, addrs, tile)
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), NCOLS)
        tile_map = torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int32), tiles))
        if device.type == "cuda":
            table, tile_map = table.to(device), tile_map.to(device)
        return table, tile_map, int(sum(tiles))

    return cached_table(key, build)


def by_dtype(tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
    """Non-empty tensors grouped by dtype, with their flat offsets: one launch per group."""
    if len({t.dtype for t in tensors}) == 1 and all(t.numel() for t in tensors):
        return [(tensors[0].dtype, (tensors, offsets))]
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
    for t, off in zip(tensors, offsets):
        if t.numel():
            g = groups.setdefault(t.dtype, ([], []))
            g[0].append(t)
            g[1].append(off)
    return list(groups.items())


def readable(t: torch.Tensor) -> torch.Tensor:
    """A tensor the kernels can read: itself, or a contiguous copy if its strides need > MAX_DIMS dims."""
    return t if t.is_contiguous() or _geometry(t) is not None else t.contiguous()


class Writable:
    """Destinations the kernels can write: each tensor, or a contiguous stand-in copied back after."""

    def __init__(self, tensors: Sequence[torch.Tensor], accumulate: bool) -> None:
        self.pairs = []
        self.targets = []
        for t in tensors:
            if not t.is_contiguous() and t.numel() and _geometry(t) is None:
                tmp = t.contiguous() if accumulate else torch.empty_like(t, memory_format=torch.contiguous_format)
                self.pairs.append((t, tmp))
                self.targets.append(tmp)
            else:
                self.targets.append(t)

    def finish(self) -> None:
        for t, tmp in self.pairs:
            t.copy_(tmp)


def scale_bits(scale: float) -> int:
    """The fp64 bit pattern of ``scale`` as a signed int64; kernels bitcast it back, so fp64 compute
    gets the exact scale and fp32 compute rounds it once, as PyTorch does for a Python scalar."""
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def numba_groups(tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
    """Like by_dtype, but also split by address modulo the element size, so every tensor of a group
    sits a whole number of elements from the group's lowest address."""
    out: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}
    for dtype, (ts, offs) in by_dtype(tensors, offsets):
        for t, off in zip(ts, offs):
            g = out.setdefault((dtype, t.data_ptr() % t.element_size()), ([], []))
            g[0].append(t)
            g[1].append(off)
    return out.values()


# --------------------------------------------------------------------------------------------------
# Triton copy plans (flatten / unflatten)

GEN_COLS = 12  # gather rows: tensor address, flat offset, numel, first tile, size1..3, stride0..3, dims
VEC = 16  # bytes of a 128-bit access; an aligned segment's length is a multiple of this many elements
N_SHIFT = 48  # a segment tile row: (tensor address, flat offset | count << N_SHIFT)
_I32 = 1 << 31


@dataclass(frozen=True, slots=True)
class Launch:
    """One launch of a copy plan: its kernel, its table (and tile -> row map for ``gather``), grid, constexprs."""

    kernel: str
    """``segments`` or ``gather``."""
    rows: torch.Tensor
    tiles: torch.Tensor | None
    n_tiles: int
    meta: dict


def _aligned_start(n: int, sides: Sequence[tuple[int, int]]) -> int | None:
    """The first element index (< 16) at which every (address, element size) side is 16-byte aligned."""
    for a in range(min(VEC, n)):
        if all((p + a * s) % VEC == 0 for p, s in sides):
            return a
    return None


def _piece(taddr: int, foff: int, n: int) -> tuple[int, ...]:
    """A contiguous piece as a gather row: one dimension of n elements, stride 1."""
    return (taddr, foff, n, 0, 1, 1, n, 0, 0, 0, 1, 1)


def _alignment(p: int) -> int:
    """The largest power of two, up to 16, that divides the address ``p``."""
    return min(VEC, p & -p) if p else VEC


def _split(taddr, tsz, foff, fbase, fsz, n, prefer_tensor, both, half, gen) -> None:
    """A contiguous tensor's elements [0, n) as a segment (tensor address, flat offset, length: a multiple of
    16 elements starting where both sides, else the preferred side, are 16-byte aligned; and the other side's
    alignment there), its head and tail as gather pieces."""
    faddr = fbase + foff * fsz
    a = _aligned_start(n, ((taddr, tsz), (faddr, fsz)))
    out = both
    if a is None or n - a < VEC:
        a = _aligned_start(n, ((taddr, tsz),) if prefer_tensor else ((faddr, fsz),))
        out = half
    end = a + (n - a) // VEC * VEC if a is not None and n - a >= VEC else 0
    for lo, hi in ((0, a), (end, n)) if end else ((0, n),):
        if hi > lo:
            gen.append(_piece(taddr + lo * tsz, foff + lo, hi - lo))
    if end:
        t, f = taddr + a * tsz, faddr + a * fsz
        out.append((t, foff + a, end - a, _alignment(f if prefer_tensor else t)))


def _segment_tiles(segs: list[tuple[int, ...]], block: int, tsz: int) -> np.ndarray:
    """One row per tile of ``block`` elements: (tensor address, flat offset | count << N_SHIFT)."""
    arr = np.array([sg[:3] for sg in segs], dtype=np.int64)
    per = -(-arr[:, 2] // block)
    seg = np.repeat(np.arange(len(segs)), per)
    t = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    count = np.minimum(block, arr[seg, 2] - t * block)
    return np.stack((arr[seg, 0] + t * (block * tsz), (arr[seg, 1] + t * block) | (count << N_SHIFT)), axis=1)


def _gather_tiles(rows: list[tuple[int, ...]], block: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows with their first tile filled in, tile -> row map)."""
    arr = np.array(rows, dtype=np.int64)
    per = -(-arr[:, 2] // block)
    arr[:, 3] = np.cumsum(per) - per
    return arr, np.repeat(np.arange(len(rows), dtype=np.int32), per)


def copy_plan(
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    flat: torch.Tensor,
    to_flat: bool,
    prefer_tensor: bool,
    seg_block: int,
    gen_block: int,
) -> list[Launch]:
    """The launches that copy one dtype group between ``tensors`` and their ``offsets`` in ``flat`` (into flat
    when ``to_flat``: flatten; out of it: unflatten), cached like :func:`launch_tables`. The rows hold flat offsets,
    not addresses, so only the flat buffer's address modulo 16 is in the key (a new buffer per step reuses the
    plan). ``prefer_tensor``: tensors whose two sides cannot both be aligned are aligned on the tensor's side
    (else the flat side). Empty variants are left out."""
    addrs = tuple(t.data_ptr() for t in tensors)
    device = flat.device
    key = (
        "copy", device, stream_key(device), to_flat, prefer_tensor, seg_block, gen_block, flat.data_ptr() % VEC,
        flat.element_size(), tensors[0].element_size(), addrs, tuple(t.shape for t in tensors),
        tuple(t.stride() for t in tensors), tuple(offsets),
    )  # fmt: skip
    return cached_table(
        key, lambda: _build(tensors, offsets, addrs, flat, to_flat, prefer_tensor, seg_block, gen_block)
    )


def _build(tensors, offsets, addrs, flat, to_flat, prefer_tensor, seg_block, gen_block) -> list[Launch]:
    tsz, fsz, fbase = tensors[0].element_size(), flat.element_size(), flat.data_ptr() % VEC
    both: list = []
    half: list = []
    gen: list = []
    extent = 0
    for t, off, addr in zip(tensors, offsets, addrs):
        n = t.numel()
        g = _geometry(t)
        assert g is not None  # callers replace tensors of more than MAX_DIMS dims first
        contig, sizes, strides = g
        if contig and n > gen_block:
            _split(addr, tsz, off, fbase, fsz, n, prefer_tensor, both, half, gen)
        elif contig:  # fits one gather tile: one program, rather than a segment and up to two pieces
            gen.append(_piece(addr, off, n))
        else:
            gen.append((addr, off, n, 0, *sizes[1:], *strides, sum(1 for s in sizes if s > 1) or 1))
            extent = max(extent, 1 + sum((s - 1) * st for s, st in zip(sizes, strides)))
    seg = {"BLOCK": seg_block, "TO_FLAT": to_flat}
    parts = []  # (kernel, rows, tile map, meta)
    if both:
        parts.append(("segments", _segment_tiles(both, seg_block, tsz), None,
                      {**seg, "ALIGN_TENSOR": VEC, "ALIGN_FLAT": VEC}))  # fmt: skip
    if half:  # the other side at the alignment every segment has (all shifted alike after an odd size: 8 often)
        other = min(sg[3] for sg in half)
        parts.append(("segments", _segment_tiles(half, seg_block, tsz), None,
                      {**seg, "ALIGN_TENSOR": VEC if prefer_tensor else other,
                       "ALIGN_FLAT": other if prefer_tensor else VEC}))  # fmt: skip
    if gen:
        idx64 = max(extent, max(r[2] for r in gen)) >= _I32  # (the elements of a row, the span of its strides)
        block = gen_block // 4 if idx64 else gen_block  # (64-bit divisions: one element a thread, <= 64 registers)
        rows, tmap = _gather_tiles(gen, block)
        parts.append(("gather", rows, tmap, {"BLOCK": block, "NDIM": int(rows[:, 11].max()), "IDX64": idx64,
                                             "TO_FLAT": to_flat}))  # fmt: skip
    # one host buffer, one upload: every variant's rows (a segment tile row is 16 bytes, read as one 128-bit
    # load: each part starts at an even int64 offset), then the gather tile map (int32, padded to 8 bytes)
    chunks = [r.reshape(-1) for _, r, _, _ in parts]
    chunks += [
        np.concatenate((m, np.zeros(len(m) % 2, np.int32))).view(np.int64) for _, _, m, _ in parts if m is not None
    ]
    buf = torch.from_numpy(np.concatenate(chunks))
    if flat.device.type == "cuda":
        buf = buf.to(flat.device)
    out, pos = [], 0
    map_pos = sum(c.size for c in chunks[: len(parts)])
    for kernel, rows, tmap, meta in parts:
        view = buf[pos : pos + rows.size].view(rows.shape)
        pos += rows.size
        if tmap is None:
            out.append(Launch(kernel, view, None, len(rows), meta))
        else:
            tiles = buf[map_pos:].view(torch.int32)[: len(tmap)]
            out.append(Launch(kernel, view, tiles, len(tmap), meta))
    return out
