"""The MoE layers on one process: the constructor arguments issue 25 added to ``MoELayer`` and
``ExpertParallelMoE`` (shared experts, the expert bias, groups, scaling, the capacity rules, padding, the
load-balancing loss, the expert compute), ``forward``'s ``sequence_lengths``, ``BiasBalancer`` (its arguments,
``observe``, ``step``, ``load_state_dict``) and ``MoELayer.from_hf`` on blocks it cannot map.

Accepted configurations are compared with a plain-torch layer written here from ``moe_route_ref`` (the routing)
and one matmul per kept assignment (the experts): the output, the auxiliary loss and the gradients of the input
and the router. ``ExpertParallelMoE`` runs over a ``ReplicaCommunicator`` of one rank (a real group of one:
its all-to-all returns the rows to this rank), so nothing here spawns processes. The ``from_hf`` cases that
build Hugging Face blocks are listed only when ``transformers`` is installed (the ``dev`` extra).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import numpy as np
import torch
import torch.nn.functional as F

from probe_cases import Case

NAN, INF = float("nan"), float("inf")
H, FF, E, K = 12, 8, 4, 2  # (rows of 48, 32 and 64 bytes: the grouped GEMM runs)
CASES: list[Case] = []


def _one_rank():
    from torsh_kernels.collectives.replica import ReplicaCommunicator

    return ReplicaCommunicator(1)


def _layer(kind: str, **kw):
    from torsh_kernels.parallel import ExpertParallelMoE, MoELayer

    torch.manual_seed(0)
    args = {"hidden": H, "ffn_hidden": FF, "num_experts": E, "k": K, **kw}
    pos = [args.pop(n) for n in ("hidden", "ffn_hidden", "num_experts", "k")]
    if kind == "MoELayer":
        return MoELayer(*pos, **args)
    return ExpertParallelMoE(*pos, _one_rank(), **args)


# -- constructor arguments ----------------------------------------------------------------------------------

SHARED = {"shared_experts": 1}
BIAS = {"expert_bias": True}
BAD_ARGS = {
    **{f"shared_experts_{n}": {"shared_experts": v} for n, v in
       (("negative", -1), ("bool", True), ("float", 1.5), ("str", "1"), ("none", None))},
    **{f"shared_ffn_hidden_{n}": {**SHARED, "shared_ffn_hidden": v} for n, v in
       (("zero", 0), ("negative", -4), ("bool", True), ("float", 8.0), ("str", "8"))},
    "shared_ffn_hidden_without_shared_experts": {"shared_ffn_hidden": 8},
    **{f"shared_gate_{n}": {**SHARED, "shared_gate": v} for n, v in
       (("int", 1), ("str", "yes"), ("none", None), ("np_bool", np.bool_(True)))},
    "shared_gate_without_shared_experts": {"shared_gate": True},
    **{f"expert_bias_{n}": {"expert_bias": v} for n, v in
       (("int", 1), ("str", "yes"), ("none", None), ("np_bool", np.bool_(True)))},
    **{f"bias_update_rate_{n}": {**BIAS, "bias_update_rate": v} for n, v in
       (("negative", -1e-3), ("nan", NAN), ("inf", INF), ("bool", True), ("str", "1e-3"), ("none", None),
        ("list", [1e-3]))},
    "bias_comm_str": {**BIAS, "bias_comm": "nccl"},
    "bias_comm_int": {**BIAS, "bias_comm": 3},
    "bias_comm_without_expert_bias": {"bias_comm": "not-a-communicator"},
    "n_group_not_dividing_E": {"n_group": 3, "topk_group": 1},
    "n_group_without_topk_group": {"n_group": 2},
    "topk_group_without_n_group": {"topk_group": 1},
    "topk_group_above_n_group": {"n_group": 2, "topk_group": 3},
    "k_above_the_kept_groups": {"n_group": 4, "topk_group": 1},
    "n_group_zero": {"n_group": 0, "topk_group": 1},
    "n_group_bool": {"n_group": True, "topk_group": 1},
    "n_group_float": {"n_group": 2.0, "topk_group": 1},
    "topk_group_zero": {"n_group": 2, "topk_group": 0},
    "topk_group_str": {"n_group": 2, "topk_group": "1"},
    **{f"scaling_{n}": {"scaling": v} for n, v in
       (("zero", 0.0), ("negative", -1.0), ("nan", NAN), ("inf", INF), ("bool", True), ("str", "2"),
        ("none", None), ("list", [2.0]), ("huge_int", 10**400), ("1e300", 1e300), ("above_fp32", 4e38))},
    **{f"capacity_factor_{n}": {"capacity_factor": v} for n, v in
       (("huge_int", 10**400), ("nan", NAN), ("zero", 0.0))},
    **{f"capacity_{n}": {"capacity": v} for n, v in
       (("negative", -1), ("bool", True), ("float", 2.0), ("str", "2"), ("list", [2]))},
    "capacity_with_capacity_factor": {"capacity": 2, "capacity_factor": 1.0},
    **{f"capacity_scope_{n}": {"capacity": 2, "capacity_scope": v} for n, v in
       (("unknown", "batch"), ("upper", "SEQUENCE"), ("none", None), ("int", 1))},
    "capacity_scope_sequence_without_capacity": {"capacity_scope": "sequence"},
    **{f"pad_to_capacity_{n}": {"capacity": 2, "pad_to_capacity": v} for n, v in
       (("int", 1), ("str", "yes"), ("none", None))},
    "pad_to_capacity_without_capacity": {"pad_to_capacity": True},
    **{f"load_balancing_{n}": {"load_balancing": v} for n, v in
       (("unknown", "seq"), ("upper", "AUX_LOSS"), ("none", None), ("int", 1), ("list", ["aux_loss"]))},
    **{f"expert_compute_{n}": {"expert_compute": v} for n, v in
       (("unknown", "fast"), ("upper", "GROUPED"), ("none", None), ("int", 1))},
    **{f"aux_loss_count_{n}": {**BIAS, "aux_loss_count": v} for n, v in
       (("unknown", "biased"), ("upper", "TOPK"), ("none", None), ("int", 1), ("list", ["topk"]))},
}  # fmt: skip

for kind in ("MoELayer", "ExpertParallelMoE"):
    for name, kw in BAD_ARGS.items():
        CASES.append(Case(f"moe_layers/{kind}/{name}", functools.partial(_layer, kind, **kw)))


# -- forward's sequence_lengths ----------------------------------------------------------------------------

SEQ_LAYER = {"capacity": 2, "capacity_scope": "sequence", "load_balancing": "seq_aux_loss"}


def _forward(kind: str, lengths, layer_kw=SEQ_LAYER):
    layer = _layer(kind, **layer_kw)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))  # T = 10 tokens
    return layer(x, sequence_lengths=lengths() if callable(lengths) else lengths)


BAD_LENGTHS = {
    "sum_below_T": [4, 4],
    "sum_above_T": [5, 6],
    "empty": [],
    "negative": [11, -1],
    "float_entry": [5.0, 5],
    "bool_entry": [True, 9],
    "none_entry": [None, 10],
    "nested": [[5, 5]],
    "str": "55",
    "int": 10,
    "set": {4, 6},
    "dict": {0: 10},
    "ndarray": np.array([5, 5]),
    "tensor_fp32": lambda: torch.tensor([5.0, 5.0]),
    "tensor_bool": lambda: torch.tensor([True, True]),
    "tensor_2d": lambda: torch.tensor([[5, 5]]),
    "tensor_0d": lambda: torch.tensor(10),
    "tensor_meta": lambda: torch.empty(2, dtype=torch.int64, device="meta"),
    "tensor_negative": lambda: torch.tensor([11, -1]),
    "tensor_sum_wrong": lambda: torch.tensor([4, 4], dtype=torch.int32),
}
for kind in ("MoELayer", "ExpertParallelMoE"):
    for name, v in BAD_LENGTHS.items():
        CASES.append(Case(f"moe_layers/{kind}/forward_sequence_lengths_{name}", functools.partial(_forward, kind, v)))
    # (checked in a layer that reads no sequences too: a bad value is not ignored)
    CASES.append(Case(f"moe_layers/{kind}/forward_sequence_lengths_sum_wrong_call_scope",
                      functools.partial(_forward, kind, [4, 4], {})))  # fmt: skip


# -- accepted configurations against a plain-torch layer ----------------------------------------------------

_ROUTE_OPTS = ("score", "renormalize", "n_group", "topk_group", "scaling", "capacity_factor", "drop_policy",
               "capacity", "capacity_scope", "pad_to_capacity")  # fmt: skip


def _act(h: torch.Tensor, activation: str, width: int) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(h[..., :width]) * h[..., width:]
    return F.gelu(h) if activation == "gelu" else F.relu(h)


def _reference(layer, opts: dict, x: torch.Tensor, seqs):
    """(output, aux loss) of ``layer``'s configuration ``opts`` in plain torch: moe_route_ref, one matmul per
    kept assignment, the shared MLP and its gate, the losses from moe_aux_loss_ref / moe_z_loss_ref."""
    from torsh_kernels.ops import moe as M

    x2 = x.reshape(-1, layer.hidden)
    T = x2.shape[0]
    logits = x2 @ layer.router.weight.t()
    kw = {n: opts[n] for n in _ROUTE_OPTS if n in opts}
    if opts.get("expert_bias"):
        kw["score_bias"] = layer.balancer.bias
    if opts.get("capacity_scope") == "sequence":
        kw["sequence_lengths"] = list(seqs)
    r = M.moe_route_ref(logits, k=layer.k, **kw)
    act = opts.get("activation", "swiglu")
    rows = []
    for t in range(T):
        acc = x2.new_zeros(layer.hidden)
        for j in range(layer.k):
            if not bool(r.dropped[t, j]):
                e = int(r.indices[t, j])
                acc = acc + r.weights[t, j] * (_act(x2[t] @ layer.w_in[e], act, layer.ffn_hidden) @ layer.w_out[e])
        rows.append(acc)
    y = torch.stack(rows) if rows else x2.new_zeros(0, layer.hidden)
    if opts.get("shared_experts"):
        s = _act(x2 @ layer.shared_w_in, act, layer.shared_ffn_hidden) @ layer.shared_w_out
        if opts.get("shared_gate"):
            s = torch.sigmoid(x2 @ layer.shared_expert_gate.weight.t()) * s
        y = y + s
    lb = opts.get("load_balancing", "aux_loss")
    coef = opts.get("aux_loss_coef", 0.01)
    aux = logits.new_zeros(())
    if lb != "none" and coef:
        groups = [n for n in seqs if n] if lb == "seq_aux_loss" else None
        aux = coef * M.moe_aux_loss_ref(logits, r, groups=groups or None, count=opts.get("aux_loss_count", "topk"))
    if opts.get("z_loss_coef"):
        aux = aux + opts["z_loss_coef"] * M.moe_z_loss_ref(logits)
    return y.view(x.shape), aux, r


def _close(a, b, tol=1e-5) -> bool:
    """Equal shapes and values within ``tol``; a missing gradient (None) counts as zeros of the other's shape."""
    if a is None or b is None:
        a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
    return a.shape == b.shape and torch.allclose(a.detach(), b.detach(), atol=tol, rtol=tol)


def _matches(kind: str, opts: dict, shape=(2, 5), lengths=None) -> bool:
    """The layer's output, aux loss, routing and gradients (input, router, experts) against ``_reference``."""
    layer = _layer("MoELayer", **opts)
    if opts.get("expert_bias"):  # a bias that changes the selection
        with torch.no_grad():
            layer.balancer.bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(2)) * 0.3)
    if kind == "ExpertParallelMoE":
        from torsh_kernels.parallel import ExpertParallelMoE

        run = ExpertParallelMoE.from_layer(layer, _one_rank())
    else:
        run = layer
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, H, generator=g)
    gy = torch.randn(*shape, H, generator=g)
    if lengths is not None:
        seqs = tuple(int(n) for n in lengths)
    else:
        seqs = (shape[1],) * shape[0] if len(shape) == 2 else (shape[0],)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = run(xa, sequence_lengths=lengths)
    ((y * gy).sum() + run.aux_loss).backward()
    got = [xa.grad, run.router.weight.grad, run.w_in.grad, run.w_out.grad]
    params = [layer.router.weight, layer.w_in, layer.w_out]
    for p in params:
        p.grad = None
    y_ref, aux_ref, r_ref = _reference(layer, opts, xb, seqs)
    ((y_ref * gy).sum() + aux_ref).backward()
    want = [xb.grad, *[p.grad for p in params]]
    r = run.last_routing
    return (
        _close(y, y_ref)
        and _close(run.aux_loss, aux_ref)
        and torch.equal(r.indices, r_ref.indices)
        and torch.equal(r.row_map, r_ref.row_map)
        and all(_close(a, b) for a, b in zip(got, want, strict=True))
    )


EVERYTHING = {
    "score": "sigmoid", "shared_experts": 2, "shared_ffn_hidden": 6, "shared_gate": True, "expert_bias": True,
    "n_group": 2, "topk_group": 1, "scaling": 2.0, "capacity": 2, "capacity_scope": "sequence",
    "pad_to_capacity": True, "load_balancing": "seq_aux_loss", "z_loss_coef": 1e-3,
}  # fmt: skip
ACCEPTED = {
    "shared_experts": {"shared_experts": 1},
    "shared_experts_gated_width": {"shared_experts": 2, "shared_ffn_hidden": 7, "shared_gate": True},
    "shared_experts_gelu": {"shared_experts": 1, "activation": "gelu"},
    "expert_bias": {"expert_bias": True, "bias_update_rate": 0.0},
    "groups_scaling": {"n_group": 2, "topk_group": 1, "scaling": 2.5, "score": "sigmoid"},
    "capacity_call": {"capacity": 2, "drop_policy": "position"},
    "capacity_sequence_factor": {"capacity_factor": 1.0, "capacity_scope": "sequence"},
    "pad_to_capacity": {"capacity": 3, "pad_to_capacity": True},
    "seq_aux_loss": {"load_balancing": "seq_aux_loss"},
    "load_balancing_none": {"load_balancing": "none", "z_loss_coef": 1e-3},
    "expert_compute_loop": {"expert_compute": "loop", "shared_experts": 1},
    "expert_compute_grouped": {"expert_compute": "grouped", "capacity": 2, "pad_to_capacity": True},
    "aux_loss_count_routed": {
        "expert_bias": True,
        "n_group": 2,
        "topk_group": 1,
        "score": "sigmoid",
        "aux_loss_count": "routed",
    },
    "everything": EVERYTHING,
    "everything_relu_loop": {**EVERYTHING, "activation": "relu", "expert_compute": "loop"},
}
for kind in ("MoELayer", "ExpertParallelMoE"):
    for name, opts in ACCEPTED.items():
        CASES.append(Case(f"moe_layers/{kind}/matches_reference_{name}", functools.partial(_matches, kind, opts),
                          "ok", check=lambda v: v is True, timeout=60.0))  # fmt: skip
    for name, lengths, shape in (("list", [3, 0, 7], (10,)), ("tuple_over_batch", (1, 9), (2, 5)),
                                 ("tensor", torch.tensor([6, 4], dtype=torch.int32), (10,)),
                                 ("empty_input", [0, 0], (0,))):  # fmt: skip
        CASES.append(Case(f"moe_layers/{kind}/matches_reference_sequence_lengths_{name}",
                          functools.partial(_matches, kind, EVERYTHING, shape, lengths),
                          "ok", check=lambda v: v is True, timeout=60.0))  # fmt: skip


def _megatron_aux_loss(logits, k: int, lengths=None):
    """Megatron-Core's load-balancing loss of sigmoid routing (moe_aux_loss_coeff 1), written out: the experts
    counted are compute_routing_scores_for_aux_loss's plain top-k of the unbiased normalised scores (neither the
    expert bias nor the group limit), switch_load_balancing_loss_func over all tokens or, per sequence, averaged
    (seq_aux_loss)."""
    s = torch.sigmoid(logits.float())
    scores = s / (s.sum(-1, keepdim=True) + 1e-20)
    routing_map = torch.zeros_like(scores).scatter(1, torch.topk(scores, k=k, dim=1).indices, 1.0)
    parts = [(0, logits.shape[0])] if lengths is None else [(i * lengths, (i + 1) * lengths) for i in
                                                            range(logits.shape[0] // lengths)]  # fmt: skip
    n_e = logits.shape[1]
    losses = [(scores[a:b].sum(0) * routing_map[a:b].sum(0)).sum() * n_e / (k * (b - a) ** 2) for a, b in parts]
    return sum(losses) / len(losses)


def _megatron_parity(kind: str, load_balancing: str) -> bool:
    """With an expert bias and groups that change the selection, the layer's aux_loss is Megatron-Core's (issue 41,
    item 14: the biased selection was counted before, 0.06-7.6% apart)."""
    opts = {"expert_bias": True, "n_group": 2, "topk_group": 1, "score": "sigmoid", "aux_loss_coef": 1.0,
            "load_balancing": load_balancing}  # fmt: skip
    layer = _layer(kind, **opts)
    with torch.no_grad():
        layer.balancer.bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(2)) * 0.3)
    x = torch.randn(4, 16, H, generator=torch.Generator().manual_seed(6))
    layer(x)
    logits = x.reshape(-1, H) @ layer.router.weight.detach().t()
    plain = torch.topk(torch.sigmoid(logits), K, dim=1).indices
    if torch.equal(layer.last_routing.indices, plain):
        return False  # (the bias changed nothing: the case would test nothing)
    want = _megatron_aux_loss(logits, K, 16 if load_balancing == "seq_aux_loss" else None)
    return torch.allclose(layer.aux_loss.detach(), want, rtol=1e-5, atol=1e-7)


for kind in ("MoELayer", "ExpertParallelMoE"):
    for lb in ("aux_loss", "seq_aux_loss"):
        CASES.append(Case(f"moe_layers/{kind}/megatron_core_{lb}_with_bias_and_groups",
                          functools.partial(_megatron_parity, kind, lb), "ok", check=lambda v: v is True))  # fmt: skip


def _bias_update(kind: str) -> bool:
    """Training forwards add their counts; update_expert_bias moves the bias by rate * sign(mean - load) and
    clears them; an eval forward adds nothing."""
    layer = _layer(kind, expert_bias=True, bias_update_rate=0.25)
    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(4))
    layer.eval()
    layer(x)
    if bool(layer.balancer.load.any()):
        return False
    layer.train()
    layer(x)
    load = layer.last_routing.tokens_per_expert.clone()
    layer(x)
    got = layer.update_expert_bias()
    want = 0.25 * torch.sign(2 * load.sum() / E - 2 * load.float())
    return torch.equal(got, 2 * load) and torch.equal(layer.balancer.bias, want) and not bool(layer.balancer.load.any())


def _no_bias_update(kind: str):
    return _layer(kind).update_expert_bias()


def _from_layer_not_a_layer():
    from torsh_kernels.parallel import ExpertParallelMoE

    return ExpertParallelMoE.from_layer(torch.nn.Linear(H, H), _one_rank())


def _capacity_numpy_int(kind: str) -> bool:
    layer = _layer(kind, capacity=np.int64(2), pad_to_capacity=True)
    y = layer(torch.randn(9, H, generator=torch.Generator().manual_seed(5)))
    return y.shape == (9, H) and layer.last_routing.capacity == 2 and layer.last_routing.num_rows == 2 * E


for kind in ("MoELayer", "ExpertParallelMoE"):
    CASES += [
        Case(f"moe_layers/{kind}/update_expert_bias", functools.partial(_bias_update, kind), "ok",
             check=lambda v: v is True),
        Case(f"moe_layers/{kind}/update_expert_bias_without_expert_bias", functools.partial(_no_bias_update, kind)),
        Case(f"moe_layers/{kind}/capacity_numpy_int", functools.partial(_capacity_numpy_int, kind), "ok",
             check=lambda v: v is True),
    ]  # fmt: skip
CASES.append(Case("moe_layers/ExpertParallelMoE/from_layer_not_a_layer", _from_layer_not_a_layer))
UNALIGNED = {"expert_compute": "grouped", "ffn_hidden": 10}  # (rows of 40 bytes: not a multiple of 16)
for kind in ("MoELayer", "ExpertParallelMoE"):  # the grouped GEMM forced where the widths do not fit it
    CASES.append(Case(f"moe_layers/{kind}/expert_compute_grouped_unaligned_width",
                      functools.partial(_forward, kind, None, UNALIGNED)))  # fmt: skip


# -- BiasBalancer ------------------------------------------------------------------------------------------


def _balancer(*args, **kw):
    from torsh_kernels.parallel import BiasBalancer

    return BiasBalancer(*args, **kw)


def _observe(counts):
    b = _balancer(E)
    b.observe(counts() if callable(counts) else counts)
    return b


def _load_state(edit) -> None:
    """A checkpoint with one bad entry: refused, and the balancer's bias and counts left as they were."""
    b = _balancer(E, rate=0.1)
    b.observe(torch.tensor([3, 1, 0, 0]))
    b.step()
    b.observe(torch.tensor([1, 1, 1, 2]))
    before = (b.bias.clone(), b.load.clone())
    sd = b.state_dict()
    edit(sd)
    from torsh_kernels.errors import TorshKernelsError

    try:
        b.load_state_dict(sd)
    except TorshKernelsError:
        if not (torch.equal(b.bias, before[0]) and torch.equal(b.load, before[1])):
            raise AssertionError("the balancer changed although its checkpoint was refused") from None
        raise


def _set(key, value):
    return lambda sd: sd.__setitem__(key, value() if callable(value) else value)


def _step_rule() -> bool:
    """bias += rate * sign(mean - load) with the counts since the last step; a step with no counts moves
    nothing; integer counts of any width add up."""
    b = _balancer(E, rate=0.5)
    b.observe(torch.tensor([2, 1, 0, 0]))
    b.observe(torch.tensor([1, 0, 0, 0], dtype=torch.int32))
    b.observe(torch.tensor([0, 0, 1, 0], dtype=torch.uint8))
    load = b.step()
    first = b.bias.clone()
    b.step()
    return (
        load.tolist() == [3, 1, 1, 0]
        and first.tolist() == [-0.5, 0.5, 0.5, 0.5]  # mean 1.25
        and torch.equal(b.bias, first)
        and b.steps == 2
        and not bool(b.load.any())
    )


def _rate_0() -> torch.Tensor:
    b = _balancer(E, rate=0)
    b.observe(torch.tensor([5, 0, 0, 0]))
    b.step()
    return b.bias


def _round_trip() -> bool:
    a = _balancer(E, rate=0.1)
    a.observe(torch.tensor([3, 1, 0, 0]))
    a.step()
    a.observe(torch.tensor([0, 2, 0, 1]))
    b = _balancer(E)
    sd = a.state_dict()
    sd["bias"] = sd["bias"].double()  # a float64 checkpoint loads (into the fp32 buffer)
    b.load_state_dict(sd)
    return torch.equal(a.bias, b.bias) and torch.equal(a.load, b.load) and b.bias.dtype == torch.float32


CASES += [
    *[Case(f"moe_layers/BiasBalancer/num_experts_{n}", functools.partial(_balancer, v)) for n, v in
      (("zero", 0), ("negative", -1), ("bool", True), ("float", 4.0), ("str", "4"), ("none", None))],
    *[Case(f"moe_layers/BiasBalancer/rate_{n}", functools.partial(_balancer, E, rate=v)) for n, v in
      (("negative", -0.1), ("nan", NAN), ("inf", INF), ("bool", True), ("str", "1e-3"), ("none", None),
       ("1e308", 1e308), ("above_1", 1.5))],
    *[Case(f"moe_layers/BiasBalancer/comm_{n}", functools.partial(_balancer, E, comm=v)) for n, v in
      (("str", "nccl"), ("int", 3), ("object", object()))],
    *[Case(f"moe_layers/BiasBalancer/observe_{n}", functools.partial(_observe, v)) for n, v in
      (("list", [1, 2, 3, 4]), ("none", None), ("fp32", lambda: torch.ones(E)), ("bool", lambda: torch.ones(E) > 0),
       ("short", lambda: torch.ones(E - 1, dtype=torch.int64)), ("2d", lambda: torch.ones(1, E, dtype=torch.int64)),
       ("int32_short", lambda: torch.ones(E + 1, dtype=torch.int32)),
       ("meta", lambda: torch.ones(E, dtype=torch.int64, device="meta")),
       ("negative", lambda: torch.tensor([3, -1, 0, 0])), ("int32_negative", lambda: torch.tensor([0, 0, -7, 1],
                                                                                                  dtype=torch.int32)))],
    *[Case(f"moe_layers/BiasBalancer/load_state_dict_{n}", functools.partial(_load_state, f)) for n, f in
      (("bias_short", _set("bias", lambda: torch.zeros(E - 1))),
       ("bias_int", _set("bias", lambda: torch.zeros(E, dtype=torch.int64))),
       ("bias_nan", _set("bias", lambda: torch.tensor([0.0, NAN, 0.0, 0.0]))),
       ("bias_inf", _set("bias", lambda: torch.tensor([0.0, 0.0, INF, 0.0]))),
       ("bias_list", _set("bias", [0.0] * E)),
       ("load_negative", _set("load", lambda: torch.tensor([1, -1, 0, 0]))),
       ("load_float", _set("load", lambda: torch.ones(E))),
       ("load_2d", _set("load", lambda: torch.zeros(1, E, dtype=torch.int64))),
       ("bias_ok_load_bad", lambda sd: (sd.__setitem__("bias", torch.ones(E)),
                                        sd.__setitem__("load", torch.tensor([0, 0, -5, 0])))))],
    Case("moe_layers/BiasBalancer/step_rule", _step_rule, "ok", check=lambda v: v is True),
    Case("moe_layers/BiasBalancer/state_dict_round_trip", _round_trip, "ok", check=lambda v: v is True),
    Case("moe_layers/BiasBalancer/imbalance_without_counts_is_nan", lambda: _balancer(E).imbalance(), "ok",
         check=math.isnan),
    Case("moe_layers/BiasBalancer/rate_0_freezes", _rate_0, "ok", check=lambda bias: not bool(bias.any())),
]  # fmt: skip


# -- MoELayer.from_hf ---------------------------------------------------------------------------------------


def _from_hf(block, **overrides):
    from torsh_kernels.parallel import MoELayer

    return MoELayer.from_hf(block() if callable(block) and not isinstance(block, torch.nn.Module) else block,
                            **overrides)  # fmt: skip


CASES += [
    Case("moe_layers/MoELayer/from_hf_linear", functools.partial(_from_hf, torch.nn.Linear(4, 4))),
    Case("moe_layers/MoELayer/from_hf_none", functools.partial(_from_hf, lambda: None)),
    Case("moe_layers/MoELayer/from_hf_str", functools.partial(_from_hf, lambda: "MixtralSparseMoeBlock")),
]


def _init(block, seed: int = 1):
    """Random weights (the blocks create them empty) and a random expert bias where there is one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, buf in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.2)
    return block


def _mixtral(**cfg):
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    cfg = {"hidden_size": 16, "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
           "router_jitter_noise": 0.0, **cfg}  # fmt: skip
    return _init(MixtralSparseMoeBlock(MixtralConfig(**cfg)))


def _qwen2(**cfg):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

    cfg = {"hidden_size": 16, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12, "num_experts": 4,
           "num_experts_per_tok": 2, **cfg}  # fmt: skip
    return _init(Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(**cfg)))


def _deepseek(**cfg):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

    cfg = {"hidden_size": 16, "moe_intermediate_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "n_group": 4, "topk_group": 2, "n_shared_experts": 1, **cfg}  # fmt: skip
    return _init(DeepseekV3MoE(DeepseekV3Config(**cfg)))


def _switch(jitter: float = 0.0, **cfg):
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        SwitchTransformersConfig,
        SwitchTransformersSparseMLP,
    )

    cfg = {"d_model": 16, "d_ff": 8, "num_experts": 4, "expert_capacity": 3, "router_jitter_noise": 0.0,
           "dropout_rate": 0.0, **cfg}  # fmt: skip
    block = _init(SwitchTransformersSparseMLP(SwitchTransformersConfig(**cfg)))
    block.router.jitter_noise = jitter
    return block


def _mixtral_without_experts():
    block = _mixtral()
    block.experts = torch.nn.Linear(16, 16)
    return block


def _same_as_block(make, **overrides) -> bool:
    """from_hf's layer gives the block's output on a [B, S, H] input."""
    block = make()
    layer = _from_hf(block, **overrides)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        yb = block(x)
        yb = yb[0] if isinstance(yb, tuple) else yb
        return _close(layer(x), yb)


if importlib.util.find_spec("transformers") is not None:  # (the dev extra; without it these cases are not listed)
    CASES += [
        Case(f"moe_layers/MoELayer/from_hf_{n}", functools.partial(_from_hf, f), timeout=120.0) for n, f in (
            ("mixtral_with_jitter", lambda: _mixtral(router_jitter_noise=0.1)),
            ("mixtral_gelu", lambda: _mixtral(hidden_act="gelu")),
            ("mixtral_relu", lambda: _mixtral(hidden_act="relu")),
            ("qwen2_moe_gelu", lambda: _qwen2(hidden_act="gelu")),
            ("deepseek_v3_gelu", lambda: _deepseek(hidden_act="gelu")),
            ("switch_with_jitter", lambda: _switch(0.1)),
            ("switch_router_bias", lambda: _switch(router_bias=True)),
            ("switch_gelu_new", lambda: _switch(dense_act_fn="gelu_new")),
            ("mixtral_experts_replaced", _mixtral_without_experts),
        )
    ]  # fmt: skip
    CASES += [
        Case("moe_layers/MoELayer/from_hf_override_bad_capacity", functools.partial(_from_hf, _mixtral, capacity=-1),
             timeout=120.0),
    ]  # fmt: skip
    CASES += [
        Case(f"moe_layers/MoELayer/from_hf_{n}_matches_the_block", functools.partial(_same_as_block, f, **kw), "ok",
             check=lambda v: v is True, timeout=120.0) for n, f, kw in (
            ("mixtral", _mixtral, {}),
            ("qwen2_moe", _qwen2, {}),
            ("deepseek_v3", _deepseek, {}),
            ("switch", _switch, {}),
            ("mixtral_loop_experts", _mixtral, {"expert_compute": "loop"}),
        )
    ]  # fmt: skip


def _int_input(kind: str):
    """An integer input (issue 41, item 10): a DTypeError, not a matmul error from inside the layer."""
    layer = _layer(kind)
    return layer(torch.ones(3, H, dtype=torch.int64))


CASES += [Case(f"moe_layers/{kind}/forward_int_input", functools.partial(_int_input, kind))
          for kind in ("MoELayer", "ExpertParallelMoE")]  # fmt: skip


def _capacity_1e300_is_no_limit(kind: str) -> bool:
    """capacity_factor=1e300 (finite, so accepted) caps nothing: the output is the uncapped layer's."""
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    capped, plain = _layer(kind, capacity_factor=1e300), _layer(kind)
    return bool(torch.equal(capped(x), plain(x)))


CASES += [Case(f"moe_layers/{kind}/capacity_factor_1e300_caps_nothing", functools.partial(_capacity_1e300_is_no_limit,
               kind), "ok", check=lambda v: v is True) for kind in ("MoELayer", "ExpertParallelMoE")]  # fmt: skip
