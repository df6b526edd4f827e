"""Accelerate and Hugging Face Trainer jobs, run by tests/integrations/test_hf.py under torchrun on 2 gloo ranks (as
a user runs them): ``python -m torch.distributed.run --standalone --nproc_per_node 2 hf_job.py {accelerate|trainer}
OUT_DIR``. Each fits the small GPT-2 with the framework's own DDP (the reference), then through torsh's hook, then
checkpoints at step K, resumes through the framework's own checkpointing and compares with the run that never
stopped. Each rank writes what it saw to OUT_DIR as JSON; the test judges it."""

from __future__ import annotations

import os
import sys
import warnings

import gpt2
import torch

warnings.filterwarnings("ignore")
BATCH, K = 8, 5
STEPS = 3 * K


# -- Accelerate ------------------------------------------------------------------------------------------------------


def accelerate_fit(compression=None, *, steps=STEPS, save_at=None, load_from=None, restore=True, plain_ckpt=False):
    """One run of a plain Accelerate loop (AdamW, constant LR); returns (losses, model, hook state)."""
    from accelerate import Accelerator

    from torsh_kernels.integrations import accelerate as torsh_accelerate

    acc = Accelerator(cpu=True)
    model = gpt2.model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dl = torch.utils.data.DataLoader(gpt2.TokenDataset(STEPS * BATCH * 2), batch_size=BATCH, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)
    state = None
    if compression is not None:
        state = torsh_accelerate.compress(acc, model, compression, restore=restore)  # the one line torsh adds
        if plain_ckpt:  # Accelerate's own way to checkpoint an object: one file, rank 0's
            acc.register_for_checkpointing(state)
    start = 0
    if load_from is not None:
        acc.load_state(load_from)
        start = K
        dl = acc.skip_first_batches(dl, K)
    losses = []
    for i, batch in enumerate(dl, start):
        if i >= steps:
            break
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if save_at is not None and i + 1 == K:
            acc.save_state(save_at)
    return losses, acc.unwrap_model(model), state


def accelerate_job(out: str) -> None:
    res = {}
    losses, m, _ = accelerate_fit()
    res["accelerate-ddp"] = {"losses": losses, "spread": gpt2.replica_spread(m)}
    for c in ("int8", "powersgd:4"):
        d = os.path.join(out, f"acc-ckpt-{c.replace(':', '_')}")
        losses, m, state = accelerate_fit(c, save_at=d)
        full = gpt2.flat_params(m)
        r = {"losses": losses, "spread": gpt2.replica_spread(m), "stats": repr(state.stats),
             "wire_bytes": state.stats.wire_bytes, "bytes_before": state.stats.bytes_before,
             "state_files": sorted(os.listdir(os.path.join(d, "torsh_compression")))}  # fmt: skip
        l2, m2, s2 = accelerate_fit(c, load_from=d)
        r["resumed_vs_full"] = float((gpt2.flat_params(m2) - full).abs().max())
        r["resumed_losses"], r["full_losses"] = l2, losses[K:]
        r["resumed_iteration"] = s2.iteration
        _, m3, _ = accelerate_fit(c, load_from=d, restore=False)
        r["afresh_vs_full"] = float((gpt2.flat_params(m3) - full).abs().max())
        res[c] = r
    # Accelerate's own register_for_checkpointing: one file from rank 0, loaded on every rank
    d = os.path.join(out, "acc-ckpt-plain")
    accelerate_fit("int8", steps=K, save_at=d, plain_ckpt=True)
    try:
        accelerate_fit("int8", load_from=d, plain_ckpt=True)
        res["register_for_checkpointing"] = "loaded"
    except Exception as e:
        res["register_for_checkpointing"] = f"{type(e).__name__}: {e}"
    gpt2.write(out, "accelerate", res)


# -- the Trainer -----------------------------------------------------------------------------------------------------


def trainer_fit(out: str, compression=None, *, resume=None, restore=True, save=False):
    from transformers import Trainer, TrainingArguments

    from torsh_kernels.integrations import hf_trainer

    args = TrainingArguments(
        output_dir=out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1,
        save_strategy="steps" if save else "no", save_steps=K, report_to=[], disable_tqdm=True, seed=0,
        dataloader_drop_last=True,
    )  # fmt: skip
    trainer = Trainer(model=gpt2.model(), args=args, train_dataset=gpt2.TokenDataset(STEPS * BATCH * 2))
    cb = hf_trainer.compress(trainer, compression, restore=restore) if compression is not None else None
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.model, cb


def trainer_job(out: str) -> None:
    res = {}
    losses, m, _ = trainer_fit(os.path.join(out, "tr-plain"))
    res["trainer-ddp"] = {"losses": losses, "spread": gpt2.replica_spread(m)}
    for c in ("int8", "powersgd:4"):
        d = os.path.join(out, f"tr-{c.replace(':', '_')}")
        losses, m, cb = trainer_fit(d, c, save=True)
        full = gpt2.flat_params(m)
        r = {"losses": losses, "spread": gpt2.replica_spread(m), "stats": repr(cb.compression.stats),
             "wire_bytes": cb.compression.stats.wire_bytes, "bytes_before": cb.compression.stats.bytes_before,
             "checkpoints": sorted(os.listdir(d)),
             "state_files": sorted(os.listdir(os.path.join(d, f"checkpoint-{K}", "torsh_compression")))}  # fmt: skip
        ck = os.path.join(d, f"checkpoint-{K}")
        l2, m2, cb2 = trainer_fit(d, c, resume=ck)
        r["resumed_vs_full"] = float((gpt2.flat_params(m2) - full).abs().max())
        r["resumed_losses"], r["full_losses"] = l2, losses
        r["resumed_iteration"] = cb2.compression.iteration
        _, m3, _ = trainer_fit(d, c, resume=ck, restore=False)
        r["afresh_vs_full"] = float((gpt2.flat_params(m3) - full).abs().max())
        res[c] = r
    # a checkpoint written without torsh, resumed with it: a typed error, not error feedback silently from zero
    d = os.path.join(out, "tr-none")
    trainer_fit(d, save=True)
    try:
        trainer_fit(d, "int8", resume=os.path.join(d, f"checkpoint-{K}"))
        res["plain_checkpoint"] = "resumed"
    except Exception as e:
        res["plain_checkpoint"] = f"{type(e).__name__}: {e}"
    gpt2.write(out, "trainer", res)


if __name__ == "__main__":
    {"accelerate": accelerate_job, "trainer": trainer_job}[sys.argv[1]](sys.argv[2])
