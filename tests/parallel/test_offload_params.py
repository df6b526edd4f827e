"""ParameterOffloader: forward and backward equal to the plain module (fp32 exactly; packed formats
exactly against the module with its parameters rounded the same way), through optimizer updates, with
prefetch 0/1/2, nested units and shared use; statistics; removal; typed errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.ops.offload import pack, unpack
from torsh_kernels.parallel import ParameterOffloader


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.rand(16) + 0.5)  # the block itself owns a parameter: nested units

    def forward(self, x):
        return x + self.scale * self.fc2(torch.relu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        h = self.blocks[0](h)  # a unit used twice in one forward
        return self.out(h)


def _make() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _round(m: nn.Module, fmt: str) -> None:
    if fmt != "fp32":
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(unpack(pack(p, fmt)))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "int8"])
def test_forward_backward_equal_plain_module_through_updates(fmt, prefetch):
    plain, off = _make(), _make()
    _round(plain, fmt)
    o = ParameterOffloader(off, fmt=fmt, prefetch=prefetch)
    opt = torch.optim.SGD(off.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x = torch.randn(7, 8, generator=torch.Generator().manual_seed(step))
        y1, y2 = plain(x), off(x)
        assert torch.equal(y1, y2), f"step {step}: outputs differ"
        y1.square().mean().backward()
        y2.square().mean().backward()
        for (n, a), b in zip(plain.named_parameters(), off.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: grad of {n} differs"
        opt.step()  # updates the host parameters in place; the offloader packs them again
        opt.zero_grad()
        with torch.no_grad():  # the plain model takes the same new values, rounded like the packed copies
            for a, b in zip(plain.parameters(), off.parameters()):
                a.copy_(b)
                a.grad = None
        _round(plain, fmt)
    s = o.get_stats()
    total = sum(p.numel() * p.element_size() for p in off.parameters())
    assert s["fetches"] > 0 and s["bytes_moved"] > 0
    assert 0 < s["peak_bytes"] < total, "only a few units' parameters are materialized at once"
    assert (s["prefetch_hits"] > 0) == (prefetch > 0)


def test_a_container_never_called_itself_still_prefetches():
    """ParameterOffloader(model.blocks): an nn.ModuleList has no forward of its own; the forward order comes from
    its units' hooks, so prefetching works as with the model itself (it used to record no order: no prefetch)."""
    plain, off = _make(), _make()
    o = ParameterOffloader(off.blocks, fmt="fp32", prefetch=1)
    for step in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        y1, y2 = plain(x), off(x)
        assert torch.equal(y1, y2)
        y1.sum().backward()
        y2.sum().backward()
        for (n, a), b in zip(plain.named_parameters(), off.parameters()):
            assert torch.equal(a.grad, b.grad), n
    st = o.get_stats()
    assert st["prefetch_hits"] > 0 and st["prefetch_hits"] < st["fetches"], st
    assert next(off.blocks.parameters()).device.type == "cpu" and off.inp.weight.grad is not None


def test_packed_formats_move_fewer_bytes():
    moved = {}
    for fmt in ("fp32", "bf16", "int8"):
        m = _make()
        o = ParameterOffloader(m, fmt=fmt, prefetch=0)
        m(torch.randn(3, 8)).sum().backward()
        moved[fmt] = o.get_stats()["bytes_moved"]
    assert moved["bf16"] == moved["fp32"] // 2
    assert moved["int8"] < 0.4 * moved["fp32"]


def test_parameters_live_on_the_host_and_remove_restores():
    m = _make()
    o = ParameterOffloader(m, fmt="bf16", device="cpu")
    assert all(p.device.type == "cpu" for p in m.parameters())
    with torch.no_grad():
        y = m(torch.randn(2, 8))
    assert y.shape == (2, 3)
    assert all(isinstance(p, nn.Parameter) for p in m.parameters()), "parameters are restored after each forward"
    o.remove()
    plain = _make()
    x = torch.randn(4, 8)
    assert torch.equal(m(x), plain(x)), "after remove() the module computes with its own (fp32) parameters"


def test_arguments():
    with pytest.raises(ArgumentTypeError, match=r"nn\.Module"):
        ParameterOffloader([nn.Linear(2, 2)])
    with pytest.raises(InvalidArgumentError, match="fmt="):
        ParameterOffloader(nn.Linear(2, 2), fmt="int4")
    with pytest.raises(InvalidArgumentError, match="prefetch"):
        ParameterOffloader(nn.Linear(2, 2), prefetch=-1)


def test_repr_is_one_line_of_counters():
    m = _make()
    o = ParameterOffloader(m, fmt="bf16", prefetch=1)
    for _ in range(3):
        m(torch.randn(3, 8)).sum().backward()
    st = o.get_stats()
    r = repr(o)
    assert len(r) <= 220 and "\n" not in r, r
    units = sum(1 for x in m.modules() if any(True for _ in x.parameters(recurse=False)))
    for fig in (f"units={units}", "fmt='bf16'", "prefetch=1", f"fetches={st['fetches']}",
                f"prefetch_hits={st['prefetch_hits']}", f"moved {st['bytes_moved'] / 2**10:.4g} KiB"):  # fmt: skip
        assert fig in r, (fig, r)
    assert st["fetches"] > 3  # the counters the repr shows did count


def test_construction_and_remove_are_all_or_nothing(monkeypatch):
    """Moving the parameters to the host (construction) and back (remove) fails at each parameter in turn,
    as a device out of memory would: every parameter stays where it was, and a failed remove() leaves the
    offloader working."""
    real_to, calls = torch.Tensor.to, [0, 0]

    def flaky_to(self, *a, **kw):
        calls[0] += 1
        if calls[0] == calls[1]:
            raise RuntimeError("injected: out of memory")
        return real_to(self, *a, **kw)

    n = len(list(_make().parameters()))
    for k in (1, n // 2, n):
        m = _make()
        where = [p.data_ptr() for p in m.parameters()]
        monkeypatch.setattr(torch.Tensor, "to", flaky_to)
        calls[:] = [0, k]
        with pytest.raises(RuntimeError, match="injected"):
            ParameterOffloader(m, fmt="bf16", device="cpu")
        monkeypatch.setattr(torch.Tensor, "to", real_to)
        assert [p.data_ptr() for p in m.parameters()] == where, "no parameter moved"
        o = ParameterOffloader(m, fmt="bf16", device="cpu")
        hosted = [p.data_ptr() for p in m.parameters()]
        assert hosted != where
        monkeypatch.setattr(torch.Tensor, "to", flaky_to)
        calls[:] = [0, k]
        with pytest.raises(RuntimeError, match="injected"):
            o.remove()
        monkeypatch.setattr(torch.Tensor, "to", real_to)
        assert [p.data_ptr() for p in m.parameters()] == hosted, "no parameter moved back"
        fetches = o.stats["fetches"]
        m(torch.randn(2, 8))
        assert o.stats["fetches"] > fetches, "the hooks are still in place"
        o.remove()
