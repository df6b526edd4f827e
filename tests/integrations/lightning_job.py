"""A Lightning job, run by tests/integrations/test_lightning.py under torchrun on 2 gloo ranks (as a user runs one):
``python -m torch.distributed.run --standalone --nproc_per_node 2 lightning_job.py {ddp|fsdp} OUT_DIR``.

ddp: Lightning's own DDPStrategy (the reference), then CompressedDDPStrategy with every compressor, each fitting the
same GPT-2 from the same seed on the same data; then a checkpoint at the end of epoch 1 resumed through
``trainer.fit(ckpt_path=...)``, against the uninterrupted run, with the hook's state restored or (restore=False)
not. fsdp: ModelParallelStrategy with FSDP2, with and without torsh's quantized comms, and a resume through its
distributed checkpoint. Each rank writes what it saw to OUT_DIR as JSON; the test judges it."""

from __future__ import annotations

import glob
import os
import sys
import warnings

import gpt2
import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from torsh_kernels.errors import FileAccessError
from torsh_kernels.integrations.lightning import CompressedDDPStrategy
from torsh_kernels.parallel import apply_quantized_comm

warnings.filterwarnings("ignore")
BATCH, EPOCH_STEPS = 8, 5
COMPRESSORS = ["none", "fp16", "bf16", "int8", "int4", "topk:0.05", "sign", "powersgd:4", "auto"]


class LM(L.LightningModule):
    def __init__(self, quantized: dict | None = None, fsdp: bool = False) -> None:
        super().__init__()
        self.fsdp, self.quantized, self.losses, self.installed = fsdp, quantized, [], []
        if not fsdp:
            self.model = gpt2.model()

    def configure_model(self) -> None:
        if not self.fsdp or hasattr(self, "model"):
            return
        from torch.distributed.fsdp import fully_shard

        self.model = gpt2.model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        if self.quantized:
            self.installed = apply_quantized_comm(self.model, **self.quantized)  # the one line torsh adds

    def training_step(self, batch: dict, i: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(gpt2.TokenDataset(EPOCH_STEPS * BATCH * 2), batch_size=BATCH)


def trainer(strategy, steps: int, **kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     **{"enable_checkpointing": False, **kw})  # fmt: skip


def run(strategy, steps: int, module: LM | None = None, ckpt_path: str | None = None, **kw) -> tuple[LM, L.Trainer]:
    module = module or LM()
    t = trainer(strategy, steps, **kw)
    t.fit(module, loader(), ckpt_path=ckpt_path)
    return module, t


def stats_of(state) -> dict:
    s = state.stats
    return {"iterations": s.iterations, "compressor": type(state.compressor).__name__, "buckets": s.buckets,
            "bytes_before": s.bytes_before, "bytes_after": s.bytes_after, "wire_bytes": s.wire_bytes,
            "auto": (s.auto or {}).get("choice"), "summary": repr(s)}  # fmt: skip


def ddp(out: str) -> None:
    steps = 3 * EPOCH_STEPS
    res = {}
    m, _ = run(DDPStrategy(), steps)
    res["lightning-ddp"] = {"losses": m.losses, "spread": gpt2.replica_spread(m)}
    for c in COMPRESSORS:
        strategy = CompressedDDPStrategy(c)
        m, _ = run(strategy, steps)
        res[c] = {"losses": m.losses, "spread": gpt2.replica_spread(m), "stats": stats_of(strategy.compression)}
    gpt2.write(out, "ddp", res)

    # checkpoint at the end of epoch 1 (step 5), resumed to step 15, against the run that never stopped
    ck = {}
    for c in ("int8", "powersgd:4"):
        d = os.path.join(out, f"ckpt-{c.replace(':', '_')}")
        strategy = CompressedDDPStrategy(c)
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=EPOCH_STEPS, save_top_k=-1)
        m, _ = run(strategy, steps, enable_checkpointing=True, callbacks=[cb])
        full = gpt2.flat_params(m)
        first = sorted(glob.glob(os.path.join(d, "*step=5.ckpt")))[0]
        saved = torch.load(os.path.join(first + ".torsh", f"rank{dist.get_rank()}-of-2.pt"), weights_only=False)
        resumed = CompressedDDPStrategy(c)
        m2, _ = run(resumed, steps, ckpt_path=first)
        afresh = CompressedDDPStrategy(c, restore=False)
        m3, _ = run(afresh, steps, ckpt_path=first)
        ck[c] = {
            "files": sorted(os.listdir(d)),
            "state_files": sorted(os.listdir(first + ".torsh")),
            "saved_iteration": saved["state"]["iteration"],
            "resumed_iterations": resumed.compression.iteration,
            "resumed_vs_full": float((gpt2.flat_params(m2) - full).abs().max()),
            "afresh_vs_full": float((gpt2.flat_params(m3) - full).abs().max()),
            "resumed_losses": m2.losses, "full_losses": m.losses[EPOCH_STEPS:],
        }  # fmt: skip
    # ModelCheckpoint keeping only the latest: each rotated checkpoint takes its per-rank states with it
    d = os.path.join(out, "ckpt-rotated")
    run(CompressedDDPStrategy("int8"), steps, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=d, every_n_train_steps=EPOCH_STEPS, save_top_k=1)])  # fmt: skip
    ck["rotated"] = sorted(os.listdir(d))
    # a checkpoint written without torsh: resuming through the strategy is a typed error, not a silent restart
    d = os.path.join(out, "ckpt-plain")
    run(DDPStrategy(), EPOCH_STEPS, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=d)])
    plain = glob.glob(os.path.join(d, "*.ckpt"))[0]
    try:
        run(CompressedDDPStrategy("int8"), steps, ckpt_path=plain)
        ck["plain"] = "no error"
    except FileAccessError as e:
        ck["plain"] = f"FileAccessError: {e}"
    gpt2.write(out, "ddp-ckpt", ck)


def mp() -> ModelParallelStrategy:
    """Lightning's FSDP2 strategy, sharding over both ranks (its default, data_parallel_size="auto", is the number of
    nodes: on one node it would shard over nothing and run tensor parallel)."""
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


class Residuals(L.Callback):
    """The torsh residual buffers (this rank's part) when a checkpoint is saved, and when training starts."""

    def __init__(self) -> None:
        self.saved, self.started = {}, []

    @staticmethod
    def _of(pl_module) -> list:
        return [b.to_local().clone() for n, b in pl_module.named_buffers() if n.endswith("torsh_rs_residual")]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved[trainer.global_step] = self._of(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = self._of(pl_module)


def fsdp(out: str) -> None:
    steps = 3 * EPOCH_STEPS
    res = {}
    for name, q in (("lightning-fsdp2", None), ("int8", {"weights": "int8", "grads": "int8"}),
                    ("int4-grads", {"weights": None, "grads": "int4"})):  # fmt: skip
        m, _ = run(mp(), steps, LM(q, fsdp=True))
        sent = {
            "all_gather": sum(i.all_gather.bytes_sent for i in m.installed if i.all_gather),
            "reduce_scatter": sum(i.reduce_scatter.bytes_sent for i in m.installed if i.reduce_scatter),
        }
        res[name] = {"losses": m.losses, "spread": gpt2.replica_spread(m.model), "installed": len(m.installed),
                     "bytes_sent": sent}  # fmt: skip
    # resume through ModelParallelStrategy's distributed checkpoint: the residual buffers are in the model's state;
    # Lightning's own FSDP2 (no torsh) resumed the same way is the reference for what "exact" means here
    for name, q in (("resume-lightning-fsdp2", None), ("resume-int8-grads", {"weights": None, "grads": "int8"})):
        d = os.path.join(out, f"ckpt-{name}")
        seen = Residuals()
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=EPOCH_STEPS, save_top_k=-1)
        m, _ = run(mp(), steps, LM(q, fsdp=True), enable_checkpointing=True, callbacks=[cb, seen])
        full = gpt2.flat_params(m.model)
        first = os.path.join(d, f"epoch=0-step={EPOCH_STEPS}.ckpt")
        loaded = Residuals()
        m2, _ = run(mp(), steps, LM(q, fsdp=True), ckpt_path=first, callbacks=[loaded])
        res[name] = {
            "resumed_vs_full": float((gpt2.flat_params(m2.model) - full).abs().max()),
            "losses": m2.losses, "full_losses": m.losses[EPOCH_STEPS:],
            "residuals": len(seen.saved.get(EPOCH_STEPS, [])),
            "residual_norm": sum(float(r.norm()) for r in seen.saved.get(EPOCH_STEPS, [])),
            "restored_vs_saved": max((float((a - b).abs().max()) for a, b in
                                      zip(seen.saved.get(EPOCH_STEPS, []), loaded.started)), default=0.0),
        }  # fmt: skip
    gpt2.write(out, "fsdp", res)


if __name__ == "__main__":
    {"ddp": ddp, "fsdp": fsdp}[sys.argv[1]](sys.argv[2])
