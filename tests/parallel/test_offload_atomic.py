"""OffloadedOptimizer is all or nothing: a step that fails in any chunk (the wrapped optimizer raising, a
gradient that cannot be gathered, a state that cannot be packed, parameters that cannot be written) and a
state dict that does not fit leave parameters, gradients and every piece of optimizer state bit for bit as
they were; the next step then gives what a step that never failed gives."""

from __future__ import annotations

import pytest
import torch

import torsh_kernels.parallel.offload_optimizer as OO
from torsh_kernels.errors import (
    ArgumentTypeError,
    DTypeError,
    InvalidArgumentError,
    LayoutMismatchError,
    NonFiniteError,
    ShapeError,
)
from torsh_kernels.parallel import OffloadedOptimizer

SIZES = [(5, 8), (40,), (3, 7)]  # 40, 40 and 21 elements
ONE_PARAM_MB = 40 * 4 / 2**20  # chunk_mb that puts each parameter in a chunk of its own


class Injected(RuntimeError):
    pass


class FlakyAdamW(torch.optim.AdamW):
    """AdamW whose ``fail_at``-th step (counting from 1, over every instance) raises after updating: the
    chunk it ran on is changed when the exception leaves."""

    calls = 0
    fail_at = 0

    def step(self, closure=None):
        out = super().step(closure)
        FlakyAdamW.calls += 1
        if FlakyAdamW.calls == FlakyAdamW.fail_at:
            raise Injected(f"the wrapped optimizer failed at its step {FlakyAdamW.calls}")
        return out


def _params(n_chunks: int) -> tuple[list[torch.nn.Parameter], float]:
    g = torch.Generator().manual_seed(n_chunks)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SIZES[: max(n_chunks, 2)]]
    return ps, (ONE_PARAM_MB if n_chunks > 1 else 32.0)


def _grads(ps, seed: int, backward: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(p.shape, generator=g) for p in ps]
    if backward:  # through the post-accumulate-grad hooks, which move them to the host
        sum((p * w).sum() for p, w in zip(ps, ws)).backward()
    else:
        for p, w in zip(ps, ws):
            p.grad = w


def _snapshot(opt: OffloadedOptimizer, ps) -> list:
    """Every bit of state a step could touch, copied."""

    def t(x):
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    snap = [[t(p) for p in ps], [t(p.grad) for p in ps], dict(opt.stats),
            [dict(g, params=None) for g in opt.param_groups],
            {id(p): dict(s) for p, s in opt.state.items()}]  # fmt: skip
    for c in opt._chunks:
        snap.append([t(c.master_flat), list(c.host_has), [bool(m.grad is not None) for m in c.masters],
                     {k: v for k, v in c.inner.param_groups[0].items() if k != "params"}])  # fmt: skip
        if opt.offload_gradients == "backward":
            snap.append(t(c.grad_flat))  # the gradients, on the host
        for m in c.masters:
            snap.append({k: t(v) for k, v in c.inner.state.get(m, {}).items()})
            snap.append({k: (t(pk.data), pk.fmt, pk.shape) for k, pk in opt._packed.get(id(m), {}).items()})
    return snap


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (a.dtype, a.layout) != (
            b.dtype,
            b.layout,
        ):
            return False
        return torch.equal(a.to_dense(), b.to_dense()) if a.is_sparse else torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _pair(n_chunks: int, fmt: str, mode: str, optimizer=FlakyAdamW):
    """Two optimizers on equal parameters: one to fail, one reference that never does; one good step taken."""
    out = []
    for _ in range(2):
        ps, mb = _params(n_chunks)
        opt = OffloadedOptimizer(ps, optimizer=optimizer, state_format=fmt, chunk_mb=mb, offload_gradients=mode,
                                 lr=0.05, weight_decay=0.01)  # fmt: skip
        assert len(opt._chunks) == n_chunks
        _grads(ps, 1, mode == "backward")
        opt.step()
        opt.zero_grad()
        _grads(ps, 2, mode == "backward")  # the gradients of the step that will fail
        out.append((opt, ps))
    return out


def _fails_cleanly(opt, ps, exc) -> None:
    before = _snapshot(opt, ps)
    with pytest.raises(exc):
        opt.step()
    assert _same(_snapshot(opt, ps), before), "the failed step changed something"


def _then_equal(opt, ps, ref, ref_ps) -> None:
    """The step retried (nothing armed now) gives what the reference's step gave."""
    opt.step()
    ref.step()
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
    assert _same(opt.state_dict()["state"], ref.state_dict()["state"])


MODES = [("bf16", "step"), ("fp32", "step"), ("int8", "backward"), ("fp32", "backward")]


@pytest.mark.parametrize("n_chunks", [1, 2, 3])
@pytest.mark.parametrize(("fmt", "mode"), MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_the_wrapped_optimizer_failing_in_any_chunk(n_chunks, fmt, mode):
    for k in range(1, n_chunks + 1):
        (opt, ps), (ref, ref_ps) = _pair(n_chunks, fmt, mode)
        FlakyAdamW.calls, FlakyAdamW.fail_at = 0, k
        try:
            _fails_cleanly(opt, ps, Injected)
        finally:
            FlakyAdamW.fail_at = 0
        _then_equal(opt, ps, ref, ref_ps)


def _armed(monkeypatch, name: str, k: int) -> list[int]:
    """Make the optimizer module's ``name`` (flatten, pack, unflatten) raise at its k-th call from now."""
    real, calls = getattr(OO, name), [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == k:
            raise Injected(f"{name} failed at call {k}")
        return real(*a, **kw)

    monkeypatch.setattr(OO, name, wrapped)
    return calls


# (what fails, how many calls one step makes per chunk on this setup, modes where it is called)
FAULTS = [("flatten", 1, ("step",)), ("pack", 2, ("step", "backward")), ("unflatten", 1, ("step", "backward"))]


@pytest.mark.parametrize("n_chunks", [1, 2, 3])
@pytest.mark.parametrize(("where", "per_chunk", "modes"), FAULTS, ids=[f[0] for f in FAULTS])
def test_gathering_packing_or_scattering_failing_in_any_chunk(monkeypatch, n_chunks, where, per_chunk, modes):
    """flatten gathers a chunk's gradients, pack stores each new state tensor (2 per parameter for AdamW),
    unflatten writes a chunk's parameters: each fails at every call a step makes."""
    for mode in modes:
        for k in range(1, per_chunk * n_chunks + 1):
            (opt, ps), (ref, ref_ps) = _pair(n_chunks, "bf16", mode, torch.optim.AdamW)
            with monkeypatch.context() as mp:
                calls = _armed(mp, where, k)
                _fails_cleanly(opt, ps, Injected)
                assert calls[0] >= k
            _then_equal(opt, ps, ref, ref_ps)


def test_a_state_fp16_cannot_hold_fails_the_step_cleanly():
    """A real failure, no injection: a gradient so large that Adam's moments pass fp16's range in chunk 3
    of 3, after chunks 1 and 2 were updated."""
    ps, mb = _params(3)
    opt = OffloadedOptimizer(ps, state_format="fp16", chunk_mb=mb, lr=1e-3)
    _grads(ps, 1, False)
    opt.step()
    _grads(ps, 2, False)
    ps[2].grad.fill_(1e9)
    _fails_cleanly(opt, ps, NonFiniteError)


def test_parameters_or_gradients_that_no_longer_fit_are_refused_before_anything_changes():
    ps, mb = _params(3)
    opt = OffloadedOptimizer(ps, chunk_mb=mb, lr=1e-3)
    _grads(ps, 1, False)
    opt.step()
    _grads(ps, 2, False)
    ps[2].data = torch.randn(7, 3)  # replaced in place by the user: another shape
    _fails_cleanly(opt, ps, LayoutMismatchError)
    ps[2].data = torch.randn(3, 7)
    ps[2].grad = torch.sparse_coo_tensor([[0], [1]], [1.0], (3, 7), check_invariants=True)
    _fails_cleanly(opt, ps, ArgumentTypeError)


# -- load_state_dict ------------------------------------------------------------------------------------


def _trained(n_chunks: int = 3, fmt: str = "bf16") -> tuple[OffloadedOptimizer, list]:
    ps, mb = _params(n_chunks)
    opt = OffloadedOptimizer(ps, state_format=fmt, chunk_mb=mb, lr=1e-3)
    for seed in (1, 2):
        _grads(ps, seed, False)
        opt.step()
    return opt, ps


def _bad(sd: dict, what: str) -> dict:
    st = {i: dict(s) for i, s in sd["state"].items()}
    groups = [dict(g) for g in sd["param_groups"]]
    out = {"state": st, "param_groups": groups}
    if what == "shape-of-the-last-parameter":
        st[2]["exp_avg"] = torch.zeros(21)
    elif what == "master-shape":
        st[1]["master"] = torch.zeros(4, 10)
    elif what == "master-not-a-tensor":
        st[0]["master"] = [0.0] * 40
    elif what == "integer-state":
        st[2]["exp_avg_sq"] = torch.zeros(3, 7, dtype=torch.int32)
    elif what == "missing-key":
        del st[2]["exp_avg_sq"]
    elif what == "sgd-state":
        st[2] = {"momentum_buffer": torch.zeros(3, 7)}
    elif what == "step-a-string":
        st[1]["step"] = "12"
    elif what == "step-nan":
        st[1]["step"] = float("nan")
    elif what == "unknown-id":
        st[7] = dict(st[0])
    elif what == "repeated-id":
        groups[0]["params"] = [0, 0, 2]
    elif what == "lr-a-string":
        groups[0]["lr"] = "fast"
    elif what == "betas-wrong-length":
        groups[0]["betas"] = (0.9,)
    elif what == "state-a-list":
        out["state"] = [st[0]]
    elif what == "groups-missing":
        del out["param_groups"]
    elif what == "not-a-dict":
        return [sd]  # type: ignore[return-value]
    return out


BAD = {
    "shape-of-the-last-parameter": ShapeError, "master-shape": ShapeError, "master-not-a-tensor": ArgumentTypeError,
    "integer-state": DTypeError, "missing-key": InvalidArgumentError, "sgd-state": InvalidArgumentError,
    "step-a-string": ArgumentTypeError, "step-nan": InvalidArgumentError, "unknown-id": InvalidArgumentError,
    "repeated-id": InvalidArgumentError, "lr-a-string": ArgumentTypeError, "betas-wrong-length": ArgumentTypeError,
    "state-a-list": ArgumentTypeError, "groups-missing": InvalidArgumentError, "not-a-dict": ArgumentTypeError,
}  # fmt: skip


def test_a_state_dict_that_does_not_fit_changes_nothing():
    opt, ps = _trained()
    good = opt.state_dict()
    for what, exc in BAD.items():
        before = _snapshot(opt, ps)
        with pytest.raises(exc):
            opt.load_state_dict(_bad(good, what))
        assert _same(_snapshot(opt, ps), before), what
    # a state fp16 cannot hold fails while the new state is built, beside the old one
    fp16, ps16 = _trained(fmt="fp16")
    sd = fp16.state_dict()
    sd["state"][2]["exp_avg"] = torch.full((3, 7), 1e6)
    before = _snapshot(fp16, ps16)
    with pytest.raises(NonFiniteError):
        fp16.load_state_dict(sd)
    assert _same(_snapshot(fp16, ps16), before)
    opt.load_state_dict(good)  # and a good one still loads
    assert _same(opt.state_dict()["state"], good["state"])
