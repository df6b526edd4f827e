"""PowerSGD on one process: warm-up, the size rule, rank recovery, the matrix view, its wire rounds."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEVICE, rand
from torsh_kernels.compression import PowerSGD, matrix_shape, roundtrip
from torsh_kernels.errors import NonFiniteError
from torsh_kernels.ops import orthogonalize


def test_powersgd_start_iter_and_min_compression_rate(gen):
    c = PowerSGD(2, start_iter=2)
    state = c.new_state()
    x = rand((64, 64), torch.float32, gen)
    for _ in range(2):  # warm-up: uncompressed, exact, no residual
        out, (p,) = roundtrip(c, x, state)
        assert torch.equal(out, x) and p.nbytes == 4 * x.numel() and "residual" not in state.tensors
    p = c.compress(x, state)
    assert not p.final and p.tensors["p"].shape == (64, 2)
    q = c.advance(p, state)
    assert q.final and q.tensors["q"].shape == (64, 2)
    p_mat = state.work["p"]
    torch.testing.assert_close(p_mat.T @ p_mat, torch.eye(2, device=DEVICE), atol=1e-5, rtol=0)
    small = PowerSGD(4, min_compression_rate=2.0)
    y = rand((6, 5), torch.float32, gen)  # 30 elements vs (6 + 5) * 4 = 44: not worth compressing
    out, (p,) = roundtrip(small, y, small.new_state())
    assert torch.equal(out, y) and "data" in p.tensors


def test_powersgd_rank_recovers_low_rank_matrices(gen):
    a, b = rand((50, 3), torch.float32, gen), rand((3, 40), torch.float32, gen)
    x = a @ b
    c = PowerSGD(3)
    state = c.new_state()
    for _ in range(3):  # power iterations with warm start converge on an exactly rank-3 matrix
        out, _ = roundtrip(c, x, state)
        state.tensors["residual"].zero_()
    assert ((out - x).norm() / x.norm()).item() < 1e-4


def test_flat_tensors_use_a_near_square_matrix_and_others_shape0_by_rest():
    assert matrix_shape(torch.empty(1000)) == (32, 32)
    assert matrix_shape(torch.empty(10, 3, 3)) == (10, 9)
    # as PyTorch's powerSGD_hook (tensor.view(shape[0], -1)), whatever the sizes
    assert matrix_shape(torch.empty(1, 50)) == (1, 50)
    assert matrix_shape(torch.empty(50, 1)) == (50, 1)
    assert matrix_shape(torch.empty(7, 1, 1)) == (7, 1)
    assert matrix_shape(torch.empty(0, 5)) == (1, 1)  # empty: the flat view


def test_rank_one_of_a_column_or_a_row_is_exact(gen):
    # the [shape[0], rest] view of an [n, 1] or [1, n] tensor has rank 1: one PowerSGD step recovers it
    for shape in ((37, 1), (1, 41)):
        x = torch.randn(shape, generator=gen)
        c = PowerSGD(1, min_compression_rate=0.0)
        out, payloads = roundtrip(c, x, c.new_state())
        assert len(payloads) == 2  # P then Q: it was compressed
        torch.testing.assert_close(out, x, atol=1e-5, rtol=1e-5)


def test_schemes_are_the_p_and_q_all_reduces():
    (p, q) = PowerSGD(4).schemes((1000, 2000), torch.float32, 2)["all_reduce"]
    assert (p.collective, p.nbytes, q.collective, q.nbytes) == ("all_reduce", 16_000, "all_reduce", 32_000)
    (plain,) = PowerSGD(4).schemes((6, 5), torch.float32, 2)["all_reduce"]  # not worth compressing
    assert plain.nbytes == 4 * 30
    assert PowerSGD(4, start_iter=7, min_compression_rate=3.0).warmup() == (7, 3.0)
    c = PowerSGD(4, start_iter=7).per_tensor(1.5)
    assert (c.start_iter, c.min_compression_rate, c.rank) == (0, 1.5, 4)


def test_zero_columns_of_p_are_set_aside(gen):
    # a zero column of P stays zero and leaves the others as the full orthogonalisation makes them (dead
    # columns are common: with warm start a column that died stays dead); an all-zero P stays zero; tiny
    # columns give the same result; a NaN still raises
    c = PowerSGD(4)
    for dead in ([1, 2, 3], [0], [0, 2], [], [0, 1, 2, 3]):
        p = rand((97, 4), torch.float32, gen).cpu()
        p[:, dead] = 0
        full = orthogonalize(p.clone())
        mine = p.clone()
        c._orthogonalize(mine)
        torch.testing.assert_close(mine, full, atol=1e-6, rtol=0)
        assert not mine[:, dead].any()
        live = [j for j in range(4) if j not in dead]
        torch.testing.assert_close(mine[:, live].T @ mine[:, live], torch.eye(len(live)), atol=1e-5, rtol=0)
    for scale in (1e-25, 1e-40):  # vanishing columns (squares underflow in fp32): scaled up, same result
        p = rand((97, 4), torch.float32, gen).cpu() * scale
        p[:, 3] = 0
        mine = p.clone()
        c._orthogonalize(mine)
        torch.testing.assert_close(mine, orthogonalize(p.clone()), atol=1e-6, rtol=0)
        torch.testing.assert_close(mine[:, :3].T @ mine[:, :3], torch.eye(3), atol=1e-5, rtol=0)
    p = rand((97, 4), torch.float32, gen).cpu()
    p[:, 1] = 0
    p[5, 2] = float("nan")
    with pytest.raises(NonFiniteError):
        c._orthogonalize(p)


def test_decompress_into_fp32_gives_the_bits_of_the_general_path(gen):
    # an fp32 output without padding takes P Q^T straight into it and residual = M - it; any other output
    # (here fp16) goes through error_update from a separate buffer: the same values (rounded once into the
    # fp16 output) and the same residuals
    c = PowerSGD(2)
    for shape in ((37, 23), (6, 5, 8), (1000,)):  # 1-D: a padded near-square matrix, the general path
        a, b = c.new_state(seed=3), c.new_state(seed=3)
        for _ in range(3):
            x = rand(shape, torch.float32, gen)
            o32 = torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE)
            o16 = torch.full(shape, float("nan"), dtype=torch.float16, device=DEVICE)
            roundtrip(c, x, a, o32)
            roundtrip(c, x, b, o16)
            assert torch.equal(o16, o32.half())
            assert torch.equal(a.tensors["residual"], b.tensors["residual"])
        assert ("approx" in a.work) == (len(shape) == 1) and "approx" in b.work
