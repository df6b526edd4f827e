"""One name per compressor (issue 42, item 7): the registry's grammar, the canonical ``name`` of every
compressor (it builds an equal one), typed errors, and every entry point that takes a compressor taking its
name as well: the planner, ``auto``'s candidates, the DDP hook (on 2 real gloo processes), the synchronizer,
``compressed_all_reduce`` and FSDP2's ``apply_quantized_comm``."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import torsh_kernels.compression as cz
from torsh_kernels.collectives import run_local
from torsh_kernels.collectives.cost_model import Link
from torsh_kernels.collectives.replica import ReplicaCommunicator
from torsh_kernels.compression import (
    BF16,
    FP16,
    NoCompression,
    PowerSGD,
    Quantize,
    Sign,
    TopK,
    compressed_all_reduce,
    compressor_from_name,
    plan,
)
from torsh_kernels.compression.names import (
    COMPRESSOR_NAMES,
    DEFAULT_CANDIDATE_NAMES,
    FAMILIES,
    QUANTIZED_FORMATS,
    compressor_name,
)
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError

EVERY = [
    NoCompression(),
    NoCompression(check_finite=False),
    FP16(),
    FP16(provider="torch"),
    BF16(),
    BF16(check_finite=False, provider="cpu"),
    Quantize(),
    Quantize(4),
    Quantize(8, 64, True, scheme="shared_scale"),
    Quantize(4, block=32, stochastic=True, scheme="all_gather", error_feedback=False, check_finite=False),
    Sign(),
    Sign(error_feedback=False, provider="torch"),
    TopK(0.01),
    TopK(1),
    TopK(1e-5),
    TopK(0.3, exact=True, error_feedback=False),
    PowerSGD(),
    PowerSGD(4),
    PowerSGD(2, start_iter=10, warm_start=False, min_compression_rate=3.5, check_finite=False),
    PowerSGD(8).per_tensor(3.0),  # as the bucket layer runs it
]


@pytest.mark.parametrize("c", EVERY, ids=lambda c: c.name)
def test_every_compressor_round_trips_through_its_name(c):
    built = compressor_from_name(c.name)
    assert type(built) is type(c) and built == c and built.name == c.name
    assert c.label() == c.name == compressor_name(c)  # one name: plans and auto's table show this one


def test_the_canonical_names():
    assert [c.name for c in (NoCompression(), FP16(), BF16(), Quantize(8), Quantize(4), Sign())] == [
        "none", "fp16", "bf16", "int8", "int4", "sign"]  # fmt: skip
    assert TopK(0.01).name == "topk:0.01" and PowerSGD(4).name == "powersgd:4" and PowerSGD().name == "powersgd:1"
    assert Quantize(stochastic=True, scheme="shared_scale").name == "int8:stochastic=true,scheme=shared_scale"
    assert TopK(0.5, exact=True).name == "topk:0.5,exact=true"
    assert compressor_from_name("powersgd") == PowerSGD(1) and compressor_from_name("powersgd:rank=4") == PowerSGD(4)
    # traces and statistics keep tagging by class (what torsh report reads)
    assert [c.kind for c in (NoCompression(), FP16(), TopK(0.1), Quantize(), Sign(), PowerSGD())] == [
        "none", "FP16", "TopK", "Quantize", "Sign", "PowerSGD"]  # fmt: skip


def test_every_compressor_class_has_a_family():
    classes = {o for _, o in inspect.getmembers(cz, inspect.isclass) if issubclass(o, cz.Compressor)}
    classes.discard(cz.Compressor)
    assert classes == {f.cls for f in FAMILIES.values()}
    assert COMPRESSOR_NAMES == ("none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk", "powersgd")


def test_the_default_candidates_and_tables_take_their_names_from_the_registry():
    from torsh_kernels.parallel.auto import default_candidates

    names = ["none" if c is None else c.name for c in cz.DEFAULT_CANDIDATES]
    assert tuple(names) == DEFAULT_CANDIDATE_NAMES == ("none", "fp16", "bf16", "topk:0.01", "int8", "fp8:e4m3", "int4",
                                                       "sign", "powersgd:4")  # fmt: skip
    assert ["none" if c is None else c.name for c in default_candidates()] == names
    p = plan(64 << 20, 4, Link.gbit(10))
    assert {n for n, _, _ in p.candidates} == set(DEFAULT_CANDIDATE_NAMES)
    # the planner takes names as candidates, and names its candidates by them
    p = plan(64 << 20, 4, Link.gbit(0.1), compressors=("none", "int8", "topk:0.01"))
    assert next(n for n, _, _ in p.candidates) == "topk:0.01" and p.compressor == TopK(0.01)


@pytest.mark.parametrize(
    ("text", "err", "says"),
    [
        (
            "nosuch",
            InvalidArgumentError,
            "unknown compressor; known: none, fp16, bf16, int8, int4, fp8, sign, topk, powe",
        ),
        ("quantize", InvalidArgumentError, "unknown compressor; known:"),
        ("INT8", InvalidArgumentError, "unknown compressor"),
        ("auto", InvalidArgumentError, "'auto' is accepted where a compressor is chosen per job"),
        ("topk", InvalidArgumentError, "topk needs its ratio: topk:RATIO[,key=value,...]"),
        ("topk:", InvalidArgumentError, "nothing after ':'"),
        ("topk:x", InvalidArgumentError, "topk's ratio must be a number, got 'x'"),
        ("topk:nan", InvalidArgumentError, "topk's ratio must be a finite number"),
        ("topk:2", InvalidArgumentError, "TopK: ratio=2.0"),
        ("topk:0.1,ratio=0.2", InvalidArgumentError, "ratio is given twice"),
        ("topk:0.1,bogus=1", InvalidArgumentError, "topk has no setting 'bogus'; its settings: ratio, exact"),
        ("topk:0.1,0.2", InvalidArgumentError, "only the first setting may be positional (ratio)"),
        ("int8:3", InvalidArgumentError, "int8 takes no positional argument"),
        ("int8:bits=4", InvalidArgumentError, "int8 has no setting 'bits'"),
        ("int8:block=100", InvalidArgumentError, "block must be a power of two"),
        ("int8:stochastic=yes", InvalidArgumentError, "int8's stochastic must be true or false, got 'yes'"),
        ("int8:scheme=ring", InvalidArgumentError, "scheme"),
        ("powersgd:1.5", InvalidArgumentError, "powersgd's rank must be an integer, got '1.5'"),
        ("powersgd:0", InvalidArgumentError, "rank"),
        ("fp16:provider=gpu", InvalidArgumentError, "provider 'gpu' is not one of"),
        ("sign:,", InvalidArgumentError, "an empty setting"),
        (8, ArgumentTypeError, "expected a string, got int"),
        (None, ArgumentTypeError, "expected a string, got NoneType"),
    ],
)
def test_bad_names_raise_typed_errors_that_say_what_is_wrong(text, err, says):
    with pytest.raises(err) as info:
        compressor_from_name(text)
    assert says in str(info.value)


def test_the_single_process_entry_points_accept_names():
    from torsh_kernels.parallel import CompressionHookState

    st = CompressionHookState(compressor="int8", min_numel=64)
    assert st.compressor == Quantize(8)
    st._engine.set_compressor("topk:0.05")
    assert st.compressor == TopK(0.05)
    st._engine.set_compressor("none")
    assert st.compressor == NoCompression()
    auto = CompressionHookState(compressor="auto", auto_candidates=["none", "fp16", "powersgd:2"])
    assert auto._engine.auto.candidates == (None, FP16(), PowerSGD(2))
    with pytest.raises(InvalidArgumentError, match="auto_candidates: compressor name 'topk'"):
        CompressionHookState(compressor="auto", auto_candidates=["topk"])
    with pytest.raises(InvalidArgumentError, match=r"compressor: compressor name 'int9'.*or 'auto'"):
        CompressionHookState(compressor="int9")
    # compressed_all_reduce: the same result as the compressor object (ranks that all hold this data)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for name, obj in (("fp16", FP16()), ("int8", Quantize(8)), ("topk:0.1", TopK(0.1))):
        a, b = x.clone(), x.clone()
        compressed_all_reduce(a, ReplicaCommunicator(2), name, obj.new_state() if obj.stateful else None)
        compressed_all_reduce(b, ReplicaCommunicator(2), obj, obj.new_state() if obj.stateful else None)
        assert torch.equal(a, b), name
    with pytest.raises(InvalidArgumentError, match="compressed_all_reduce: compressor: compressor name 'sgn'"):
        compressed_all_reduce(x.clone(), ReplicaCommunicator(2), "sgn")


def test_fsdp_formats_are_the_compressors_names():
    from torsh_kernels.compression import FP8
    from torsh_kernels.parallel import apply_quantized_comm
    from torsh_kernels.parallel.fsdp_format import FORMATS, FP8_NAMES

    assert QUANTIZED_FORMATS == {"int8": 8, "int4": 4}
    assert FORMATS == {**QUANTIZED_FORMATS, "fp8": 8, "fp8:e4m3": 8, "fp8:e5m2": 8}
    for name, bits in QUANTIZED_FORMATS.items():
        assert compressor_from_name(name) == Quantize(bits)
    for name, fmt in FP8_NAMES.items():  # the fp8 formats are the FP8 compressor's names and encodings
        assert compressor_from_name(name) == FP8(fmt)
    # hsdp_grads takes a name: a bad one is refused by name, a good one passes to the model checks
    with pytest.raises(InvalidArgumentError, match="hsdp_grads: compressor name 'fp17'"):
        apply_quantized_comm(nn.Linear(2, 2), hsdp_grads="fp17")
    with pytest.raises(InvalidArgumentError, match="fully_shard"):
        apply_quantized_comm(nn.Linear(2, 2), hsdp_grads="fp16")


def test_a_checkpoint_s_auto_choice_under_the_former_label_still_loads():
    from torsh_kernels.parallel import CompressionHookState

    st = CompressionHookState(compressor="auto", auto_candidates=(None, TopK(0.05), PowerSGD(4)))
    rec = {"choice": "powersgd(rank=4)", "link": {"latency_s": 1e-5, "bandwidth_Bps": 1e9}, "world_size": 2,
           "buckets": 1, "gradient_bytes": 4, "candidates": [], "measure_s": 0.0}  # fmt: skip
    d = st._engine.auto.recorded(rec, "CompressionHookState")
    assert d.compressor == PowerSGD(4) and d.choice == "powersgd:4"
    with pytest.raises(InvalidArgumentError, match="is not among"):
        st._engine.auto.recorded({**rec, "choice": "powersgd(rank=2)"}, "CompressionHookState")


# -- the DDP hook and the synchronizer on 2 gloo processes ---------------------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(37, 61), nn.ReLU(), nn.Linear(61, 45), nn.ReLU(), nn.Linear(45, 10))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 7919 + rank * 31)
    return torch.randn(16, 37, generator=g), torch.randint(0, 10, (16,), generator=g)


def _names_worker(comm):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torsh_kernels.parallel import CompressionHookState, GradientSynchronizer, compression_hook

    out = {}
    for name, obj in (("int8", Quantize(8)), ("topk:0.05", TopK(0.05)), ("powersgd:2", PowerSGD(2))):
        runs = []
        for c in (name, obj):
            net = _net()
            ddp = DDP(net, bucket_cap_mb=0.005)
            state = CompressionHookState(compressor=c, min_numel=64)
            ddp.register_comm_hook(state, compression_hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            for step in range(2):
                x, y = _batch(step, comm.rank)
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            runs.append((torch.cat([p.detach().reshape(-1) for p in net.parameters()]), state.compressor.name,
                         state.stats.as_dict()["bytes_after"]))  # fmt: skip
        out[name] = (torch.equal(runs[0][0], runs[1][0]), runs[0][1], runs[0][2] == runs[1][2])
    grads = []
    for c in ("int8", Quantize(8)):
        net = _net()
        sync = GradientSynchronizer(net, comm, bucket_mb=0.005, compressor=c, min_numel=64)
        x, y = _batch(0, comm.rank)
        nn.functional.cross_entropy(net(x), y).backward()
        sync.sync_gradients()
        grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
    out["synchronizer"] = torch.equal(grads[0], grads[1])
    t = torch.full((5,), float(comm.rank + 1))
    compressed_all_reduce(t, comm, "bf16")
    out["compressed_all_reduce"] = t.tolist()
    return out


@pytest.mark.slow  # 2 processes and 7 DDP/synchronizer runs: ~7 s on the 2-core VM
def test_the_hook_and_the_synchronizer_take_names_on_two_gloo_ranks():
    out = run_local(_names_worker, 2, op_timeout=60)
    for r in out:
        assert r["int8"] == (True, "int8", True)
        assert r["topk:0.05"] == (True, "topk:0.05", True)
        assert r["powersgd:2"] == (True, "powersgd:2", True)
        assert r["synchronizer"] is True
        assert r["compressed_all_reduce"] == [1.5] * 5
