"""FSDP2 with torsh's quantized all-gather and reduce-scatter, on real gloo processes (world sizes 2 and 4).

The comms on their own: every rank draws every rank's shard from seeded generators, so each can compute
the exact reference (quantize each shard, dequantize, sum in fp32 in rank order) and compare bit for bit.
Then training: a model under ``fully_shard`` with the quantized comms against the same model under plain
FSDP2, step by step (bounds per format), with every rank's full parameters equal after every step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import assert_named_on_every_rank
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.ops import dequantize, quantize
from torsh_kernels.parallel.fsdp import (
    RESIDUAL,
    QuantizedAllGather,
    QuantizedReduceScatter,
    apply_quantized_comm,
    encoded_nbytes,
)


def shard(case: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(case * 7919 + rank)
    return torch.randn(n, generator=g)


def error_names(calls) -> list[str | None]:
    """The typed error each call raises (its class name), or None where it raises none."""
    out = []
    for f in calls:
        try:
            f()
            out.append(None)
        except (InvalidArgumentError, ArgumentTypeError) as e:
            out.append(type(e).__name__)
    return out


def qd(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    q, s = quantize(x, bits=bits, block=block)
    return dequantize(q, s, block=block, numel=x.numel())


def _comms_worker(comm) -> dict:
    ws, me = comm.world_size, comm.rank
    group = dist.group.WORLD
    out: dict = {"ag": [], "rs": []}
    ag_cases = [(1000, 8, 256, torch.float32), (37, 8, 16, torch.float32), (301, 4, 64, torch.float32),
                (256, 8, 256, torch.bfloat16), (5, 4, 2, torch.float16)]  # fmt: skip
    for case, (n, bits, block, dtype) in enumerate(ag_cases):
        ag = QuantizedAllGather(bits=bits, block=block)
        o = ag.allocate((ws * n,), dtype=dtype, device=torch.device("cpu"))
        o.fill_(float("nan"))  # poisoned: every element must be written
        inp = o.narrow(0, me * n, n)  # as FSDP2 passes it: a view of the output
        inp.copy_(shard(case, me, n).to(dtype))
        assert ag(output_tensor=o, input_tensor=inp, group=group) is None
        ref = torch.cat([qd(shard(case, r, n).to(dtype).float(), bits, block).to(dtype) for r in range(ws)])
        exact = torch.cat([shard(case, r, n).to(dtype) for r in range(ws)])
        # at most half a code step per element, a code step being the block's absmax / 127 (int8) or / 7
        bound = exact.float().abs().max().item() / (127 if bits == 8 else 7) / 2 * 1.01 + 0.02
        out["ag"].append((torch.equal(o, ref), (o.float() - exact.float()).abs().max().item() <= bound,
                          ag.bytes_sent == (ws - 1) * encoded_nbytes(n, bits, block)))  # fmt: skip
        # async: a Work whose wait includes the dequantization
        o2 = torch.full((ws * n,), float("nan"), dtype=dtype)
        inp2 = o2.narrow(0, me * n, n)
        inp2.copy_(shard(case, me, n).to(dtype))
        work = ag(output_tensor=o2, input_tensor=inp2, group=group, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
        out["ag"][-1] += (torch.equal(o2, ref),)
    rs_cases = [(300, 8, 64, dist.ReduceOp.AVG, True), (17, 4, 8, dist.ReduceOp.SUM, False),
                (512, 8, 256, dist.ReduceOp.AVG, False), (9, 8, 4, dist._make_nccl_premul_sum(0.25), True)]  # fmt: skip
    for case, (n, bits, block, op, ef) in enumerate(rs_cases):
        rs = QuantizedReduceScatter(bits=bits, block=block, error_feedback=ef)
        results = []
        residuals = [torch.zeros(ws * n) for _ in range(ws)]
        for step in range(2):
            xs = [shard(100 + 10 * case + step, r, ws * n) for r in range(ws)]
            o = torch.full((n,), float("nan"))
            rs(output_tensor=o, input_tensor=xs[me].clone(), group=group, op=op)
            # the reference, every rank's part computed here: (x + residual) chunks quantized, the
            # chunks of this shard dequantized and summed in fp32 in rank order, then the op's factor
            total = torch.zeros(n)
            for r in range(ws):
                acc = xs[r] + residuals[r] if ef else xs[r]
                sent = [qd(c, bits, block) for c in acc.view(ws, n)]
                total += sent[me]
                if ef:
                    residuals[r] = acc - torch.cat(sent)
            scale = {dist.ReduceOp.AVG: 1.0 / ws, dist.ReduceOp.SUM: 1.0}.get(op, 0.25)
            ref = total * scale if scale != 1.0 else total
            exact = torch.stack(xs).sum(0).view(ws, n)[me] * scale
            results.append((torch.equal(o, ref), (o - exact).abs().max().item() / exact.abs().max().item()))
        out["rs"].append((results, ef and torch.equal(rs.residual, residuals[me])))
        # async: a Work whose wait includes the fp32 reduction (the same codes: no residual this time)
        plain = QuantizedReduceScatter(bits=bits, block=block, error_feedback=False)
        xs = [shard(200 + case, r, ws * n) for r in range(ws)]
        o_sync, o_async = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
        plain(output_tensor=o_sync, input_tensor=xs[me].clone(), group=group, op=op)
        work = plain(output_tensor=o_async, input_tensor=xs[me].clone(), group=group, op=op, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
        out.setdefault("rs_async", []).append(torch.equal(o_async, o_sync))
    # bad input: typed errors, before anything goes on the wire
    out["errs"] = error_names([
        lambda: QuantizedAllGather(bits=3), lambda: QuantizedReduceScatter(block=100),
        lambda: QuantizedReduceScatter(error_feedback=1), lambda: QuantizedAllGather(shard_group_size=0),
        lambda: QuantizedAllGather()(torch.zeros(6), torch.zeros(2), group),
        lambda: QuantizedReduceScatter()(torch.zeros(2), torch.zeros(2 * ws), group, dist.ReduceOp.MAX),
        lambda: QuantizedReduceScatter()(torch.zeros(2), torch.zeros(2 * ws).view(2, ws).t(), group,
                                         dist.ReduceOp.SUM),
    ])  # fmt: skip
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_comms_match_the_reference(world_size):
    for out in run_local(_comms_worker, world_size, op_timeout=60):
        for same, within, nbytes, same_async in out["ag"]:
            assert same and same_async and nbytes and within
        for results, _ in out["rs"]:
            for same, rel in results:
                assert same and rel < 0.2
        assert [r[1] for r in out["rs"]] == [True, False, False, True]  # the residuals where kept
        assert out["rs_async"] == [True] * 4
        assert out["errs"] == ["InvalidArgumentError", "InvalidArgumentError", "ArgumentTypeError",
                               "InvalidArgumentError", "InvalidArgumentError", "InvalidArgumentError",
                               "InvalidArgumentError"]  # fmt: skip


# -- training under fully_shard -------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 61), nn.ReLU(), nn.Linear(61, 33), nn.ReLU(), nn.Linear(33, 5))


def _shard(model: nn.Module, mesh, **kw) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _train_worker(comm, weights, grads, steps) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore", FutureWarning)
    ws, me = comm.world_size, comm.rank
    mesh = init_device_mesh("cpu", (ws,))
    plain, quant = _shard(_model(), mesh), _shard(_model(), mesh)
    changed = apply_quantized_comm(quant, weights=weights, grads=grads)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.05)
    opt_q = torch.optim.SGD(quant.parameters(), lr=0.05)
    start = _full(plain)
    gen = torch.Generator().manual_seed(1234 + me)
    target = torch.randn(24, 5, generator=torch.Generator().manual_seed(99))  # a learnable task, shared
    out = {"changed": len(changed), "loss_p": [], "loss_q": [], "param_diff": [], "replicas_equal": []}
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen)
        y = torch.tanh(x @ target)
        for model, opt, key in ((plain, opt_p, "loss_p"), (quant, opt_q, "loss_q")):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out[key].append(loss.item())
        fp, fq = _full(plain), _full(quant)
        # how far from plain FSDP2's parameters, relative to how far those moved from the start
        out["param_diff"].append(((fp - fq).abs().max() / (fp - start).abs().max()).item())
        gathered = [torch.empty_like(fq) for _ in range(ws)]
        dist.all_gather(gathered, fq)
        out["replicas_equal"].append(all(torch.equal(g, gathered[0]) for g in gathered))
    sd = quant.state_dict()
    out["residual_keys"] = sorted(k for k in sd if k.endswith(RESIDUAL))
    return out


@pytest.mark.parametrize(
    ("world_size", "weights", "grads", "bound"),
    [
        (2, "int8", "int8", 0.06),
        (2, None, "int4", 0.15),
        (4, "int8", None, 0.06),
        (4, "int4", "int4", 0.15),
        (2, "fp8", "fp8", 0.1),
        (3, "fp8:e5m2", "fp8:e4m3", 0.15),
    ],
)
def test_fsdp2_training_with_quantized_comms(world_size, weights, grads, bound):
    # SGD, so the parameters' distance from plain FSDP2's follows the gradients' (and the weights') error
    for out in run_local(_train_worker, world_size, weights, grads, 6, op_timeout=120):
        assert out["changed"] == 3  # the three Linear layers (the root holds no parameter of its own)
        assert all(out["replicas_equal"])
        assert max(out["param_diff"]) < bound, out["param_diff"]
        for lq, lp in zip(out["loss_q"], out["loss_p"]):
            assert abs(lq - lp) < 0.02 * lp
        assert len(out["residual_keys"]) == (3 if grads else 0)


class _Tied(nn.Module):
    """An embedding whose weight is also the output layer's (GPT-2, Llama with tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(37, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 37, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.emb(idx))))


def _tied_worker(comm) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (comm.world_size,))
    model = _Tied()
    fully_shard(model.mid, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds the tied weight once
    installed = apply_quantized_comm(model, weights=None, grads="int8")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(comm.rank)
    losses = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*residual.*")  # no fallback to a residual of its own
        for _ in range(3):
            idx = torch.randint(0, 37, (8, 5), generator=gen)
            loss = nn.functional.cross_entropy(model(idx).reshape(-1, 37), idx.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    (root,) = [i for i in installed if i.module is model]
    res = getattr(model, RESIDUAL)
    return {"calls": [i.reduce_scatter.calls for i in installed], "losses": losses,
            "residual_numel": res.to_local().numel(), "residual_is_the_buffer":
            root.reduce_scatter.residual.data_ptr() == res.to_local().data_ptr()}  # fmt: skip


def test_a_tied_parameter_is_counted_once_in_the_residual():
    # GPT-2's wte.weight is lm_head.weight: the residual had room for it twice (13952 where the reduce-scatter input
    # is 7808 on 2 ranks) and the reduce-scatter refused it, or before that kept a private residual no checkpoint held
    for out in run_local(_tied_worker, 2, op_timeout=120):
        assert out["calls"] == [3, 3]
        assert out["residual_numel"] == 38 * 16  # the reduce-scatter input: the tied weight once, 37 rows padded to 38
        assert out["residual_is_the_buffer"]


def _resume_worker(comm, path, mixed, hsdp) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    warnings.simplefilter("ignore", FutureWarning)
    ws, me = comm.world_size, comm.rank
    # hsdp: FSDP2's native HSDP, the residual a DTensor sharded over both dimensions of the 2-D mesh
    mesh = (
        init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (ws,))
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None

    def prepared():
        model = _model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        fully_shard(model, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        apply_quantized_comm(model, weights="int8", grads="int4")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    target = torch.randn(24, 5, generator=torch.Generator().manual_seed(99))

    def run(model, opt, steps):
        for s in steps:
            x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1000 * s + me))
            nn.functional.mse_loss(model(x).float(), torch.tanh(x @ target)).backward()
            opt.step()
            opt.zero_grad()

    model, opt = prepared()
    run(model, opt, range(3))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    res_at_save = [getattr(m, RESIDUAL).to_local().clone() for m in model.modules() if hasattr(m, RESIDUAL)]
    run(model, opt, range(3, 6))
    uninterrupted = _full(model)

    model2, opt2 = prepared()
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    res_loaded = [getattr(m, RESIDUAL).to_local().clone() for m in model2.modules() if hasattr(m, RESIDUAL)]
    run(model2, opt2, range(3, 6))
    return {
        "residuals_restored": len(res_loaded) == 3
        and all(torch.equal(a, b) for a, b in zip(res_at_save, res_loaded))
        and any(a.abs().sum() > 0 for a in res_loaded),
        "same": torch.equal(uninterrupted, _full(model2)),
    }


@pytest.mark.parametrize(
    ("world_size", "mixed", "hsdp"),
    [(2, False, False), (2, True, False), (4, False, True)],
    ids=["fp32", "bf16-params", "native-hsdp-2x2"],
)
def test_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path, world_size, mixed, hsdp):
    # the error-feedback residuals (one per rank, different on each) are saved and restored through
    # torch.distributed.checkpoint with the model, so the resumed run is the uninterrupted one, bit for bit
    for out in run_local(_resume_worker, world_size, str(tmp_path / "ckpt"), mixed, hsdp, op_timeout=120):
        assert out["residuals_restored"] and out["same"]


# -- DeviceMesh where a process group is taken; DTensors where plain tensors are needed -------------------


def _mesh_worker(comm) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torsh_kernels.collectives import TorchCommunicator
    from torsh_kernels.parallel import CompressionHookState, ParameterOffloader

    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank
    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp", 0, 1):
        c = TorchCommunicator(mesh, dim=dim)
        x = torch.full((3,), float(me))
        c.all_reduce(x)
        out[f"sum_{dim}"] = x[0].item()
        out[f"ranks_{dim}"] = c.global_ranks
    flat = init_device_mesh("cpu", (4,))
    out["flat_ws"] = TorchCommunicator(flat).world_size
    out["errs"] = error_names([
        lambda: TorchCommunicator(mesh), lambda: TorchCommunicator(mesh, dim="pp"),
        lambda: TorchCommunicator(mesh, dim=2), lambda: TorchCommunicator(dist.group.WORLD, dim="dp"),
        lambda: TorchCommunicator("dp"),
    ])  # fmt: skip
    st = CompressionHookState(mesh, mesh_dim="tp")
    out["hook_group_size"] = dist.get_world_size(st.process_group)
    pair = CompressionHookState((mesh, "dp"))  # a (mesh, dim) pair where a group is taken
    out["hook_pair_ranks"] = dist.get_process_group_ranks(pair.process_group)
    out["pair_errs"] = error_names([lambda: TorchCommunicator((mesh, "dp"), dim="tp")])
    dt = distribute_tensor(torch.arange(8.0), flat, [Shard(0)])
    try:
        TorchCommunicator(flat).all_reduce(dt)
        out["dtensor"] = None
    except ArgumentTypeError as e:
        out["dtensor"] = str(e)
    model = _shard(_model(), flat)
    try:
        ParameterOffloader(model)
        out["offloader"] = None
    except InvalidArgumentError as e:
        out["offloader"] = str(e)
    from torsh_kernels.compression import TopK, compressed_all_reduce
    from torsh_kernels.parallel import GradientSynchronizer

    try:
        GradientSynchronizer(model, TorchCommunicator(flat))
        out["sync"] = None
    except InvalidArgumentError as e:
        out["sync"] = str(e)
    try:
        compressed_all_reduce(dt, TorchCommunicator(flat), TopK(0.5), TopK(0.5).new_state())
        out["car"] = None
    except ArgumentTypeError as e:
        out["car"] = str(e)
    # a DeviceMesh (with its dimension) or a process group where a communicator is taken
    from torsh_kernels.parallel import ExpertParallelMoE

    x = torch.full((5,), float(me))
    compressed_all_reduce(x, (mesh, "tp"))
    out["car_tp"] = x[0].item()
    x = torch.full((5,), float(me))
    compressed_all_reduce(x, flat)
    out["car_flat"] = x[0].item()
    torch.manual_seed(me)  # different replicas: the synchronizer broadcasts rank 0's of its group
    lin = nn.Linear(4, 3)
    sync = GradientSynchronizer(lin, mesh, mesh_dim="dp")
    lin(torch.full((2, 4), float(me + 1))).sum().backward()
    sync.wait()
    out["sync_weight"] = lin.weight.detach().clone()
    out["sync_grad"] = lin.weight.grad.clone()
    moe = ExpertParallelMoE(8, 16, 4, 2, (mesh, "tp"))
    y = moe(torch.randn(6, 8, generator=torch.Generator().manual_seed(me)))
    out["moe"] = (moe.comm.world_size, moe.local_experts, moe.first_expert, tuple(y.shape))
    out["moe_pg"] = ExpertParallelMoE(8, 16, 4, 2, dist.group.WORLD).local_experts
    out["comm_errs"] = error_names([
        lambda: GradientSynchronizer(lin, "dp"), lambda: GradientSynchronizer(lin, mesh),
        lambda: GradientSynchronizer(lin, TorchCommunicator(), mesh_dim="dp"),
        lambda: ExpertParallelMoE(8, 16, 4, 2, (mesh, "dp"), mesh_dim="tp"),
        lambda: compressed_all_reduce(torch.ones(3), None),
    ])  # fmt: skip
    return out


def test_device_mesh_is_accepted_and_dtensors_get_typed_errors():
    res = run_local(_mesh_worker, 4, op_timeout=60)
    for me, out in enumerate(res):
        # mesh [[0, 1], [2, 3]]: "dp" groups ranks down a column, "tp" along a row
        dp = [me % 2, me % 2 + 2]
        tp = [me - me % 2, me - me % 2 + 1]
        assert out["ranks_dp"] == out["ranks_0"] == dp and out["sum_dp"] == out["sum_0"] == sum(dp)
        assert out["ranks_tp"] == out["ranks_1"] == tp and out["sum_tp"] == out["sum_1"] == sum(tp)
        assert out["flat_ws"] == 4 and out["hook_group_size"] == 2
        assert out["hook_pair_ranks"] == dp and out["pair_errs"] == ["InvalidArgumentError"]
        assert out["errs"] == ["InvalidArgumentError", "InvalidArgumentError", "InvalidArgumentError",
                               "InvalidArgumentError", "ArgumentTypeError"]  # fmt: skip
        assert "DTensor" in out["dtensor"] and "to_local()" in out["dtensor"]
        assert "CPUOffloadPolicy" in out["offloader"]
        assert "DTensor" in out["sync"] and "apply_quantized_comm" in out["sync"]
        assert out["car"].startswith("compressed_all_reduce: tensor is a DTensor")
        # averages over the mesh dimension's group: "tp" (a row) and the flat mesh (all four ranks)
        assert out["car_tp"] == sum(tp) / 2 and out["car_flat"] == 1.5
        # the synchronizer over "dp": rank 0 of the column's weights, the column's average gradient
        col = [res[r] for r in dp]
        assert torch.equal(out["sync_weight"], col[0]["sync_weight"]) and torch.equal(
            out["sync_weight"], col[1]["sync_weight"]
        )
        assert torch.allclose(
            out["sync_grad"], torch.full((3, 4), 2.0 * (dp[0] + 1 + dp[1] + 1) / 2)
        )  # 2 rows of (rank + 1)
        assert out["moe"] == (2, 2, 2 * (me % 2), (6, 8)) and out["moe_pg"] == 1
        assert out["comm_errs"] == ["ArgumentTypeError", "InvalidArgumentError", "InvalidArgumentError",
                                    "InvalidArgumentError", "ArgumentTypeError"]  # fmt: skip


# -- ZeRO-3 with the optimizer on the host: OffloadedOptimizer over FSDP2's shards -------------------------


def _offload_worker(comm, path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_kernels.parallel import OffloadedOptimizer

    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank
    mesh = init_device_mesh("cpu", (comm.world_size,))
    target = torch.randn(24, 5, generator=torch.Generator().manual_seed(99))

    def run(model, opt, steps):
        for s in steps:
            x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1000 * s + me))
            nn.functional.mse_loss(model(x), torch.tanh(x @ target)).backward()
            opt.step()
            opt.zero_grad()

    out = {}
    # fp32 state: the same as AdamW on the same sharded model, bit for bit
    ref, mod = _shard(_model(), mesh), _shard(_model(), mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    off = OffloadedOptimizer(mod.parameters(), torch.optim.AdamW, "fp32", lr=1e-2, weight_decay=0.1, chunk_mb=0.004)
    out["chunks"] = len(off._chunks)
    run(ref, ref_opt, range(4))
    run(mod, off, range(4))
    out["fp32_equal"] = torch.equal(_full(ref), _full(mod))
    # packed state through torch.distributed.checkpoint: the resumed run is the uninterrupted one
    out["resumed"] = {}
    for fmt in ("bf16", "int8"):
        a = _shard(_model(), mesh)
        opt_a = OffloadedOptimizer(a.parameters(), torch.optim.AdamW, fmt, lr=1e-2, chunk_mb=0.004)
        run(a, opt_a, range(3))
        msd, osd = get_state_dict(a, opt_a)
        out["state_is_sharded"] = all(
            type(v).__name__ == "DTensor" for s in osd["state"].values() for k, v in s.items() if k != "step"
        )
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}-{fmt}")
        at_save = _full(a)
        run(a, opt_a, range(3, 6))
        b = _shard(_model(), mesh)
        opt_b = OffloadedOptimizer(b.parameters(), torch.optim.AdamW, fmt, lr=1e-2, chunk_mb=0.004)
        msd_b, osd_b = get_state_dict(b, opt_b)
        st = {"model": msd_b, "optim": osd_b}
        dcp.load(st, checkpoint_id=f"{path}-{fmt}")
        set_state_dict(b, opt_b, model_state_dict=st["model"], optim_state_dict=st["optim"])
        run(b, opt_b, range(3, 6))
        fa, fb = _full(a), _full(b)
        out["resumed"][fmt] = (torch.equal(fa, fb), ((fa - fb).abs().max() / (fa - at_save).abs().max()).item())
    out["state_bytes"] = opt_b.stats["state_bytes"]
    return out


def test_offloaded_optimizer_on_fsdp2_shards(tmp_path):
    for out in run_local(_offload_worker, 2, str(tmp_path / "ckpt"), op_timeout=120):
        assert out["chunks"] > 1  # several chunks of shards, pipelined as on an unsharded model
        assert out["fp32_equal"], "fp32 state should equal AdamW on the same sharded model bit for bit"
        assert out["state_is_sharded"]
        assert out["resumed"]["bf16"][0]
        # int8: re-quantizing the square root of a dequantized square may move a code by one
        assert out["resumed"]["int8"][1] < 1e-3, out["resumed"]
        assert out["state_bytes"] > 0


# -- HSDP: FSDP2 over the shard dimension, the replicas' all-reduce compressed through the all-reduce hook -


def _hsdp_worker(comm) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_kernels.collectives import TorchCommunicator
    from torsh_kernels.compression import FP16, NoCompression, TopK

    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    target = torch.randn(24, 5, generator=torch.Generator().manual_seed(99))

    def run(model, steps=4):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        start = _full(model)
        for s in range(steps):
            x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1000 * s + me))
            nn.functional.mse_loss(model(x), torch.tanh(x @ target)).backward()
            opt.step()
            opt.zero_grad()
        return start, _full(model)

    def against(model, start, ref) -> dict:
        """Train ``model``; how far from ``ref`` relative to how far ``ref`` moved from ``start``, and
        whether the full parameters agree across all four ranks (both replicas of both shards)."""
        _, got = run(model)
        gathered = [torch.empty_like(got) for _ in range(comm.world_size)]
        dist.all_gather(gathered, got)
        rel = ((got - ref).abs().max() / (ref - start).abs().max()).item()
        return {"rel": rel, "replicas_equal": all(torch.equal(g, gathered[0]) for g in gathered), "params": got}

    native = _shard(_model(), mesh)  # FSDP2's own HSDP: a 2-D mesh, its all-reduce over "replicate"
    start, ref = run(native)
    out = {}
    for name, comp in (("none", NoCompression()), ("fp16", FP16()), ("topk", TopK(0.25))):
        model = _shard(_model(), mesh["shard"])
        inst = apply_quantized_comm(model, weights=None, grads=None, hsdp_grads=comp,
                                    replicate=(mesh, "replicate"))  # fmt: skip
        out[name] = against(model, start, ref)
        out[name]["hook_calls"] = sum(i.replica_all_reduce.calls for i in inst)
    # the replicas' dimension found from the mesh the model is sharded over (the other one of the 2-D mesh)
    model = _shard(_model(), mesh["shard"])
    apply_quantized_comm(model, weights=None, grads=None, hsdp_grads=FP16())
    _, got = run(model)
    out["fp16_inferred_equal"] = torch.equal(got, out["fp16"]["params"])
    # FSDP2's native HSDP with the quantized all-gather and reduce-scatter (over the shard dimension; FSDP2
    # all-reduces over the replicas itself) against the same without them
    model = _shard(_model(), mesh)
    inst = apply_quantized_comm(model, weights="int8", grads="int4")
    out["native_q"] = against(model, start, ref)
    out["native_q"]["rs_calls"] = [i.reduce_scatter.calls for i in inst]
    flat = init_device_mesh("cpu", (comm.world_size,))
    # ZeRO++'s hpZ in FSDP2's terms: reshard after forward to groups of 2 (a node), so the backward
    # all-gather runs within the pair
    start_f, ref_f = run(_shard(_model(), flat))
    model = _shard(_model(), flat, reshard_after_forward=2)
    inst = apply_quantized_comm(model, weights="int8", grads="int4")
    out["hpz"] = against(model, start_f, ref_f)
    out["hpz"]["ag_calls"] = [(i.all_gather.calls, i.all_gather.plain_calls) for i in inst]
    model = _shard(_model(), mesh["shard"])
    out["errs"] = error_names(
        (lambda kw=kw, m=m: apply_quantized_comm(m, weights=None, grads=None, **kw))
        for m, kw in (
            (model, {"replicate": (mesh, "replicate")}),
            (model, {"hsdp_grads": 16, "replicate": (mesh, "replicate")}),  # ("fp16", a name, is accepted)
            (model, {"hsdp_grads": FP16(), "replicate": 3}),
            (_shard(_model(), mesh), {"hsdp_grads": FP16()}),  # native HSDP: FSDP2 would all-reduce as well
            (_shard(_model(), flat), {"hsdp_grads": FP16()}),  # a 1-D mesh of its own: which replicas?
        )
    )  # fmt: skip
    out["comm_ok"] = TorchCommunicator(mesh, dim="replicate").world_size == 2
    return out


def test_hsdp_replica_all_reduce_compressed_through_the_hook():
    for out in run_local(_hsdp_worker, 4, op_timeout=120):
        # uncompressed: FSDP2's own HSDP up to summation order; fp16 and top-k within their error
        assert out["none"]["rel"] <= 1e-6, out["none"]["rel"]  # (measured: 0.0)
        assert 0 < out["fp16"]["rel"] < 2e-3, out["fp16"]["rel"]  # (1.5e-4)
        assert 0 < out["topk"]["rel"] < 0.2, out["topk"]["rel"]  # (0.036)
        for name in ("none", "fp16", "topk"):
            assert out[name]["replicas_equal"] and out[name]["hook_calls"] == 4 * 3  # 4 steps x 3 layers
        assert out["fp16_inferred_equal"]
        q = out["native_q"]
        assert q["replicas_equal"] and 0 < q["rel"] < 0.06, q["rel"]  # (measured: 0.019)
        assert q["rs_calls"] == [4, 4, 4]  # one reduce-scatter per layer per step
        h = out["hpz"]
        assert h["replicas_equal"] and 0 < h["rel"] < 0.06, h["rel"]  # (0.018)
        # per layer per step: forward over 4 ranks, quantized; backward within the pair, the forward's
        # dequantized weights as they are (what forward used, in full precision over the fast link)
        assert h["ag_calls"] == [(8, 4)] * 3
        assert out["errs"] == ["InvalidArgumentError", "ArgumentTypeError", "ArgumentTypeError",
                               "InvalidArgumentError", "InvalidArgumentError"]  # fmt: skip


# -- the quantized comms over a torsh Communicator instead of FSDP2's group ---------------------------------------


def _comm_transport_worker(comm) -> dict:
    """The payload through a Communicator object (here the gloo TorchCommunicator, through the same
    generic path CupyNcclCommunicator and RdmaCommunicator take) gives what FSDP2's group gives, bit for
    bit, sync and async; FSDP2 training with apply_quantized_comm(comm=) matches it step for step."""
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_kernels.collectives import TorchCommunicator

    warnings.simplefilter("ignore", FutureWarning)
    ws, me = comm.world_size, comm.rank
    group = dist.group.WORLD
    c = TorchCommunicator()
    out = {}
    n = 301
    for via in (None, c):
        ag = QuantizedAllGather(bits=8, block=64, comm=via)
        o = torch.full((ws * n,), float("nan"))
        o.narrow(0, me * n, n).copy_(shard(7, me, n))
        ag(o, o.narrow(0, me * n, n), group)
        o2 = torch.full((ws * n,), float("nan"))
        o2.narrow(0, me * n, n).copy_(shard(7, me, n))
        work = ag(o2, o2.narrow(0, me * n, n), group, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
        rs = QuantizedReduceScatter(bits=4, block=8, error_feedback=True, comm=via)
        r1, r2 = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
        rs(r1, shard(8, me, ws * n), group, dist.ReduceOp.AVG)
        rs(r2, shard(9, me, ws * n), group, dist.ReduceOp.AVG, async_op=True).wait()
        out["group" if via is None else "comm"] = (o, o2, r1, r2, rs.residual.clone())
    out["same"] = all(torch.equal(a, b) for a, b in zip(out.pop("group"), out.pop("comm")))
    mesh = init_device_mesh("cpu", (ws,))
    a, b = _shard(_model(), mesh), _shard(_model(), mesh)
    apply_quantized_comm(a, weights="int8", grads="int4")
    apply_quantized_comm(b, weights="int8", grads="int4", comm=c)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.05), torch.optim.SGD(b.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5 + me)
    for _ in range(3):
        x = torch.randn(8, 24, generator=gen)
        for m, opt in ((a, oa), (b, ob)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    out["train_same"] = torch.equal(_full(a), _full(b))
    # a communicator of another size is refused before anything moves (and before the residual changes)
    other = type("Other", (), {"world_size": ws + 1, "all_gather": None, "all_to_all": None})()
    rs = QuantizedReduceScatter(comm=other, residual=torch.zeros(2 * ws))
    out["errs"] = error_names([
        lambda: QuantizedAllGather(comm="nccl"),
        lambda: QuantizedReduceScatter(comm=3),
        lambda: rs(torch.zeros(2), torch.ones(2 * ws), group, dist.ReduceOp.SUM),
    ])  # fmt: skip
    out["residual_kept"] = torch.equal(rs.residual, torch.zeros(2 * ws))
    return out


def test_quantized_comms_over_a_given_communicator():
    for out in run_local(_comm_transport_worker, 2, op_timeout=60):
        assert out["same"] and out["train_same"]
        assert out["errs"] == ["ArgumentTypeError", "ArgumentTypeError", "InvalidArgumentError"]
        assert out["residual_kept"]


def _mismatch_worker(comm) -> dict:
    """Every way two ranks' quantized comms can differ, one after another in one job (each exchange raises on
    every rank before the comm's collective, so the group stays usable), apply_quantized_comm's settings
    included (nothing is installed then); then the exchanges a matching configuration makes."""
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_kernels.errors import CollectiveMismatchError

    me, odd, n, group = comm.rank, comm.rank == 1, 64, dist.group.WORLD

    def ag(comm_, dtype=torch.float32):
        o = torch.zeros(2 * n, dtype=dtype)
        x = o.narrow(0, me * n, n)
        x.copy_(shard(0, me, n).to(dtype))
        comm_(o, x, group)
        return o

    def rs(comm_, op=dist.ReduceOp.AVG):
        comm_(torch.zeros(n), shard(1, me, 2 * n), group, op)

    mesh = init_device_mesh("cpu", (2,))
    model = _shard(_model(), mesh)
    cases = {
        "ag_bits": lambda: ag(QuantizedAllGather(bits=4 if odd else 8)),
        "ag_block": lambda: ag(QuantizedAllGather(block=64 if odd else 256)),
        "ag_dtype": lambda: ag(QuantizedAllGather(), torch.bfloat16 if odd else torch.float32),
        "ag_path": lambda: ag(QuantizedAllGather(shard_group_size=4 if odd else None)),  # 2 < 4: unquantized
        "rs_bits": lambda: rs(QuantizedReduceScatter(bits=4 if odd else 8)),
        "rs_error_feedback": lambda: rs(QuantizedReduceScatter(error_feedback=not odd)),
        "rs_op": lambda: rs(QuantizedReduceScatter(), dist.ReduceOp.SUM if odd else dist.ReduceOp.AVG),
        "apply": lambda: apply_quantized_comm(model, grads="int4" if odd else "int8"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except CollectiveMismatchError as e:
            out[name] = str(e)
    out["untouched"] = all(getattr(m, RESIDUAL, None) is None for m in model.modules())
    same = QuantizedAllGather()
    results = [ag(same) for _ in range(3)]
    out["matching"] = (same.signature_checks, same.calls, all(torch.equal(r, results[0]) for r in results))
    out["installed"] = len(apply_quantized_comm(model, grads="int8"))
    return out


def test_ranks_whose_quantized_comms_differ_all_raise_naming_the_difference():
    named = {"ag_bits": "format.bits: 8 on rank 0, 4 on rank 1", "ag_block": "block: 256 on rank 0, 64 on rank 1",
             "ag_dtype": "dtype: torch.float32 on rank 0, torch.bfloat16 on rank 1",
             "ag_path": "path: quantized on rank 0, unquantized on rank 1",
             "rs_bits": "format.bits: 8 on rank 0, 4 on rank 1",
             "rs_error_feedback": "error_feedback: True on rank 0, False on rank 1",
             "rs_op": "reduce scale: 0.5 on rank 0, 1.0 on rank 1",
             "apply": "grads: int8 on rank 0, int4 on rank 1"}  # fmt: skip
    out = run_local(_mismatch_worker, 2, op_timeout=30)
    assert_named_on_every_rank(out, named)
    for res in out:
        assert res["untouched"]  # the mismatched apply_quantized_comm installed nothing
        assert res["matching"] == (1, 3, True)  # one exchange for three calls of one configuration
        assert res["installed"] == 3  # the three layers (the root holds no parameter of its own)


def test_what_apply_installs_prints_short():
    """Installed names its module by class (not its whole tree); the comms print their traffic counters."""
    from torsh_kernels.collectives.replica import ReplicaCommunicator
    from torsh_kernels.compression import FP16
    from torsh_kernels.parallel.fsdp import Installed, ReplicaAllReduce

    ag, rs = QuantizedAllGather(bits=4), QuantizedReduceScatter(bits=8)
    ag.calls, ag.plain_calls, ag.bytes_sent = 12, 4, 3 * 2**20
    rs.calls, rs.bytes_sent = 6, 5 * 2**10
    rep = ReplicaAllReduce(ReplicaCommunicator(2), FP16())
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)])
    inst = Installed(model, ag, rs, rep)
    r = repr(inst)
    assert len(repr(model)) > 5000 and len(r) <= 400 and "\n" not in r, r
    assert r.startswith("Installed(module=Sequential, all_gather=QuantizedAllGather(bits=4"), r
    for fig in ("calls=12, plain_calls=4, sent 3 MiB", "QuantizedReduceScatter(bits=8", "calls=6, sent 5 KiB",
                "ReplicaAllReduce(compressor=FP16(", "world_size=2, calls=0"):  # fmt: skip
        assert fig in r, (fig, r)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_fp8_wire_round_trips_as_the_fp8_compressor_within_the_formats_bound(fmt):
    """An fp8 payload (``Wire(fmt=...)``) is the FP8 compressor's packed rows: decoded, each element within 2**-4
    (e4m3) or 2**-3 (e5m2) of itself plus half the smallest subnormal step of its block's scale; accumulate and
    alpha as the int formats; a non-finite element raises before anything is written."""
    from torsh_kernels.compression import FP8
    from torsh_kernels.errors import NonFiniteError
    from torsh_kernels.parallel.fsdp_format import Wire

    g = torch.Generator().manual_seed(5)
    n, block = 1000, 64
    x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)
    w = Wire(n, 8, block, fmt)
    assert w.total == -(-(16 * (block + 4)) // 8) * 8 and encoded_nbytes(n, 8, block, fmt) == w.total
    seg = torch.full((w.total,), 0xA5, dtype=torch.uint8)
    w.encode(x, seg)
    c = FP8(fmt, block, error_feedback=False)
    assert torch.equal(seg[: w.qbytes], c.compress(x, c.new_state()).tensors["rows"].view(-1))
    out = torch.full((n,), float("nan"))
    w.decode(seg, out)
    rel, m, bias, fmax = (2.0**-4, 3, 7, 448.0) if fmt == "e4m3" else (2.0**-3, 2, 15, 57344.0)
    s = torch.nn.functional.pad(x.abs(), (0, 16 * block - n)).view(16, block).amax(1).repeat_interleave(block)[:n]
    assert bool(((out - x).abs() <= rel * x.abs() + 2.0 ** (-bias - m) * s / fmax + 1e-7 * s).all())
    acc = torch.ones(n)
    w.decode(seg, acc, accumulate=True, alpha=-1.0)
    assert torch.allclose(acc, 1 - out)
    bad = x.clone()
    bad[7] = float("inf")
    seg2 = seg.clone()
    with pytest.raises(NonFiniteError):
        w.encode(bad, seg2)
    assert torch.equal(seg2, seg)
