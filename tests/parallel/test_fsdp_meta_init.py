"""FSDP2 quantized comms on a model built on the meta device (torchtitan's flow: build on meta, ``fully_shard``,
``apply_quantized_comm``, ``to_empty``, init): the error-feedback residual buffers are then uninitialised memory, so
a reduce-scatter refuses them (typed) until :func:`reset_residuals` zeroes them or a checkpoint is loaded, and the
residual the comm uses is the module's buffer (the one the state_dict saves), not a private copy."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from torsh_kernels.collectives import run_local
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.parallel.fsdp import RESIDUAL, apply_quantized_comm, reset_residuals


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 61), nn.ReLU(), nn.Linear(61, 33), nn.ReLU(), nn.Linear(33, 5))


def _prepared(mesh, meta: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    if meta:
        with torch.device("meta"):
            model = _model()
    else:
        model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply_quantized_comm(model, grads="int8")
    return model


def _copy_params(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters(), strict=True):
            a.to_local().copy_(b.to_local())


def _residuals(model: nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [getattr(m, RESIDUAL).to_local().clone() for m in model.modules() if RESIDUAL in m._buffers]


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _step(model: nn.Module, opt, s: int, me: int) -> None:
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1000 * s + me))
    target = torch.randn(24, 5, generator=torch.Generator().manual_seed(99))
    nn.functional.mse_loss(model(x), torch.tanh(x @ target)).backward()
    opt.step()
    opt.zero_grad()


def _meta_worker(comm, path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank
    mesh = init_device_mesh("cpu", (comm.world_size,))
    out: dict = {}
    ref = _prepared(mesh, meta=False)  # built on the CPU: its residuals are zeros from the start

    # materialised but neither reset nor loaded: the first reduce-scatter refuses the uninitialised residual
    bare = _prepared(mesh, meta=True)
    try:
        reset_residuals(bare)
    except InvalidArgumentError as e:
        out["reset_on_meta"] = str(e)
    bare.to_empty(device="cpu")
    _copy_params(bare, ref)
    with torch.no_grad():
        for m in bare.modules():
            if RESIDUAL in m._buffers:
                m._buffers[RESIDUAL].to_local().fill_(float("nan"))  # what uninitialised memory may hold
    opt = torch.optim.SGD(bare.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _step(bare, opt, 0, me)
        except InvalidArgumentError as e:
            out["unreset"] = str(e)
    out["warnings"] = [str(w.message) for w in caught if "residual" in str(w.message)]

    # reset after to_empty: the same run as the model built on the CPU, bit for bit, residuals included, and the
    # residual the comm updates is the module's buffer (what the state_dict saves)
    model = _prepared(mesh, meta=True)
    model.to_empty(device="cpu")
    _copy_params(model, ref)
    out["reset_count"] = reset_residuals(model)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    for s in range(3):
        _step(model, opt_m, s, me)
        _step(ref, opt_r, s, me)
    res_m, res_r = _residuals(model), _residuals(ref)
    out["same_params"] = torch.equal(_full(model), _full(ref))
    out["same_residuals"] = len(res_m) == 3 and all(torch.equal(a, b) for a, b in zip(res_m, res_r))
    out["residuals_nonzero"] = all(bool(r.abs().sum() > 0) for r in res_m)

    # a checkpoint loaded into a fresh meta-built model (no reset) restores the residuals, and the resumed run
    # is the uninterrupted one
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    resumed = _prepared(mesh, meta=True)
    resumed.to_empty(device="cpu")
    state = {"model": get_model_state_dict(resumed)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(resumed, state["model"])
    out["restored"] = all(torch.equal(a, b) for a, b in zip(_residuals(resumed), res_m))
    opt_x = torch.optim.SGD(resumed.parameters(), lr=0.05)
    for s in range(3, 5):
        _step(model, opt_m, s, me)
        _step(resumed, opt_x, s, me)
    out["resumed_same"] = torch.equal(_full(model), _full(resumed))
    out["resumed_residuals"] = all(torch.equal(a, b) for a, b in zip(_residuals(resumed), _residuals(model)))
    return out


@pytest.mark.slow  # 2 spawned ranks
def test_a_meta_built_model_needs_its_residuals_reset_or_loaded(tmp_path):
    for out in run_local(_meta_worker, 2, str(tmp_path / "ckpt"), op_timeout=60):
        assert "meta device" in out["reset_on_meta"]
        # neither used silently (a fresh residual the state_dict lacks, with a warning) nor NaN-garbage
        assert "reset_residuals" in out.get("unreset", ""), out
        assert out["warnings"] == []
        assert out["reset_count"] == 3
        assert out["same_params"] and out["same_residuals"] and out["residuals_nonzero"]
        assert out["restored"] and out["resumed_same"] and out["resumed_residuals"]


def test_reset_residuals_takes_a_module():
    with pytest.raises(ArgumentTypeError):
        reset_residuals("model")
    assert reset_residuals(nn.Linear(2, 2)) == 0  # nothing installed: nothing to reset


def _grouped_worker(comm) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore", FutureWarning)
    mesh = init_device_mesh("cpu", (comm.world_size,))

    def prepared(quantized: bool):
        model = _model()
        fully_shard([model[0], model[2]], mesh=mesh)  # one parameter group for two modules (torchtitan's norm + output)
        fully_shard(model[4], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, (apply_quantized_comm(model, weights="int8", grads="int8") if quantized else None)

    plain, _ = prepared(False)
    quant, installed = prepared(True)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.05)
    opt_q = torch.optim.SGD(quant.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            _step(plain, opt_p, s, comm.rank)
            _step(quant, opt_q, s, comm.rank)
    fp, fq = _full(plain), _full(quant)
    return {
        "installed": [type(i.module).__name__ for i in installed],
        "rs_calls": [i.reduce_scatter.calls for i in installed],
        "ag_calls": [i.all_gather.calls for i in installed],
        "residual_numel": [r.numel() for r in _residuals(quant)],
        "warnings": [str(w.message) for w in caught if "residual" in str(w.message)],
        "diff": ((fp - fq).abs().max() / fp.abs().max()).item(),
    }


@pytest.mark.slow  # 2 spawned ranks
def test_one_fully_shard_call_on_several_modules_gets_one_set_of_comms():
    for out in run_local(_grouped_worker, 2, op_timeout=60):
        assert out["installed"] == ["FSDPLinear", "FSDPLinear"]  # the group (layers 0 and 2), then layer 4
        assert out["rs_calls"] == [3, 3] and all(c >= 3 for c in out["ag_calls"])
        # the group's reduce-scatter input: both layers' parameters, dim 0 padded to 2 ranks (61 -> 62, 33 -> 34)
        assert out["residual_numel"] == [62 * 24 + 62 + 34 * 61 + 34, 6 * 33 + 6]
        assert out["warnings"] == []
        assert out["diff"] < 0.06
