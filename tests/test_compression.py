"""Compressor objects: the shared contract, error feedback over steps, bit-exact state round trips."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import DEVICE, rand

from torsh_kernels.compression import (
    BF16,
    FP16,
    CompressionState,
    NoCompression,
    Payload,
    PowerSGD,
    Quantize,
    Sign,
    TopK,
    matrix_shape,
    roundtrip,
)
from torsh_kernels.errors import InvalidArgumentError, NonFiniteError, ShapeError

COMPRESSORS = [
    pytest.param(lambda p: NoCompression(provider=p), 0.0, id="none"),
    pytest.param(lambda p: FP16(provider=p), 1e-3, id="fp16"),
    pytest.param(lambda p: BF16(provider=p), 8e-3, id="bf16"),
    pytest.param(lambda p: TopK(0.05, provider=p), None, id="topk"),
    pytest.param(lambda p: Quantize(8, 64, provider=p), 1e-2, id="int8"),
    pytest.param(lambda p: Quantize(4, 32, True, provider=p), 0.3, id="int4-stochastic"),
    pytest.param(lambda p: Sign(provider=p), None, id="sign"),
    pytest.param(lambda p: PowerSGD(2, provider=p), None, id="powersgd"),
]


@pytest.mark.parametrize("make,rel_err", COMPRESSORS)
def test_roundtrip_contract(provider, gen, make, rel_err):
    c = make(provider)
    x = rand((48, 37), torch.float32, gen)
    state = c.new_state()
    keep = x.clone()
    out, payloads = roundtrip(c, x, state)
    assert torch.equal(x, keep), "the input is not modified"
    payload = payloads[-1]
    assert isinstance(payload, Payload) and payload.final and payload.numel == x.numel()
    assert sum(p.nbytes for p in payloads) == c.payload_nbytes(tuple(x.shape))
    assert out.shape == x.shape and torch.isfinite(out).all()
    err = ((out - x).norm() / x.norm()).item()
    if rel_err is not None:
        assert err <= rel_err, err
    else:
        assert err < 1.0  # lossy, but it points the right way
    assert state.step == 1


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: TopK(0.02, provider=p), id="topk"),
        pytest.param(lambda p: Quantize(4, 64, provider=p), id="int4"),
        pytest.param(lambda p: Quantize(8, 64, True, provider=p), id="int8-stochastic"),
        pytest.param(lambda p: Sign(provider=p), id="sign"),
        pytest.param(lambda p: PowerSGD(1, provider=p), id="powersgd"),
    ],
)
def test_error_feedback_loses_nothing_over_steps(provider, gen, make):
    """Sum of what was delivered over the steps + the final residual == sum of the inputs."""
    c = make(provider)
    state = c.new_state()
    n = (40, 25)
    delivered = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    total = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    for _ in range(4):
        x = rand(n, torch.float32, gen)
        total += x.double()
        out, _ = roundtrip(c, x, state)
        delivered += out.double()
    residual = state.tensors["residual"].view(n).double()
    torch.testing.assert_close(delivered + residual, total, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: TopK(0.1), id="topk"),
        pytest.param(lambda: Quantize(8, 32, True), id="int8-stochastic"),
        pytest.param(lambda: Sign(), id="sign"),
        pytest.param(lambda: PowerSGD(2, warm_start=True), id="powersgd-warm"),
        pytest.param(lambda: PowerSGD(2, warm_start=False), id="powersgd-cold"),
    ],
)
def test_state_dict_round_trip_is_bit_exact(gen, make):
    """Three steps, checkpoint, two more: a state restored from the checkpoint (also through pickle)
    replays the two steps bit for bit."""
    c = make()
    xs = [rand((30, 20), torch.float32, gen) for _ in range(5)]
    state = c.new_state(seed=7)
    for x in xs[:3]:
        roundtrip(c, x, state)
    sd = pickle.loads(pickle.dumps(state.state_dict()))
    after_a = [roundtrip(c, x, state)[0] for x in xs[3:]]
    restored = c.new_state()
    restored.load_state_dict(sd)
    after_b = [roundtrip(c, x, restored)[0] for x in xs[3:]]
    for a, b in zip(after_a, after_b):
        assert torch.equal(a, b)
    for k, v in state.tensors.items():
        assert torch.equal(v, restored.tensors[k])
    assert restored.step == state.step == 5


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


def test_flat_tensors_use_a_near_square_matrix():
    assert matrix_shape(torch.empty(1000)) == (32, 32)
    assert matrix_shape(torch.empty(10, 3, 3)) == (10, 9)
    assert matrix_shape(torch.empty(1, 50)) == (8, 7)


def test_topk_decompress_sum_equals_sum_of_decompressions(gen):
    c = TopK(0.1)
    payloads = []
    states = [c.new_state() for _ in range(3)]
    for s in states:
        payloads.append(c.compress(rand(500, torch.float32, gen), s))
    out = torch.full((500,), float("nan"), device=DEVICE)
    c.decompress_sum(payloads, states[0], out, alpha=1 / 3)
    ref = sum(c.decompress(p, states[0], torch.empty(500, device=DEVICE)) for p in payloads) / 3
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    q = Quantize(8, 64)
    qp = [q.compress(rand(500, torch.float32, gen), q.new_state()) for _ in range(2)]
    out2 = q.decompress_sum(qp, None, torch.empty(500, device=DEVICE), alpha=0.5)
    ref2 = (
        q.decompress(qp[0], None, torch.empty(500, device=DEVICE))
        + q.decompress(qp[1], None, torch.empty(500, device=DEVICE))
    ) * 0.5
    torch.testing.assert_close(out2, ref2, atol=1e-6, rtol=1e-6)


def test_nonfinite_gradients_raise_before_the_state_changes(gen):
    x = rand(300, torch.float32, gen)
    x[17] = float("nan")
    for c in (TopK(0.1), Quantize(8), Sign(), PowerSGD(1), FP16(), NoCompression()):
        state = c.new_state()
        roundtrip(c, rand(300, torch.float32, gen), state)
        before = state.state_dict()
        with pytest.raises(NonFiniteError):
            c.compress(x, state)
        after = state.state_dict()
        assert after["step"] == before["step"]
        for k, v in before["tensors"].items():
            assert torch.equal(v, after["tensors"][k]), (type(c).__name__, k)
    big = torch.full((10,), 1e6, device=DEVICE)  # overflows fp16
    with pytest.raises(NonFiniteError):
        FP16().compress(big, CompressionState())


def test_configuration_errors(gen):
    for bad in (0, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            TopK(bad)
    with pytest.raises(InvalidArgumentError):
        Quantize(bits=5)
    with pytest.raises(InvalidArgumentError):
        Quantize(block=100)
    with pytest.raises(InvalidArgumentError):
        PowerSGD(rank=0)
    with pytest.raises(InvalidArgumentError):
        PowerSGD(1, start_iter=-1)
    c = TopK(0.1)
    state = c.new_state()
    c.compress(rand(100, torch.float32, gen), state)
    with pytest.raises(ShapeError, match="one state per bucket"):
        c.compress(rand(101, torch.float32, gen), state)
    with pytest.raises(InvalidArgumentError):
        c.advance(Payload({}, 1), state)
    with pytest.raises(InvalidArgumentError):
        CompressionState().load_state_dict({"step": 1})
