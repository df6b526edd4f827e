"""Numba CUDA kernels of the bucket op family (see ``providers.py``).

Imported on first use of the numba provider, so that importing torsh_kernels does not import Numba.
Kernels are built per dtype combination: Numba specialises them on the load/store helpers they close
over. ``cuda`` must be a module global: the simulator swaps it for its fake module while a kernel runs.
"""

from __future__ import annotations

import math
from functools import cache

import torch
from numba import cuda, float32

from .. import numba_common as nb


@cuda.jit(device=True, inline=True)
def tile_span(table, tile_map, tile_elems):
    """(row, tensor address, flat offset, this thread's first index, end index) for this block."""
    blk = cuda.blockIdx.x
    r = tile_map[blk]
    start = (blk - table[r, 3]) * tile_elems
    end = start + tile_elems
    if end > table[r, 1]:
        end = table[r, 1]
    return r, table[r, 0], table[r, 2], start + cuda.threadIdx.x, end


@cuda.jit(device=True, inline=True)
def element_offset(table, r, i):
    """Element offset (from the tensor's address) of linear index i of table row r."""
    if table[r, 4] != 0:
        return i
    i3 = i % table[r, 7]
    q = i // table[r, 7]
    i2 = q % table[r, 6]
    q = q // table[r, 6]
    i1 = q % table[r, 5]
    i0 = q // table[r, 5]
    return i0 * table[r, 8] + i1 * table[r, 9] + i2 * table[r, 10] + i3 * table[r, 11]


@cache
def flatten_kernel(src: torch.dtype, dst: torch.dtype):

    compute = nb.compute_kind(src, dst)
    load, store, ctype = nb.loader(src, compute), nb.storer(dst), nb.compute_type(compute)

    @cuda.jit
    def kernel(table, tile_map, base, out, scale, tile_elems):
        r, addr, flat_off, i, end = tile_span(table, tile_map, tile_elems)
        s = ctype(scale)
        while i < end:
            off = element_offset(table, r, i)
            store(out, flat_off + i, load(base, addr + off) * s)
            i += cuda.blockDim.x

    return kernel


@cache
def unflatten_kernel(flat: torch.dtype, dst: torch.dtype):

    compute = nb.compute_kind(flat, dst)
    load_flat, load_dst = nb.loader(flat, compute), nb.loader(dst, compute)
    store, ctype = nb.storer(dst), nb.compute_type(compute)

    @cuda.jit
    def kernel(table, tile_map, base, flat_arr, scale, accumulate, tile_elems):
        r, addr, flat_off, i, end = tile_span(table, tile_map, tile_elems)
        s = ctype(scale)
        while i < end:
            off = element_offset(table, r, i)
            v = load_flat(flat_arr, flat_off + i) * s
            if accumulate:
                v = load_dst(base, addr + off) + v
            store(base, addr + off, v)
            i += cuda.blockDim.x

    return kernel


@cache
def reduce_kernel(src: torch.dtype, dst: torch.dtype, op: int):

    compute = nb.compute_kind(src, dst)
    load, store, ctype = nb.loader(src, compute), nb.storer(dst), nb.compute_type(compute)

    @cuda.jit
    def kernel(offsets, base, out, numel, tile_elems):
        start = cuda.blockIdx.x * tile_elems
        end = start + tile_elems
        if end > numel:
            end = numel
        k_count = offsets.shape[0]
        i = start + cuda.threadIdx.x
        while i < end:
            acc = load(base, offsets[0] + i)
            for k in range(1, k_count):
                x = load(base, offsets[k] + i)
                if op == 2:
                    if math.isnan(x) or x > acc:
                        acc = x
                else:
                    acc = acc + x
            if op == 1:
                acc = acc / ctype(k_count)
            store(out, i, acc)
            i += cuda.blockDim.x

    return kernel


@cache
def wire_cast_kernel(src: torch.dtype, dst: torch.dtype):
    """out = dtype(dtype(x) / divisor), in fp32: the value stored once, read back rounded, divided and
    stored again; counts the NaN/Inf it writes."""
    load, store, load_out = nb.loader(src, "f32"), nb.storer(dst), nb.loader(dst, "f32")

    @cuda.jit
    def kernel(x, out, bad, n, divisor, divide):
        d = float32(divisor)
        start = cuda.blockIdx.x * nb.TILE
        end = start + nb.TILE
        if end > n:
            end = n
        nbad = 0
        i = start + cuda.threadIdx.x
        while i < end:
            store(out, i, load(x, i))
            if divide:
                store(out, i, load_out(out, i) / d)
            if nb.nonfinite(load_out(out, i)):
                nbad += 1
            i += cuda.blockDim.x
        if nbad:
            cuda.atomic.add(bad, 0, nbad)

    return kernel
