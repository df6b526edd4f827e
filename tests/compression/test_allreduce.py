"""compressed_all_reduce on real processes (gloo), world sizes 2, 3 and 4, every compressor.

Each rank rebuilds every rank's input (seeded by step and rank) and simulates every rank's compressor
state on its own, so it can compute the exact expected average (the mean of the ranks' decompressed
contributions, or the scheme's own result for sign and PowerSGD) without communication. The
communicator runs with the cross-rank consistency check, so any difference in the collectives the ranks
issue (order, sizes) fails loudly. Several tensors ("buckets") of different shapes go through on every
step, as in DDP.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import assert_named_on_every_rank, count_calls, make_compressor
from torsh_kernels.collectives import Link, TorchCommunicator, all_reduce_time, run_local
from torsh_kernels.compression import (
    BF16,
    FP16,
    CompressionState,
    Compressor,
    NoCompression,
    Payload,
    PowerSGD,
    Quantize,
    Sign,
    TopK,
    compressed_all_reduce,
    compressed_time,
    plan,
    roundtrip,
    sign_chunk,
    start_compressed_all_reduce,
)
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from torsh_kernels.ops import orthogonalize_ref, sign_compress_ref, sign_decompress_ref

SHAPES = [(7, 143), (5,), (64, 33)]  # odd sizes; (5,) leaves sign chunks empty and PowerSGD uncompressed
STEPS = 3


def inputs(step: int, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_003 * step + 1009 * rank + sum(shape))
    return torch.randn(shape, generator=g)


make = make_compressor


def _gather_ref(c, xs, sims):
    """Mean of each rank's decompressed contribution, each rank's state simulated by a roundtrip."""
    outs = [roundtrip(c, x, st)[0] for x, st in zip(xs, sims)]
    return torch.stack(outs).mean(0)


def _shared_ref(c: Quantize, xs, sims, step):
    from torsh_kernels.ops.quantize import seed_key, uniform_noise

    qmax = 127 if c.bits == 8 else 7
    accs = [x.reshape(-1) + st.residual(x.reshape(-1)) for x, st in zip(xs, sims)]
    n, nb = accs[0].numel(), -(-accs[0].numel() // c.block)
    pad = [torch.nn.functional.pad(a, (0, nb * c.block - n)).view(nb, c.block) for a in accs]
    s = torch.stack([p.abs().amax(1) for p in pad]).amax(0) / qmax
    contribs = []
    for r, (p, st) in enumerate(zip(pad, sims)):
        y = p / torch.where(s > 0, s, 1.0)[:, None]
        if c.stochastic:
            seed = (st.seed * 0x9E3779B97F4A7C15 + st.step) & 0xFFFFFFFFFFFFFFFF
            u = uniform_noise(torch.arange(nb * c.block, dtype=torch.int32), seed_key(seed)).view(nb, c.block)
            codes = torch.floor(y + u)
        else:
            codes = torch.round(y)
        v = (codes.clamp(-qmax, qmax) * s[:, None]).view(-1)[:n]
        st.tensors["residual"] = accs[r] - v
        st.step += 1
        contribs.append(v)
    return torch.stack(contribs).mean(0)


def _sign_ref(xs, sims):
    ws, n = len(xs), xs[0].numel()
    chunk = sign_chunk(n, ws)
    out = torch.empty(n)
    for d in range(ws):
        lo, hi = min(n, d * chunk), min(n, (d + 1) * chunk)
        if hi == lo:
            continue
        avg = torch.zeros(hi - lo)
        for x, st in zip(xs, sims):
            res = st.residual(x.reshape(-1))
            bits, scale = sign_compress_ref(x.reshape(-1)[lo:hi], res[lo:hi])
            avg += sign_decompress_ref(bits, scale, hi - lo) / ws
        server = sims[d]
        sr = server.tensors.setdefault("server_residual", torch.zeros(hi - lo))
        bits, scale = sign_compress_ref(avg, sr)
        out[lo:hi] = sign_decompress_ref(bits, scale, hi - lo)
    for st in sims:
        st.step += 1
    return out


def _powersgd_ref(c: PowerSGD, xs, sims, shape):
    ws = len(xs)
    n = xs[0].numel()
    plan = c._plan(xs[0])
    if sims[0].step < c.start_iter or plan is None:
        for st in sims:
            st.step += 1
        return torch.stack([x.reshape(-1) for x in xs]).mean(0)
    rows, cols, r = plan
    ms = []
    for x, st in zip(xs, sims):
        m = torch.zeros(rows * cols)
        m[:n] = x.reshape(-1) + st.residual(x.reshape(-1))
        ms.append(m.view(rows, cols))
    q = sims[0].tensors.get("q")
    if q is None:  # the initial Q, from rank 0's seed (all ranks adopt it)
        g = torch.Generator().manual_seed(sims[0].seed * 1_000_003)
        q = torch.randn(cols, r, generator=g)
    p = orthogonalize_ref(sum(m @ q for m in ms))
    q = sum(m.t() @ p for m in ms) / ws
    approx = (p @ q.t()).reshape(-1)
    for m, st in zip(ms, sims):
        st.tensors["residual"] = m.reshape(-1)[:n] - approx[:n]
        st.tensors["q"] = q
        st.step += 1
    return approx[:n]


TOLS = {"none": 1e-5, "fp16": 3e-3, "bf16": 3e-2, "powersgd": 1e-4}


def with_scheme(c, scheme: str):
    """``c`` with this wire scheme if it is a Quantize (the others have one way over the wire)."""
    return dataclasses.replace(c, scheme=scheme) if isinstance(c, Quantize) else c


def _compressed_worker(comm: TorchCommunicator, names: list[str], provider: str | None, steps: int = STEPS) -> int:
    comm = TorchCommunicator(comm.group, timeout=30, check_consistency=True)
    ws, me = comm.world_size, comm.rank
    checks = 0
    for name in names:
        c = with_scheme(make(name, provider), "shared_scale" if name.endswith("shared") else "all_gather")
        states = [c.new_state(seed=me) if c is not None else None for _ in SHAPES]
        # every rank's state, simulated here (stochastic rounding uses each rank's own seed)
        sims = [[c.new_state(seed=r) if c is not None else None for r in range(ws)] for _ in SHAPES]
        if isinstance(c, PowerSGD):
            for per_shape in sims:
                for st in per_shape:
                    st.seed = 0  # rank 0's seed, broadcast on the first call
        for step in range(steps):
            for b, shape in enumerate(SHAPES):  # several buckets per step
                xs = [inputs(step, r, shape) for r in range(ws)]
                t = xs[me].clone()
                compressed_all_reduce(t, comm, c, states[b])
                if c is None or isinstance(c, (FP16, BF16)):
                    want = torch.stack([x if c is None else x.to(c.dtype).float() for x in xs]).mean(0)
                elif isinstance(c, Sign):
                    want = _sign_ref(xs, sims[b]).view(shape)
                elif isinstance(c, PowerSGD):
                    want = _powersgd_ref(c, xs, sims[b], shape).view(shape)
                elif isinstance(c, Quantize) and c.scheme == "shared_scale":
                    want = _shared_ref(c, xs, sims[b], step).view(shape)
                else:
                    want = _gather_ref(c, xs, sims[b]).view(shape)
                tol = TOLS.get(name, 1e-5)
                where = f"{name} step {step} {shape}"
                torch.testing.assert_close(t, want, rtol=tol, atol=tol, msg=lambda m, w=where: f"{w}: {m}")
                if c is not None and "residual" in states[b].tensors:  # error feedback stays per rank
                    mine = states[b].tensors["residual"]
                    torch.testing.assert_close(mine, sims[b][me].tensors["residual"], rtol=tol, atol=tol)
                    other = sims[b][(me + 1) % ws].tensors["residual"]
                    assert not torch.equal(mine, other), "a rank's residual equals another rank's"
                if isinstance(c, Sign) and "server_residual" in states[b].tensors:
                    torch.testing.assert_close(
                        states[b].tensors["server_residual"], sims[b][me].tensors["server_residual"]
                    )
                checks += 1
    return checks


ALL = ["none", "fp16", "bf16", "topk", "topk-exact", "int8-gather", "int8-shared", "int4-gather", "int4-shared",
       "fp8", "sign", "powersgd"]  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_compressor_averages_the_ranks_contributions(world_size):
    counts = run_local(_compressed_worker, world_size, ALL, None, op_timeout=60)
    assert counts == [len(ALL) * STEPS * len(SHAPES)] * world_size


@pytest.mark.slow  # every compressor's kernels interpreted/simulated inside real ranks
@pytest.mark.parametrize("provider", ["triton", "numba"])
def test_kernel_providers_in_compressed_all_reduce(provider):
    names = ["topk", "int8-gather", "int4-shared", "sign", "powersgd"]
    # two steps: the second reads the residuals and Q the first left (the interpreters are slow)
    counts = run_local(_compressed_worker, 2, names, provider, 2, op_timeout=120)
    assert counts == [len(names) * 2 * len(SHAPES)] * 2


def _errors_worker(comm) -> list[str]:
    out = []
    st = Sign().new_state()
    x = torch.randn(100)
    compressed_all_reduce(x.clone(), comm, Sign(), st)
    before = copy.deepcopy(st.state_dict())
    bad = x.clone()
    bad[3] = float("nan")
    try:
        compressed_all_reduce(bad, comm, Sign(), st)  # every rank raises, before the network
    except NonFiniteError as e:
        out.append(type(e).__name__)
    after = st.state_dict()
    assert after["step"] == before["step"] and torch.equal(after["tensors"]["residual"], before["tensors"]["residual"])
    for err, call in (
        (InvalidArgumentError, lambda: compressed_all_reduce(torch.ones(4), comm, TopK(0.5))),  # no state
        (InvalidArgumentError, lambda: compressed_all_reduce(torch.ones(4, dtype=torch.int32), comm)),
        (ShapeError, lambda: compressed_all_reduce(torch.ones(4, 4).t(), comm)),
        (ArgumentTypeError, lambda: compressed_all_reduce(torch.ones(4), comm, 3)),  # (a str is a name)
        (InvalidArgumentError,
         lambda: compressed_all_reduce(torch.ones(4), comm, Quantize(), Quantize().new_state(), quantize_mode="x")),
    ):  # fmt: skip
        with pytest.raises(err):
            call()
        out.append(err.__name__)
    t = torch.full((3,), float(comm.rank))
    compressed_all_reduce(t, comm)
    assert t.tolist() == [0.5] * 3
    return out


def test_bad_input_raises_before_state_or_network_change():
    out = run_local(_errors_worker, 2, op_timeout=20)
    assert out == [["NonFiniteError", "InvalidArgumentError", "InvalidArgumentError", "ShapeError",
                    "ArgumentTypeError", "InvalidArgumentError"]] * 2  # fmt: skip


def _list_worker(comm: TorchCommunicator, names: list[str]) -> int:
    """A list of tensors with one state each equals one call per tensor; several reductions in flight at
    once, stepped in the same order on every rank, give the same results."""

    comm = TorchCommunicator(comm.group, timeout=30, check_consistency=True)
    ws, me = comm.world_size, comm.rank
    checks = 0
    for name in names:
        c = with_scheme(make(name), "shared_scale" if name.endswith("shared") else "all_gather")
        one = [c.new_state(seed=me) if c is not None else None for _ in SHAPES]
        many = [c.new_state(seed=me) if c is not None else None for _ in SHAPES]
        piped = [c.new_state(seed=me) if c is not None else None for _ in SHAPES]
        for step in range(STEPS):
            xs = [inputs(step, me, shape) for shape in SHAPES]
            want = [x.clone() for x in xs]
            for t, st in zip(want, one):
                compressed_all_reduce(t, comm, c, st)
            got = [x.clone() for x in xs]
            states = many if c is not None else None
            assert compressed_all_reduce(got, comm, c, states) is got
            # one reduction per tensor, all in flight, advanced round-robin (as the DDP hook does)
            pipe = [x.clone() for x in xs]
            rs = [start_compressed_all_reduce(t, comm, c, st) for t, st in zip(pipe, piped)]
            while not all(r.done for r in rs):
                for r in rs:
                    r.step()
            assert all(r.bytes_sent > 0 and r.rounds >= 1 for r in rs)
            for w, g, p in zip(want, got, pipe):
                exact = ws == 2 or (c is not None and not c.is_linear)  # a 3-rank ring sums in a chunk-dependent order
                tol = 0 if exact else TOLS.get(name, 1e-5)
                torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n} list: {m}")
                torch.testing.assert_close(p, w, rtol=0, atol=0, msg=lambda m, n=name: f"{n} pipelined: {m}")
                checks += 1
    return checks


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_list_of_tensors_and_pipelined_reductions_match_single_calls(world_size):
    counts = run_local(_list_worker, world_size, ALL, op_timeout=60)
    assert counts == [len(ALL) * STEPS * len(SHAPES)] * world_size


# -- the contract: a compressor is one module, and what it says it sends is what goes on the wire ----------


def _bytes_worker(comm: TorchCommunicator) -> list[tuple[str, int, int]]:
    """For every compressor and scheme: (name, bytes the reduction sent, bytes its scheme declares)."""
    out = []
    cases = [("none", "auto", "all_reduce"), ("fp16", "auto", "all_reduce"), ("bf16", "auto", "all_reduce"),
             ("topk", "auto", "all_gather"), ("int8", "all_gather", "all_gather"),
             ("int4", "shared_scale", "shared_scale_all_reduce"), ("sign", "auto", "all_to_all+all_gather"),
             ("powersgd", "auto", "all_reduce")]  # fmt: skip
    for name, mode, scheme in cases:
        c = make_compressor(name, start_iter=0) if name == "powersgd" else with_scheme(make_compressor(name), mode)
        for shape in SHAPES:
            t = inputs(0, comm.rank, shape)
            st = c.new_state(seed=comm.rank) if c is not None else None
            r = start_compressed_all_reduce(t, comm, c, st)
            r.wait()
            declared = (c or NoCompression()).schemes(shape, t.dtype, comm.world_size)[scheme]
            out.append((f"{name} {shape}", r.bytes_sent, int(sum(x.nbytes for x in declared))))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_bytes_a_scheme_declares_are_the_bytes_sent(world_size):
    """The planner prices what ``schemes()`` declares; the driver counts each collective's input. They
    agree to the byte, up to the 8-byte alignment of a gathered segment."""
    for rank_rows in run_local(_bytes_worker, world_size, op_timeout=60):
        for what, sent, declared in rank_rows:
            assert 0 <= sent - declared < 8, (what, sent, declared)


@dataclass(slots=True)
class RandK(Compressor):
    """A compressor written only here, against the contract: random-k sparsification with indices drawn
    from a seed every rank shares (so it is linear: the ranks' values at the same indices add up), scaled
    by n / k to stay unbiased. Nothing in the library knows it."""

    k: int = 5
    is_linear = True
    stateful = True  # the step count draws the indices
    passes = 2.0

    def _indices(self, n: int, state: CompressionState) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + state.step)
        return torch.randperm(n, generator=g)[: min(self.k, n)]

    def compress(self, tensor, state):
        x = tensor.reshape(-1)
        idx = self._indices(x.numel(), state)
        state.work["idx"] = idx
        state.step += 1
        return Payload({"values": x[idx].float() * (x.numel() / idx.numel())}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = out.view(-1)
        if not accumulate:
            o.zero_()
        o[state.work["idx"]] += alpha * payload.tensors["values"].to(o.dtype)
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        n = math.prod(shape) if isinstance(shape, tuple) else shape
        return 4 * min(self.k, n)


def _randk_worker(comm: TorchCommunicator) -> int:
    c = RandK(k=9)
    states = [c.new_state() for _ in SHAPES]
    for step in range(2):
        for shape, st in zip(SHAPES, states):
            xs = [inputs(step, r, shape) for r in range(comm.world_size)]
            idx = c._indices(math.prod(shape), st)  # the indices this step will draw
            t = xs[comm.rank].clone()
            r = start_compressed_all_reduce(t, comm, c, st)
            r.wait()
            want = torch.zeros(math.prod(shape))
            want[idx] = torch.stack(xs).mean(0).view(-1)[idx] * (want.numel() / idx.numel())
            torch.testing.assert_close(t.view(-1), want, rtol=1e-6, atol=1e-6)
            assert r.bytes_sent == c.payload_nbytes(shape) and r.rounds == 1
    return len(SHAPES) * 2


def test_a_new_compressor_needs_no_change_outside_its_module():
    """A compressor defined in this test file runs through the driver on real processes and is priced by
    the planner, from the contract alone."""
    assert run_local(_randk_worker, 3, op_timeout=60) == [2 * len(SHAPES)] * 3
    link = Link(latency=10e-6, bandwidth=1e9)
    algo, t = compressed_time(RandK(k=1000), 1_000_000, 4, link)
    assert algo in ("ring", "tree", "rabenseifner") and t == pytest.approx(all_reduce_time(4000, 4, link, algo))
    p = plan(4 << 20, 4, link, compressors=(None, RandK(k=1000)))
    assert p.candidates[0][0] == "randk" and isinstance(p.compressor, RandK)


def test_reduction_and_payload_print_sizes_not_values():
    from torsh_kernels.collectives.replica import ReplicaCommunicator

    c = PowerSGD(rank=4, provider="torch")
    grads = [torch.randn(512, 256), torch.randn(300, 200)]
    r = start_compressed_all_reduce(grads, ReplicaCommunicator(2), c, [c.new_state(), c.new_state()])
    first = repr(r)
    r.wait()
    last = repr(r)
    for s in (first, last):
        assert len(s) <= 200 and "\n" not in s and "tensor(" not in s, s
    assert "rounds=1, done=False, sent 0 B" in first, first  # fresh states: rank 0's seeds broadcast first
    assert "rounds=3, done=True" in last and f"tensors={len(grads)}" in last, last  # the seeds, P, Q
    assert "PowerSGD, all_reduce" in last and f"sent {r.bytes_sent / 2**10:.4g} KiB" in last, last

    p = c.compress(torch.randn(512, 256), c.new_state())
    s = repr(p)
    assert s == f"Payload(tensors={{'p': (512, 4) float32}}, numel={512 * 256}, final=False, nbytes={512 * 4 * 4})", s
    big = Payload({"data": torch.randn(1 << 16)}, 1 << 16)
    assert len(repr(big)) <= 120, repr(big)


# -- the signature exchange: ranks that would send different collectives all raise, before sending ---------


def _mismatch_worker(comm) -> dict:
    """Every way two ranks' compressed all-reduces can differ, one after another in one job (each exchange
    raises on every rank before anything else is sent, so the group stays usable); then the exchanges a
    matching configuration makes, and the switch that turns them off."""
    from torsh_kernels.collectives.communicator import TorchCommunicator
    from torsh_kernels.errors import CollectiveMismatchError

    me = comm.rank
    odd = me == 1

    def t(*shape, dtype=torch.float32):
        return inputs(0, me, shape).to(dtype)

    used = PowerSGD(1).new_state(seed=me)
    roundtrip(PowerSGD(1), t(30, 20), used)  # a state one step old, against a fresh one
    cases = {  # name: (compressor, tensor(s), the deprecated quantize_mode or None, state(s) or None: fresh ones)
        "class": (Quantize(8) if odd else TopK(0.1), t(300), None, None),
        "ratio": (TopK(0.2 if odd else 0.1), t(300), None, None),
        "rank": (PowerSGD(2 if odd else 1), t(30, 20), None, None),
        "bits": (Quantize(4 if odd else 8), t(300), None, None),
        "block": (Quantize(8, 64 if odd else 256), t(300), None, None),
        "dtype": (TopK(0.1), t(300, dtype=torch.bfloat16 if odd else torch.float32), None, None),
        "shapes": (TopK(0.1), t(20, 30) if odd else t(30, 20), None, None),
        "numel": (TopK(0.1), t(301 if odd else 300), None, None),
        "tensors": (TopK(0.1), [t(30, 20), t(7)] + ([t(5)] if odd else []), None, None),
        "scheme": (Quantize(8, scheme="shared_scale" if odd else "all_gather"), t(300), None, None),
        "quantize_mode": (Quantize(8), t(300), "shared_scale" if odd else "all_gather", None),  # the same, deprecated
        "state_age": (PowerSGD(1), t(30, 20), None, used if odd else PowerSGD(1).new_state(seed=me)),
    }
    out = {}
    for name, (c, x, mode, st) in cases.items():
        if st is None:
            st = [c.new_state(seed=me) for _ in x] if isinstance(x, list) else c.new_state(seed=me)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                compressed_all_reduce(x, comm, c, st, **({} if mode is None else {"quantize_mode": mode}))
            out[name] = None
        except CollectiveMismatchError as e:
            out[name] = str(e)
    with count_calls(TorchCommunicator, "all_gather") as calls:

        def gathers(fn) -> int:
            n = calls["all_gather"]
            fn()
            return calls["all_gather"] - n

        c, st = TopK(0.05), TopK(0.05).new_state(seed=me)
        # a matching configuration: one exchange, the first time (top-k itself all-gathers once per call)
        out["topk"] = [gathers(lambda: compressed_all_reduce(t(40, 30), comm, c, st)) for _ in range(3)]
        # the same configuration through a new communicator of the same group: remembered per group
        again = TorchCommunicator(comm.group)
        out["topk_new_comm"] = gathers(lambda: compressed_all_reduce(t(40, 30), again, c, st))
        # PowerSGD: its first call on a fresh state differs (the seed broadcast), so two exchanges
        p, ps = PowerSGD(1), PowerSGD(1).new_state(seed=me)
        out["powersgd"] = [gathers(lambda: compressed_all_reduce(t(40, 30), comm, p, ps)) for _ in range(3)]
        c2, st2 = TopK(0.07), TopK(0.07).new_state(seed=me)
        out["off"] = gathers(lambda: compressed_all_reduce(t(40, 30), comm, c2, st2, check_signatures=False))
    x = torch.full((3,), float(me))
    compressed_all_reduce(x, comm)  # the group still works after the mismatches
    out["average"] = x.tolist()
    return out


def test_ranks_that_differ_all_raise_a_collective_mismatch_naming_the_difference():
    named = {"class": "compressor: TopK on rank 0, Quantize on rank 1", "ratio": "compressor.ratio: 0.1 on rank 0",
             "rank": "compressor.rank: 1 on rank 0, 2 on rank 1", "bits": "compressor.bits: 8 on rank 0, 4 on rank 1",
             "block": "compressor.block: 256 on rank 0, 64 on rank 1",
             "dtype": "dtypes: ['float32'] on rank 0, ['bfloat16'] on rank 1",
             "shapes": "shapes: [(30, 20)] on rank 0, [(20, 30)] on rank 1", "numel": "numel: 300 on rank 0, 301",
             "tensors": "tensors: 2 on rank 0, 3 on rank 1",
             "scheme": "compressor.scheme: all_gather on rank 0, shared_scale on rank 1",
             "quantize_mode": "compressor.scheme: all_gather on rank 0, shared_scale on rank 1",
             "state_age": "state phases: [3] on rank 0, [2] on rank 1"}  # fmt: skip
    out = run_local(_mismatch_worker, 2, op_timeout=30)
    assert_named_on_every_rank(out, named)
    for res in out:
        assert res["topk"] == [2, 1, 1] and res["topk_new_comm"] == 1
        assert res["powersgd"] == [1, 1, 0]
        assert res["off"] == 1
        assert res["average"] == [0.5] * 3
