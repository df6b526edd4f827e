"""Compression and the bucket layer on one process: compressor settings (types, ranges, NaN/Inf, a bool for a
number), seeds, ``CompressionState.load_state_dict``, the checkpoints of the DDP hook state and the gradient
synchronizer, ``compressed_all_reduce``'s arguments, the constructors of the hook state, the synchronizer,
FSDP2's quantized comms and the expert-parallel MoE layer, and the signature switch
(``check_signatures``, ``TORSH_KERNELS_CHECK_SIGNATURES``).

A bad checkpoint must leave its target exactly as it was: those cases compare the state before and after the
call and raise an ``AssertionError`` (an other_exception, a defect) when the typed error came with a change.
The communicator, where one is needed, is a ``ReplicaCommunicator`` (this process standing for every rank),
so nothing here spawns processes; ``mismatch.py`` holds the distributed cases."""

from __future__ import annotations

import functools

import torch

from probe_cases import Case, setenv

NAN, INF = float("nan"), float("inf")


def _replica(ws: int = 2):
    from torsh_kernels.collectives.replica import ReplicaCommunicator

    return ReplicaCommunicator(ws)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))


# -- compressor settings ------------------------------------------------------------------------------------


def _make(cls_name: str, *args, **kw):
    from torsh_kernels import compression

    return getattr(compression, cls_name)(*args, **kw)


SETTINGS = [
    # (compressor, args, kwargs, what)
    *[("TopK", (v,), {}, f"ratio_{n}") for n, v in (("0", 0), ("negative", -0.1), ("above_1", 1.5), ("nan", NAN),
                                                     ("inf", INF), ("minus_inf", -INF), ("bool", True),
                                                     ("str", "0.1"), ("none", None), ("list", [0.1]),
                                                     ("complex", 0.1j))],
    ("TopK", (0.1,), {"exact": 1}, "exact_int"),
    ("TopK", (0.1,), {"error_feedback": "yes"}, "error_feedback_str"),
    ("TopK", (0.1,), {"check_finite": None}, "check_finite_none"),
    ("TopK", (0.1,), {"provider": 3}, "provider_int"),
    ("TopK", (0.1,), {"provider": "cuda"}, "provider_unknown"),
    *[("Quantize", (), {"bits": v}, f"bits_{n}") for n, v in (("5", 5), ("0", 0), ("negative", -8), ("16", 16),
                                                             ("bool", True), ("float", 8.0), ("str", "8"),
                                                             ("nan", NAN))],
    *[("Quantize", (), {"block": v}, f"block_{n}") for n, v in (("100", 100), ("1", 1), ("0", 0),
                                                               ("negative", -256), ("huge", 1 << 31),
                                                               ("bool", True), ("float", 256.0), ("inf", INF))],
    ("Quantize", (), {"stochastic": 1}, "stochastic_int"),
    ("Quantize", (), {"error_feedback": None}, "error_feedback_none"),
    ("Quantize", (), {"provider": "x"}, "provider_unknown"),
    ("Sign", (), {"error_feedback": 0}, "error_feedback_int"),
    ("Sign", (), {"check_finite": "no"}, "check_finite_str"),
    ("Sign", (), {"provider": ""}, "provider_empty"),
    *[("PowerSGD", (), {"rank": v}, f"rank_{n}") for n, v in (("0", 0), ("negative", -1), ("bool", True),
                                                             ("float", 2.0), ("none", None), ("nan", NAN))],
    *[("PowerSGD", (1,), {"start_iter": v}, f"start_iter_{n}") for n, v in (("negative", -1), ("bool", False),
                                                                           ("float", 1.0), ("inf", INF))],
    ("PowerSGD", (1,), {"warm_start": 1}, "warm_start_int"),
    *[("PowerSGD", (1,), {"min_compression_rate": v}, f"min_compression_rate_{n}")
      for n, v in (("negative", -1), ("nan", NAN), ("inf", INF), ("bool", True), ("str", "2"))],
    *[(c, (), {"check_finite": "no"}, "check_finite_str") for c in ("NoCompression", "FP16", "BF16")],
    *[(c, (), {"provider": "gpu"}, "provider_unknown") for c in ("NoCompression", "FP16", "BF16")],
]  # fmt: skip


def _seed(v):
    from torsh_kernels.compression import CompressionState, TopK

    TopK(0.1).new_state(seed=v)
    return CompressionState(seed=v)


# -- CompressionState.load_state_dict: all or nothing -------------------------------------------------------


def _powersgd_state():
    from torsh_kernels.compression import PowerSGD, roundtrip

    c = PowerSGD(2)
    st = c.new_state(seed=3)
    roundtrip(c, torch.randn(30, 20), st)
    return st


def _snapshot(st) -> tuple:
    return st.step, st.seed, {k: v.clone() for k, v in st.tensors.items()}, dict(st.work)


def _same(a: tuple, b: tuple) -> bool:
    return (a[0], a[1], a[2].keys(), a[3].keys()) == (b[0], b[1], b[2].keys(), b[3].keys()) and all(
        torch.equal(v, b[2][k]) for k, v in a[2].items()
    ) and all(v is b[3][k] for k, v in a[3].items())  # fmt: skip


def _load_state(spoil) -> None:
    """Load a spoiled state_dict into a used state: must raise a typed error and change nothing."""
    from torsh_kernels.errors import TorshKernelsError

    st = _powersgd_state()
    before = _snapshot(st)
    try:
        st.load_state_dict(spoil(st.state_dict()))
    except TorshKernelsError:
        if not _same(before, _snapshot(st)):
            raise AssertionError("CompressionState.load_state_dict raised but changed the state") from None
        raise


def _with_tensor(name, value):
    return lambda sd: {**sd, "tensors": {**sd["tensors"], name: value}}


STATE_DICTS = [
    ("not_a_dict", lambda sd: [1, 2]),
    ("none", lambda sd: None),
    ("missing_keys", lambda sd: {"step": 1}),
    ("extra_key", lambda sd: {**sd, "extra": 1}),
    ("step_str", lambda sd: {**sd, "step": "1"}),
    ("step_float", lambda sd: {**sd, "step": 1.0}),
    ("step_bool", lambda sd: {**sd, "step": True}),
    ("step_negative", lambda sd: {**sd, "step": -1}),
    ("step_huge", lambda sd: {**sd, "step": 1 << 70}),
    ("seed_none", lambda sd: {**sd, "seed": None}),
    ("seed_huge", lambda sd: {**sd, "seed": 1 << 64}),
    ("seed_float", lambda sd: {**sd, "seed": 0.5}),
    ("tensors_list", lambda sd: {**sd, "tensors": [torch.zeros(3)]}),
    ("tensor_name_int", lambda sd: {**sd, "tensors": {**sd["tensors"], 3: torch.zeros(3)}}),
    ("residual_list", _with_tensor("residual", [0.0] * 600)),
    ("residual_float64", _with_tensor("residual", torch.zeros(600, dtype=torch.float64))),
    ("residual_int", _with_tensor("residual", torch.zeros(600, dtype=torch.int32))),
    ("residual_2d", _with_tensor("residual", torch.zeros(30, 20))),
    ("residual_meta", _with_tensor("residual", torch.zeros(600, device="meta"))),
    ("residual_sparse", _with_tensor("residual", torch.zeros(600).to_sparse())),
    ("q_1d", _with_tensor("q", torch.zeros(20))),
    ("q_int", _with_tensor("q", torch.zeros(20, 2, dtype=torch.int32))),
    # integrity (issue 41, item 13): a flipped value under the saved checksum, another compressor's state, NaN/Inf
    ("residual_value_changed", lambda sd: _with_tensor("residual", sd["tensors"]["residual"].clone().add_(1e-3))(sd)),
    ("kind_topk", lambda sd: {**sd, "kind": "TopK"}),
    ("kind_int", lambda sd: {**sd, "kind": 3}),
    ("checksum_str", lambda sd: {**sd, "checksum": "0"}),
    (
        "residual_nan",
        lambda sd: _with_tensor("residual", torch.full_like(sd["tensors"]["residual"], NAN))(
            {k: v for k, v in sd.items() if k != "checksum"}
        ),
    ),
    (
        "q_inf",
        lambda sd: _with_tensor("q", torch.full_like(sd["tensors"]["q"], INF))(
            {k: v for k, v in sd.items() if k != "checksum"}
        ),
    ),
]


# -- the bucket layer's checkpoints: all or nothing ------------------------------------------------------------


def _owner(kind: str):
    """A hook state or a synchronizer with two iterations of top-k states (a replica of 2 ranks)."""
    from torsh_kernels.compression import TopK
    from torsh_kernels.parallel import CompressionHookState, GradientSynchronizer

    net = _mlp()
    if kind == "synchronizer":
        owner = GradientSynchronizer(net, _replica(), compressor=TopK(0.1), min_numel=16, overlap=False)
        for _ in range(2):
            net(torch.randn(4, 12)).sum().backward()
            owner.sync_gradients()
            owner.zero_grad()
        return owner
    owner = CompressionHookState(compressor=TopK(0.1), min_numel=16)
    eng, comm = owner._engine, _replica()
    for _ in range(2):  # what the hook does per bucket, without DDP
        grads = [torch.randn_like(p) for p in net.parameters()]
        for r in eng.start(grads, list(range(len(grads))), comm)[0]:
            r.wait()
        eng.end_iteration()
    return owner


def _engine_snapshot(eng) -> tuple:
    return (eng.iteration, dict(eng.shapes), dict(eng.states), dict(eng._plans), eng.compressor,
            {k: _snapshot(s) for k, s in eng.states.items()})  # fmt: skip


def _load_checkpoint(kind: str, spoil) -> None:
    from torsh_kernels.errors import TorshKernelsError

    owner = _owner(kind)
    eng = owner._engine
    before = _engine_snapshot(eng)
    try:
        owner.load_state_dict(spoil(owner.state_dict()))
    except TorshKernelsError:
        after = _engine_snapshot(eng)
        same = all(a is b or a == b for a, b in zip(before[:5], after[:5])) and all(
            _same(s, after[5][k]) for k, s in before[5].items())  # fmt: skip
        if not same:
            raise AssertionError(f"{type(owner).__name__}.load_state_dict raised but changed the state") from None
        raise


def _spoil_residual(sd):
    (k, st), *_ = ((k, v) for k, v in sd["states"].items() if "residual" in v["tensors"])
    return {**sd, "states": {**sd["states"], k: {**st, "tensors": {**st["tensors"], "residual": torch.zeros(7)}}}}


def _first_state(sd):
    return next(iter(sd["states"].values()))


CHECKPOINTS = [
    ("none", lambda sd: None),
    ("list", lambda sd: [sd]),
    ("missing_states", lambda sd: {k: v for k, v in sd.items() if k != "states"}),
    ("extra_key", lambda sd: {**sd, "extra": 1}),
    ("other_policy", lambda sd: {**sd, "policy": "bucket"}),
    ("iteration_str", lambda sd: {**sd, "iteration": "2"}),
    ("iteration_bool", lambda sd: {**sd, "iteration": True}),
    ("iteration_float", lambda sd: {**sd, "iteration": 2.0}),
    ("iteration_negative", lambda sd: {**sd, "iteration": -1}),
    ("other_compressor", lambda sd: {**sd, "compressor": "TopK(ratio=0.5)"}),
    ("compressor_none", lambda sd: {**sd, "compressor": None}),
    ("auto_record_not_auto", lambda sd: {**sd, "auto": {"choice": "topk(0.1)"}}),
    ("shapes_list", lambda sd: {**sd, "shapes": [(24, 12)]}),
    ("shape_key_str", lambda sd: {**sd, "shapes": {**sd["shapes"], "0": (24, 12)}}),
    ("shape_float", lambda sd: {**sd, "shapes": {**sd["shapes"], 0: (24.0, 12)}}),
    ("shape_negative", lambda sd: {**sd, "shapes": {**sd["shapes"], 0: (-24, 12)}}),
    ("shape_of_another_model", lambda sd: {**sd, "shapes": {**sd["shapes"], 0: (12, 24)}}),
    ("states_list", lambda sd: {**sd, "states": list(sd["states"].values())}),
    ("state_key_str", lambda sd: {**sd, "states": {**sd["states"], "w": _first_state(sd)}}),
    ("state_key_bool", lambda sd: {**sd, "states": {**sd["states"], (True,): _first_state(sd)}}),
    ("state_key_empty", lambda sd: {**sd, "states": {**sd["states"], (): _first_state(sd)}}),
    ("state_of_unknown_tensor", lambda sd: {**sd, "states": {**sd["states"], (9,): _first_state(sd)}}),
    ("state_missing_keys", lambda sd: {**sd, "states": {**sd["states"], (0,): {"step": 1}}}),
    ("state_step_negative", lambda sd: {**sd, "states": {**sd["states"], (0,): {"step": -1, "seed": 0,
                                                                                  "tensors": {}}}}),
    ("residual_of_another_size", _spoil_residual),
    # whose state (issue 41, item 17): malformed owner fields
    ("rank_past_world_size", lambda sd: {**sd, "rank": 2, "world_size": 2}),
    ("rank_str", lambda sd: {**sd, "rank": "0", "world_size": 2}),
    ("residual_not_a_tensor", lambda sd: {**sd, "states": {**sd["states"], (0,): {"step": 1, "seed": 0,
                                                                                    "tensors": {"residual": 0}}}}),
]  # fmt: skip


def _other_rank(kind: str, rank: int, world: int) -> None:
    """A state saved by another rank (or in a job of another size) loaded where this process's rank is known:
    the synchronizer's communicator, a hook state given a communicator (issue 41, item 17). A hook state over a
    process group not up yet checks at its first backward (tests/parallel/test_hooks.py)."""
    from torsh_kernels.compression import TopK
    from torsh_kernels.parallel import CompressionHookState

    owner = _owner("synchronizer")
    if kind == "hook_state_given_comm":
        owner = CompressionHookState(_replica(), compressor=TopK(0.1), min_numel=16)
    sd = owner.state_dict()
    owner.load_state_dict({**sd, "rank": rank, "world_size": world})


def _auto_checkpoint(record) -> None:
    from torsh_kernels.compression import NoCompression, TopK
    from torsh_kernels.errors import TorshKernelsError
    from torsh_kernels.parallel import CompressionHookState

    state = CompressionHookState(compressor="auto", auto_candidates=(None, TopK(0.1)))
    try:
        state.load_state_dict({**state.state_dict(), "auto": record})
    except TorshKernelsError:
        if state._engine.auto.decision is not None or not isinstance(state.compressor, NoCompression):
            raise AssertionError("CompressionHookState.load_state_dict raised but changed the auto choice") from None
        raise


# -- the driver's and the objects' arguments ------------------------------------------------------------------


def _car(*args, **kw):
    from torsh_kernels.compression import compressed_all_reduce

    return compressed_all_reduce(*args, **kw)


def _topk_state():
    from torsh_kernels.compression import TopK

    return TopK(0.1).new_state()


def _car_cases():
    from torsh_kernels.collectives.replica import ReplicaCommunicator
    from torsh_kernels.compression import TopK

    comm = ReplicaCommunicator(2)
    return [
        ("int_tensor", lambda: _car(torch.ones(4, dtype=torch.int32), comm)),
        ("float64_tensor", lambda: _car(torch.ones(4, dtype=torch.float64), comm)),
        ("not_contiguous", lambda: _car(torch.ones(4, 4).t(), comm)),
        ("not_a_tensor", lambda: _car([1.0, 2.0], comm)),
        ("compressor_str", lambda: _car(torch.ones(4), comm, "topk")),
        ("stateful_without_state", lambda: _car(torch.ones(4), comm, TopK(0.5))),
        ("state_not_a_state", lambda: _car(torch.ones(4), comm, TopK(0.5), {"step": 0})),
        ("same_state_twice", lambda: (lambda s: _car([torch.ones(4), torch.ones(4)], comm, TopK(0.5), [s, s]))(
            _topk_state())),
        ("states_count", lambda: _car([torch.ones(4), torch.ones(4)], comm, TopK(0.5), [_topk_state()])),
        ("quantize_mode_unknown", lambda: _car(torch.ones(4), comm, quantize_mode="x")),
        ("link_not_a_link", lambda: _car(torch.ones(4), comm, link=10e9)),
        ("check_signatures_str", lambda: _car(torch.ones(4), comm, check_signatures="yes")),
        ("check_signatures_int", lambda: _car(torch.ones(4), comm, check_signatures=1)),
        ("comm_none", lambda: _car(torch.ones(4), None)),
    ]  # fmt: skip


def _hook_state(**kw):
    from torsh_kernels.parallel import CompressionHookState

    return CompressionHookState(**kw)


def _synchronizer(**kw):
    from torsh_kernels.parallel import GradientSynchronizer

    return GradientSynchronizer(_mlp(), _replica(), **kw)


def _qag(**kw):
    from torsh_kernels.parallel import QuantizedAllGather

    return QuantizedAllGather(**kw)


def _qrs(**kw):
    from torsh_kernels.parallel import QuantizedReduceScatter

    return QuantizedReduceScatter(**kw)


def _apply(**kw):
    from torsh_kernels.parallel import apply_quantized_comm

    return apply_quantized_comm(_mlp(), **kw)


def _moe(**kw):
    from torsh_kernels.parallel import ExpertParallelMoE

    args = {"hidden": 12, "ffn_hidden": 10, "num_experts": 4, "k": 2, **kw}
    return ExpertParallelMoE(args.pop("hidden"), args.pop("ffn_hidden"), args.pop("num_experts"), args.pop("k"),
                             _replica(), **args)  # fmt: skip


OBJECTS = [
    ("hook_state/check_signatures_str", lambda: _hook_state(check_signatures="no")),
    ("hook_state/check_signatures_int", lambda: _hook_state(check_signatures=0)),
    ("hook_state/start_iter_bool", lambda: _hook_state(start_iter=True)),
    ("hook_state/min_numel_negative", lambda: _hook_state(min_numel=-1)),
    ("hook_state/policy_unknown", lambda: _hook_state(policy="x")),
    ("hook_state/compressor_str", lambda: _hook_state(compressor="topk")),
    # timeouts (issue 41, item 8): checked at construction, not at the first backward
    ("hook_state/timeout_nan", lambda: _hook_state(timeout=NAN)),
    ("hook_state/timeout_inf", lambda: _hook_state(timeout=INF)),
    ("hook_state/timeout_1e300", lambda: _hook_state(timeout=1e300)),
    ("hook_state/timeout_bool", lambda: _hook_state(timeout=True)),
    ("hook_state/timeout_zero", lambda: _hook_state(timeout=0)),
    ("synchronizer/check_signatures_str", lambda: _synchronizer(check_signatures="off")),
    ("synchronizer/bucket_mb_nan", lambda: _synchronizer(bucket_mb=NAN)),
    ("synchronizer/nonfinite_unknown", lambda: _synchronizer(nonfinite="ignore")),
    ("fsdp/all_gather_bits_bool", lambda: _qag(bits=True)),
    ("fsdp/all_gather_block_100", lambda: _qag(block=100)),
    ("fsdp/all_gather_check_signatures_int", lambda: _qag(check_signatures=1)),
    ("fsdp/reduce_scatter_error_feedback_int", lambda: _qrs(error_feedback=1)),
    ("fsdp/reduce_scatter_residual_float64", lambda: _qrs(residual=torch.zeros(4, dtype=torch.float64))),
    ("fsdp/reduce_scatter_check_signatures_str", lambda: _qrs(check_signatures="yes")),
    ("fsdp/apply_on_a_model_without_fsdp", lambda: _apply()),
    ("fsdp/apply_weights_int2", lambda: _apply(weights="int2")),
    ("fsdp/apply_check_signatures_str", lambda: _apply(check_signatures="yes")),
    ("fsdp/apply_comm_str", lambda: _apply(comm="nccl")),
    ("fsdp/apply_timeout_nan", lambda: _apply(timeout=NAN)),
    ("fsdp/apply_timeout_bool", lambda: _apply(timeout=True)),
    ("fsdp/apply_timeout_negative", lambda: _apply(timeout=-1)),
    ("fsdp/apply_timeout_1e300", lambda: _apply(timeout=1e300)),
    ("fsdp/all_gather_timeout_inf", lambda: _qag(timeout=float("inf"))),
    ("fsdp/reduce_scatter_timeout_str", lambda: _qrs(timeout="10")),
    ("moe/experts_not_divisible", lambda: _moe(num_experts=3)),
    ("moe/k_0", lambda: _moe(k=0)),
    ("moe/k_above_experts", lambda: _moe(k=5)),
    ("moe/hidden_bool", lambda: _moe(hidden=True)),
    ("moe/check_signatures_str", lambda: _moe(check_signatures="yes")),
]


def _env_value(value: str):
    def run():
        with setenv(TORSH_KERNELS_CHECK_SIGNATURES=value):
            return _hook_state()

    return run


# -- what must work ------------------------------------------------------------------------------------------


def _round_trip_is_exact() -> bool:
    from torsh_kernels.compression import PowerSGD, roundtrip

    st = _powersgd_state()
    c = PowerSGD(2)
    restored = c.new_state()
    restored.load_state_dict(st.state_dict())
    x = torch.randn(30, 20)
    return torch.equal(roundtrip(c, x, st)[0], roundtrip(c, x, restored)[0])


def _checkpoint_loads(kind: str) -> bool:
    owner = _owner(kind)
    sd = owner.state_dict()
    owner.load_state_dict(sd)
    return owner.state_dict()["iteration"] == sd["iteration"] == 2


def _replica_average() -> list:
    from torsh_kernels.compression import TopK

    x = torch.arange(6, dtype=torch.float32)
    c = TopK(1.0)
    _car(x, _replica(3), c, c.new_state(), check_signatures=True)  # no peers: nothing exchanged
    return x.tolist()


def _sparse(indices: list, size: tuple) -> None:
    """all_reduce_sparse on an unchecked COO tensor (issue 41, item 11): indices outside the size made torch
    abort ("double free or corruption") or segfault later; they must be refused before anything is sent."""
    from torsh_kernels.collectives import all_reduce_sparse

    idx = torch.tensor(indices, dtype=torch.int64)
    t = torch.sparse_coo_tensor(idx, torch.ones(idx.shape[1]), size, check_invariants=False)
    all_reduce_sparse(_replica(), t)


SPARSE = [
    ("index_past_the_size", ([[0, 5, 99]], (10,))),
    ("index_negative", ([[0, -1]], (10,))),
    ("index_past_dim_1", ([[0, 1], [3, 7]], (2, 7))),
    ("index_huge", ([[1 << 62]], (10,))),
]


def _cases() -> list[Case]:
    cases = [Case(f"compression/{c}/{what}", functools.partial(_make, c, *a, **kw)) for c, a, kw, what in SETTINGS]
    for n, v in (("float", 1.5), ("bool", True), ("str", "1"), ("none", None), ("huge", 1 << 63), ("nan", NAN)):
        cases.append(Case(f"compression/new_state/seed_{n}", functools.partial(_seed, v)))
    cases += [Case(f"compression/CompressionState.load_state_dict/{n}", functools.partial(_load_state, f))
              for n, f in STATE_DICTS]  # fmt: skip
    for kind in ("hook_state", "synchronizer"):
        cases += [Case(f"compression/{kind}.load_state_dict/{n}", functools.partial(_load_checkpoint, kind, f))
                  for n, f in CHECKPOINTS]  # fmt: skip
    for n, rec in (("unknown_choice", {"choice": "int8"}), ("choice_int", {"choice": 3}), ("str", "topk(0.1)"),
                   ("incomplete", {"choice": "topk(0.1)"})):  # fmt: skip
        cases.append(Case(f"compression/hook_state.load_state_dict/auto_{n}", functools.partial(_auto_checkpoint, rec)))
    for kind in ("synchronizer", "hook_state_given_comm"):
        cases += [Case(f"compression/{kind}.load_state_dict/saved_by_rank_{r}_of_{w}",
                       functools.partial(_other_rank, kind, r, w)) for r, w in ((1, 2), (0, 4))]  # fmt: skip
    cases += [Case(f"compression/compressed_all_reduce/{n}", f) for n, f in _car_cases()]
    cases += [Case(f"compression/{n}", f) for n, f in OBJECTS]
    cases += [Case(f"compression/all_reduce_sparse/{n}", functools.partial(_sparse, *a)) for n, a in SPARSE]
    cases += [Case(f"compression/env/TORSH_KERNELS_CHECK_SIGNATURES={v}", _env_value(v)) for v in ("maybe", "2")]
    cases += [
        Case("compression/CompressionState/round_trip", _round_trip_is_exact, expect="ok", check=bool),
        Case("compression/hook_state.load_state_dict/own_checkpoint",
             functools.partial(_checkpoint_loads, "hook_state"), expect="ok", check=bool),
        Case("compression/synchronizer.load_state_dict/own_checkpoint",
             functools.partial(_checkpoint_loads, "synchronizer"), expect="ok", check=bool),
        Case("compression/compressed_all_reduce/replica_of_3", _replica_average, expect="ok",
             check=lambda v: v == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
        Case("compression/env/TORSH_KERNELS_CHECK_SIGNATURES=0", _env_value("0"), expect="ok",
             check=lambda s: not s._engine.check_signatures),
        Case("compression/TopK/ratio_1", functools.partial(_make, "TopK", 1), expect="ok",
             check=lambda c: c.ratio == 1),
    ]  # fmt: skip
    return cases


CASES = _cases()
