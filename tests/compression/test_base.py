"""The Compressor contract every compressor keeps: round trips, error feedback over steps, bit-exact state
round trips, non-finite input, configuration errors; and what the bucket layer and the planner read."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.helpers import DEVICE, rand
from torsh_kernels.compression import (
    BF16,
    FP8,
    FP16,
    CompressionState,
    NoCompression,
    Payload,
    PowerSGD,
    Quantize,
    Sign,
    TopK,
    roundtrip,
)
from torsh_kernels.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, NonFiniteError, ShapeError

COMPRESSORS = [
    pytest.param(lambda p: NoCompression(provider=p), 0.0, id="none"),
    pytest.param(lambda p: FP16(provider=p), 1e-3, id="fp16"),
    pytest.param(lambda p: BF16(provider=p), 8e-3, id="bf16"),
    pytest.param(lambda p: TopK(0.05, provider=p), None, id="topk"),
    pytest.param(lambda p: Quantize(8, 64, provider=p), 1e-2, id="int8"),
    pytest.param(lambda p: Quantize(4, 32, True, provider=p), 0.3, id="int4-stochastic"),
    pytest.param(lambda p: FP8("e4m3", 64, provider=p), 0.04, id="fp8-e4m3"),
    pytest.param(lambda p: FP8("e5m2", 32, provider=p), 0.08, id="fp8-e5m2"),
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
        pytest.param(lambda p: FP8("e5m2", 64, provider=p), id="fp8-e5m2"),
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


NAN, INF = float("nan"), float("inf")
BAD_SETTINGS = [
    # (constructor, error): a wrong type is an ArgumentTypeError (a bool where a number or an int is asked
    # included), a value out of range, NaN or Inf an InvalidArgumentError
    *[(lambda v=v: TopK(v), InvalidArgumentError) for v in (0, -0.5, 1.5, NAN, INF, -INF)],
    *[(lambda v=v: TopK(v), ArgumentTypeError) for v in (True, "0.1", None, [0.1])],
    (lambda: TopK(0.1, exact=1), ArgumentTypeError),
    (lambda: TopK(0.1, error_feedback="yes"), ArgumentTypeError),
    (lambda: TopK(0.1, check_finite=None), ArgumentTypeError),
    (lambda: TopK(0.1, provider=3), ArgumentTypeError),
    (lambda: TopK(0.1, provider="cuda"), InvalidArgumentError),
    *[(lambda v=v: Quantize(bits=v), InvalidArgumentError) for v in (5, 0, -8, 16)],
    *[(lambda v=v: Quantize(bits=v), ArgumentTypeError) for v in (True, 8.0, "8")],
    *[(lambda v=v: Quantize(block=v), InvalidArgumentError) for v in (100, 1, 0, -256, 1 << 31)],
    *[(lambda v=v: Quantize(block=v), ArgumentTypeError) for v in (True, 256.0, NAN)],
    (lambda: Quantize(stochastic=1), ArgumentTypeError),
    (lambda: Quantize(provider="x"), InvalidArgumentError),
    (lambda: Sign(error_feedback=0), ArgumentTypeError),
    (lambda: Sign(provider=""), InvalidArgumentError),
    *[(lambda v=v: PowerSGD(rank=v), InvalidArgumentError) for v in (0, -1)],
    *[(lambda v=v: PowerSGD(rank=v), ArgumentTypeError) for v in (True, 2.0, None)],
    *[(lambda v=v: PowerSGD(1, start_iter=v), InvalidArgumentError) for v in (-1,)],
    *[(lambda v=v: PowerSGD(1, start_iter=v), ArgumentTypeError) for v in (False, 1.0, INF)],
    (lambda: PowerSGD(1, warm_start=1), ArgumentTypeError),
    *[(lambda v=v: PowerSGD(1, min_compression_rate=v), InvalidArgumentError) for v in (-1, NAN, INF)],
    *[(lambda v=v: PowerSGD(1, min_compression_rate=v), ArgumentTypeError) for v in (True, "2")],
    *[(lambda c=c: c(check_finite="no"), ArgumentTypeError) for c in (NoCompression, FP16, BF16)],
    *[(lambda c=c: c(provider="gpu"), InvalidArgumentError) for c in (NoCompression, FP16, BF16)],
    *[(lambda v=v: TopK(0.1).new_state(seed=v), ArgumentTypeError) for v in (1.5, True, "1", None)],
    (lambda: TopK(0.1).new_state(seed=1 << 63), InvalidArgumentError),
    (lambda: CompressionState(seed=2.0), ArgumentTypeError),
]


@pytest.mark.parametrize("i", range(len(BAD_SETTINGS)))
def test_every_bad_setting_gets_a_typed_error(i):
    make, err = BAD_SETTINGS[i]
    with pytest.raises(err):
        make()


def test_configuration_errors(gen):
    c = TopK(0.1)
    state = c.new_state()
    c.compress(rand(100, torch.float32, gen), state)
    with pytest.raises(ShapeError, match="one state per bucket"):
        c.compress(rand(101, torch.float32, gen), state)
    with pytest.raises(InvalidArgumentError):
        c.advance(Payload({}, 1), state)


def _good_state(gen) -> tuple[PowerSGD, CompressionState]:
    c = PowerSGD(2)
    st = c.new_state(seed=3)
    roundtrip(c, rand((30, 20), torch.float32, gen), st)
    return c, st


BAD_STATE_DICTS = [
    # (how the good state_dict is spoiled, error)
    (lambda sd: [1, 2], ArgumentTypeError),
    (lambda sd: None, ArgumentTypeError),
    (lambda sd: {"step": 1}, InvalidArgumentError),
    (lambda sd: {**sd, "extra": 1}, InvalidArgumentError),
    (lambda sd: {**sd, "step": "1"}, ArgumentTypeError),
    (lambda sd: {**sd, "step": 1.0}, ArgumentTypeError),
    (lambda sd: {**sd, "step": True}, ArgumentTypeError),
    (lambda sd: {**sd, "step": -1}, InvalidArgumentError),
    (lambda sd: {**sd, "seed": None}, ArgumentTypeError),
    (lambda sd: {**sd, "seed": 1 << 64}, InvalidArgumentError),
    (lambda sd: {**sd, "tensors": [torch.zeros(3)]}, ArgumentTypeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], 3: torch.zeros(3)}}, ArgumentTypeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], "residual": [0.0] * 600}}, ArgumentTypeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], "residual": torch.zeros(600, dtype=torch.float64)}}, DTypeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], "residual": torch.zeros(30, 20)}}, ShapeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], "q": torch.zeros(20)}}, ShapeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], "q": torch.zeros(20, 2, dtype=torch.int32)}}, DTypeError),
    (lambda sd: {**sd, "tensors": {**sd["tensors"], "residual": torch.zeros(600, device="meta")}},
     InvalidArgumentError),
]  # fmt: skip


@pytest.mark.parametrize("i", range(len(BAD_STATE_DICTS)))
def test_a_bad_state_dict_changes_nothing(gen, i):
    """Wrong types, shapes or dtypes in a state_dict: a typed error, and the state exactly as before."""
    _, st = _good_state(gen)
    spoil, err = BAD_STATE_DICTS[i]
    before = st.state_dict()
    work = dict(st.work)
    with pytest.raises(err):
        st.load_state_dict(spoil(st.state_dict()))
    after = st.state_dict()
    assert (after["step"], after["seed"], after["tensors"].keys()) == (before["step"], before["seed"],
                                                                        before["tensors"].keys())  # fmt: skip
    assert all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items())
    assert st.work.keys() == work.keys() and all(st.work[k] is v for k, v in work.items())


def test_what_the_bucket_layer_and_the_planner_read():
    """Names, labels, state needs and costs come from the compressors themselves (no type switches)."""
    assert [c.kind for c in (NoCompression(), FP16(), TopK(0.1), Quantize(), Sign(), PowerSGD())] == [
        "none", "FP16", "TopK", "Quantize", "Sign", "PowerSGD"]  # fmt: skip
    assert [c.label() for c in (FP16(), BF16(), Quantize(4, stochastic=True), PowerSGD(4))] == [
        "fp16", "bf16", "int4:stochastic=true", "powersgd:4"]  # fmt: skip
    assert [c.stateful for c in (NoCompression(), FP16(), TopK(0.1), Quantize(), Sign(), PowerSGD())] == [
        False, False, True, True, True, True]  # fmt: skip
    assert NoCompression().identity and not FP16().identity
    assert FP16().prescale and not BF16().prescale
    for c in (NoCompression(), FP16(), BF16(), TopK(0.1), Quantize(4), Sign()):
        assert c.warmup() == (0, 2.0) and c.per_tensor(3.0) is c
        schemes = c.schemes((64, 33), torch.float32, 4)
        assert schemes and all(r.nbytes > 0 for rounds in schemes.values() for r in rounds)
    (r,) = FP16().schemes(1000, torch.float32, 4)["all_reduce"]
    assert r.nbytes == 2000 and NoCompression().schemes(1000, torch.bfloat16, 4)["all_reduce"][0].nbytes == 2000


def test_a_state_checks_its_kind_its_bytes_and_finiteness_at_load():
    """A TopK state loaded into a PowerSGD state, a byte flipped in a saved residual, NaN in one: each loaded
    silently and failed (or drifted) later; each is now a typed error at load, and nothing changes (issue 41,
    item 13). A state saved without kind and checksum (an older file) still loads."""
    import torsh_kernels.compression as cz

    topk = cz.TopK(0.25).new_state(seed=3)
    topk.tensors["residual"] = torch.randn(40)
    topk.step = 2
    sd = topk.state_dict()
    assert sd["kind"] == "TopK" and isinstance(sd["checksum"], int)
    psgd = cz.PowerSGD(rank=2).new_state()
    with pytest.raises(InvalidArgumentError, match="this is a TopK state; a PowerSGD state cannot load it"):
        psgd.load_state_dict(sd)
    assert psgd.step == 0 and psgd.tensors == {}
    flipped = {**sd, "tensors": {"residual": sd["tensors"]["residual"].clone()}}
    flipped["tensors"]["residual"].view(torch.uint8)[7] ^= 0x01
    fresh = cz.TopK(0.25).new_state()
    with pytest.raises(InvalidArgumentError, match="checksum does not match"):
        fresh.load_state_dict(flipped)
    nan = {k: v for k, v in sd.items() if k != "checksum"}
    nan["tensors"] = {"residual": sd["tensors"]["residual"].clone()}
    nan["tensors"]["residual"][3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"tensors\['residual'\] holds NaN or Inf"):
        fresh.load_state_dict(nan)
    assert fresh.step == 0 and fresh.tensors == {}
    fresh.load_state_dict(sd)
    assert fresh.step == 2 and torch.equal(fresh.tensors["residual"], topk.tensors["residual"])
    older = {k: sd[k] for k in ("step", "seed", "tensors")}
    psgd_like = cz.TopK(0.25).new_state()
    psgd_like.load_state_dict(older)
    assert torch.equal(psgd_like.tensors["residual"], topk.tensors["residual"])
