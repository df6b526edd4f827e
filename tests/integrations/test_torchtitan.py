"""torchtitan: its llama3 debug model, built on the meta device and parallelised by torchtitan's own
``parallelize_llama`` through :func:`~torsh_kernels.integrations.torchtitan.quantized_parallelize`, materialised as
torchtitan's trainer does, trained on 2 gloo ranks against the same run through torchtitan's own FSDP2 comms, and
checkpointed and resumed through torchtitan's ``CheckpointManager``.

torchtitan's ``Trainer`` itself does not start on a CPU (``torchtitan/trainer.py``: ``device_module.set_device``
raises ``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``), so the test drives the steps the
trainer takes around its ``parallelize_fn``. What differs from ``llama3_debugmodel``: 2 layers instead of 6,
``seq_len`` 64, ScaledDotProductAttention (causal) instead of FlexAttention (no backward on the CPU), the
``partial_dtensor`` SPMD backend (the default ``spmd_types`` fails in ``fully_shard`` with this torch), and
``ParallelDims.build_mesh`` on "cpu" (``torchtitan.distributed.parallel_dims.device_type`` set to "cpu").
torchtitan's own reduce-scatter uses ``PREMUL_SUM`` (it turns FSDP2's gradient division off), which gloo refuses,
so the baseline runs with ``set_force_sum_reduction_for_comms(True)`` (a plain sum, the same value); torsh's
quantized reduce-scatter takes ``PREMUL_SUM`` as it is."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

from torsh_kernels.collectives import run_local
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError

pytest.importorskip("torchtitan")

SEQ, BATCH, STEPS, VOCAB = 64, 2, 4, 2048


def _config():
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" where no accelerator exists
    config = llama3_debugmodel()
    config.training.seq_len = SEQ
    config.parallelism.data_parallel_shard_degree = 2
    config.parallelism.spmd_backend = "partial_dtensor"
    model_config = config.model_spec.model
    model_config.layers = model_config.layers[:2]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.update_from_config(config=config)
    return config


def build(config, parallel_dims, parallelize_fn):
    """What torchtitan's Trainer does around its parallelize_fn: build on meta, parallelise, materialise, init."""
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model = parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder,
    )  # fmt: skip
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def _plain_sum(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; the same sum, by 1.0


def _copy_params(dst, src) -> None:
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters(), strict=True):
            a.to_local().copy_(b.to_local())


def _full(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().float().reshape(-1) for p in model.parameters()])


def _residuals(model) -> list[torch.Tensor]:
    from torsh_kernels.parallel.fsdp import RESIDUAL

    with torch.no_grad():
        return [m._buffers[RESIDUAL].to_local().clone() for m in model.modules() if RESIDUAL in m._buffers]


def _train(model, optimizers, loss_fn, steps, rank) -> list[float]:
    losses = []
    for s in steps:
        g = torch.Generator().manual_seed(1000 * s + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = tokens  # a copy task: learnable, so the loss moves
        pred = model(tokens)
        loss, _ = loss_fn(pred, labels, torch.tensor(float(BATCH * SEQ * dist.get_world_size())))
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _eval(model, loss_fn) -> float:
    """The loss on one fixed batch (the same on every rank), without a step: whether training moved the model the
    right way, free of the noise of each step's own batch."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        loss, _ = loss_fn(model(tokens), tokens, torch.tensor(float(BATCH * SEQ)))
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # torchtitan keeps the root unsharded after its forward (no backward here to do it)
        if isinstance(m, FSDPModule):
            m.reshard()
    return loss.item()


def _replicas_equal(full: torch.Tensor) -> bool:
    gathered = [torch.empty_like(full) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, full)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _checkpointer(folder, model, optimizers, lr_schedulers):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={}, sd_adapter=None, base_folder=folder)  # fmt: skip


def _torchtitan_worker(comm, folder, checkpoint) -> dict:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    from torsh_kernels.integrations.torchtitan import installed_comms, quantized_parallelize
    from torsh_kernels.parallel.fsdp import count_traffic

    warnings.simplefilter("ignore")
    torch.manual_seed(0)  # the same initial weights in every run (init_weights draws from the global generator)
    me = comm.rank
    config = _config()
    parallel_dims = ParallelDims.from_config(config.parallelism, comm.world_size)
    parallel_dims.build_mesh()
    glue = quantized_parallelize(parallelize_llama, weights="int8", grads="int8")
    spec = dataclasses.replace(config.model_spec, parallelize_fn=glue)  # what a user puts in the config

    def prepared(parallelize_fn):
        model = build(config, parallel_dims, parallelize_fn)
        optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=2 * STEPS)
        return model, optimizers, lr_schedulers

    plain, opt_p, _ = prepared(parallelize_llama)
    _plain_sum(plain)
    quant, opt_q, sched_q = prepared(spec.parallelize_fn)
    out = {"repr": repr(glue), "residuals_zero": all(bool((r == 0).all()) for r in _residuals(quant))}
    _copy_params(quant, plain)
    plain_comms = count_traffic(plain)  # FSDP2's own, counting
    torsh_comms = installed_comms(quant)
    loss_fn = CrossEntropyLoss.Config().build()
    out["eval_before"] = _eval(quant, loss_fn)
    out["loss_plain"] = _train(plain, opt_p, loss_fn, range(STEPS), me)
    out["loss_torsh"] = _train(quant, opt_q, loss_fn, range(STEPS), me)
    out["eval_after"] = _eval(quant, loss_fn)
    fp, fq = _full(plain), _full(quant)
    out["replicas_equal"] = _replicas_equal(fq)
    out["param_diff"] = ((fp - fq).abs().max() / fp.abs().max()).item()
    out["bytes_plain"] = sum(c.bytes_sent for c in plain_comms)
    out["bytes_torsh"] = sum(c.bytes_sent for i in torsh_comms for c in (i.all_gather, i.reduce_scatter))
    out["rs_calls"] = sum(i.reduce_scatter.calls for i in torsh_comms)
    out["n_installed"] = len(torsh_comms)
    if not checkpoint:
        return out

    # save through torchtitan's CheckpointManager, train on, then resume a fresh model from the checkpoint
    ckpt = _checkpointer(folder, quant, opt_q, sched_q)
    ckpt.save(curr_step=STEPS)
    ckpt.close()
    saved = _residuals(quant)
    _train(quant, opt_q, loss_fn, range(STEPS, STEPS + 2), me)
    uninterrupted = _full(quant)
    resumed, opt_r, sched_r = prepared(spec.parallelize_fn)
    ckpt = _checkpointer(folder, resumed, opt_r, sched_r)
    out["loaded"] = ckpt.load(step=STEPS)
    ckpt.close()
    out["residuals_restored"] = len(saved) == len(_residuals(resumed)) and all(
        torch.equal(a, b) for a, b in zip(saved, _residuals(resumed))
    )
    out["residuals_nonzero"] = all(bool(r.abs().sum() > 0) for r in saved)
    _train(resumed, opt_r, loss_fn, range(STEPS, STEPS + 2), me)
    out["resumed_same"] = torch.equal(uninterrupted, _full(resumed))
    return out


def _check_training(out: dict) -> None:
    assert out["residuals_zero"]
    assert out["replicas_equal"]
    assert out["n_installed"] >= 3 and out["rs_calls"] == out["n_installed"] * STEPS
    assert out["eval_after"] < out["eval_before"], (out["eval_before"], out["eval_after"])  # it learns
    for lq, lp in zip(out["loss_torsh"], out["loss_plain"]):
        assert abs(lq - lp) < 0.01 * lp, (out["loss_torsh"], out["loss_plain"])
    assert out["param_diff"] < 0.05, out["param_diff"]
    # int8 codes plus a scale per 256: under a third of fp32's (the bf16 all-gathers: about half)
    assert 0 < out["bytes_torsh"] < 0.6 * out["bytes_plain"], (out["bytes_torsh"], out["bytes_plain"])


@pytest.mark.slow  # 2 spawned ranks, about 10 s
def test_llama3_debug_model_trains_with_quantized_comms(tmp_path):
    for out in run_local(_torchtitan_worker, 2, str(tmp_path), False, op_timeout=120):
        assert out["repr"].startswith("quantized_parallelize(parallelize_llama")
        _check_training(out)


@pytest.mark.slow  # 2 spawned ranks, about 10 s
def test_checkpoint_resume_through_torchtitans_checkpoint_manager(tmp_path):
    for out in run_local(_torchtitan_worker, 2, str(tmp_path), True, op_timeout=120):
        _check_training(out)
        assert out["loaded"] and out["residuals_nonzero"] and out["residuals_restored"]
        assert out["resumed_same"]


def test_quantized_parallelize_checks_its_arguments():
    from torsh_kernels.integrations.torchtitan import installed_comms, quantized_parallelize

    with pytest.raises(ArgumentTypeError):
        quantized_parallelize("parallelize_llama", grads="int8")
    with pytest.raises(InvalidArgumentError):
        quantized_parallelize(lambda m, **kw: m, grads="int3")
    with pytest.raises(ArgumentTypeError, match="bogus"):
        quantized_parallelize(lambda m, **kw: m, grads="int8", bogus=1)
    fn = quantized_parallelize(lambda m, **kw: m, grads="int8")
    with pytest.raises(InvalidArgumentError):
        quantized_parallelize(fn)
    with pytest.raises(ArgumentTypeError):
        quantized_parallelize(lambda m, **kw: m, grads="int8", timeout="soon")
    with pytest.raises(InvalidArgumentError):
        installed_comms(torch.nn.Linear(2, 2))
    with pytest.raises(InvalidArgumentError, match="no FSDPModule"):
        fn(torch.nn.Linear(2, 2))  # a parallelize function that applied no fully_shard
    with pytest.raises(ArgumentTypeError, match="returned NoneType"):
        quantized_parallelize(lambda m, **kw: None, grads="int8")(torch.nn.Linear(2, 2))
