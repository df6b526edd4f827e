"""Launch tables of the bucket kernels: how one Triton or Numba launch sees N tensors of any layout.

A table in device memory holds, per tensor, its address (Numba: its element offset from the lowest
address, see ``_numba.py``), size, offset in the flat buffer, first tile and (for non-contiguous tensors)
up to ``MAX_DIMS`` coalesced sizes and strides; a second table maps each tile (program) to its tensor, in
the manner of Triton's grouped-GEMM tutorial. Tables are cached per (device, stream, geometry,
addresses), so steady-state training steps do not rebuild or re-upload them. Also here: the grouping of
tensors into launches (one per dtype; for Numba also per address alignment) and the stand-ins for
tensors whose strides need more than ``MAX_DIMS`` dimensions.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from ._common import _cached, _stream_key

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


def _tables(
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
        tag, device, _stream_key(device), tile, tuple(addrs), tuple(t.shape for t in tensors),
        tuple(t.stride() for t in tensors), tuple(offsets),
    )  # fmt: skip

    def build() -> tuple[torch.Tensor, torch.Tensor, int]:
        rows, tiles = _rows(tensors, offsets, addrs, tile)
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), NCOLS)
        tile_map = torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int32), tiles))
        if device.type == "cuda":
            table, tile_map = table.to(device), tile_map.to(device)
        return table, tile_map, int(sum(tiles))

    return _cached(key, build)


def _by_dtype(tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
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


def _readable(t: torch.Tensor) -> torch.Tensor:
    """A tensor the kernels can read: itself, or a contiguous copy if its strides need > MAX_DIMS dims."""
    return t if t.is_contiguous() or _geometry(t) is not None else t.contiguous()


class _Writable:
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


def _scale_bits(scale: float) -> int:
    """The fp64 bit pattern of ``scale`` as a signed int64; kernels bitcast it back, so fp64 compute
    gets the exact scale and fp32 compute rounds it once, as PyTorch does for a Python scalar."""
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def _numba_groups(tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
    """Like _by_dtype, but also split by address modulo the element size, so every tensor of a group
    sits a whole number of elements from the group's lowest address."""
    out: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}
    for dtype, (ts, offs) in _by_dtype(tensors, offsets):
        for t, off in zip(ts, offs):
            g = out.setdefault((dtype, t.data_ptr() % t.element_size()), ([], []))
            g[0].append(t)
            g[1].append(off)
    return out.values()
