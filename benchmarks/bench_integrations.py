"""Step time of torsh's framework glue against each framework's own DDP, on the ranks torchrun starts.

torchrun --standalone --nproc_per_node 2 benchmarks/bench_integrations.py [--runs 5] [--steps 30]
    [--json benchmarks/results/integrations-overhead.json]

For Lightning (CompressedDDPStrategy against DDPStrategy), Accelerate (``integrations.accelerate.compress`` on the
prepared model against the prepared model alone) and the Hugging Face Trainer (``integrations.hf_trainer.compress``
against the Trainer alone): each run fits a GPT-2 (Hugging Face's GPT2LMHeadModel from a config: 4 layers, width 256,
vocabulary 2048, 64 tokens, 8 sequences per rank and step) for ``--steps`` steps, once per case, the cases in a
rotated order each run (interleaved). A case's figure in a run is the slowest rank's median step time after 5
warm-up steps (forward, backward with the gradients' exchange, optimizer step); across runs
(:func:`torsh_kernels.apps.bench.harness.interleaved_summary`), the median [min-max] of those, and of the speedup
over the framework's own case paired within each run (own's step / the case's: above 1 is faster than the
framework's own). Cases: the framework's own DDP; torsh's hook with ``none`` (the glue and the hook's bucket path,
uncompressed: what it costs over DDP's C++ all-reduce); torsh with ``int8`` (compression's own cost, which on
loopback buys nothing). Rank 0 prints the table and writes the JSON.

The JSON, the form ``benchmarks/torchtitan_overhead.py`` writes too: ``suite``, ``command``, ``environment``,
``config``, ``baseline`` (the case the speedups are over) and ``rows``, one per framework and case: ``framework``,
``case``, ``step_ms`` and ``speedup_vs_baseline`` (each ``{"median", "min", "max", "n"}`` over runs) and
``runs_ms`` (the per-run figures). Files written before this form (the committed ``integrations-overhead.json`` of
b3d0d60) have ``results`` instead: framework -> case -> ``median_ms``, ``min_ms``, ``max_ms``, ``per_run_ms`` and
``ratio_median``, ``ratio_min``, ``ratio_max``, the other way up: the case's step / own's, per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

from torsh_kernels.apps.bench.ddp_report import fmt_spread
from torsh_kernels.apps.bench.harness import interleaved_summary

warnings.filterwarnings("ignore")
VOCAB, SEQ, BATCH, WARMUP = 2048, 64, 8, 5
CASES = ("own", "torsh:none", "torsh:int8")
BASELINE = "own"


def model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def median_after_warmup(times: list[float]) -> float:
    return statistics.median(times[WARMUP:])


def lightning_case(case: str, steps: int) -> float:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from torsh_kernels.integrations.lightning import CompressedDDPStrategy

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model()
            self.times, self._t = [], 0.0

        def training_step(self, batch, i):
            return self.model(**batch).loss

        def on_train_batch_start(self, batch, i):
            self._t = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, i):
            self.times.append(time.perf_counter() - self._t)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    strategy = DDPStrategy() if case == "own" else CompressedDDPStrategy(case.split(":")[1])
    lm = LM()
    t = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    t.fit(lm, torch.utils.data.DataLoader(Tokens(steps * BATCH * dist.get_world_size()), batch_size=BATCH))
    return median_after_warmup(lm.times)


def accelerate_case(case: str, steps: int) -> float:
    from accelerate import Accelerator

    from torsh_kernels.integrations import accelerate as torsh_accelerate

    acc = Accelerator(cpu=True)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    dl = torch.utils.data.DataLoader(Tokens(steps * BATCH * dist.get_world_size()), batch_size=BATCH)
    m, opt, dl = acc.prepare(m, opt, dl)
    if case != "own":
        torsh_accelerate.compress(acc, m, case.split(":")[1])
    times = []
    for batch in dl:
        t0 = time.perf_counter()
        acc.backward(m(**batch).loss)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    acc.free_memory()
    return median_after_warmup(times)


def trainer_case(case: str, steps: int, out: str) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from torsh_kernels.integrations import hf_trainer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times, self._t = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    args = TrainingArguments(output_dir=out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=BATCH,
                             max_steps=steps, learning_rate=1e-3, save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_strategy="no")  # fmt: skip
    trainer = Trainer(model=model(), args=args, train_dataset=Tokens(steps * BATCH * dist.get_world_size()))
    clock = Clock()
    trainer.add_callback(clock)
    if case != "own":
        hf_trainer.compress(trainer, case.split(":")[1])
    trainer.train()
    return median_after_warmup(clock.times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--frameworks", default="lightning,accelerate,trainer")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.steps <= WARMUP or a.runs < 1:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps and --runs be at least 1")
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    import tempfile

    tmp = tempfile.mkdtemp(prefix="torsh-bench-integrations-")
    run = {"lightning": lambda c: lightning_case(c, a.steps), "accelerate": lambda c: accelerate_case(c, a.steps),
           "trainer": lambda c: trainer_case(c, a.steps, tmp)}  # fmt: skip
    rows = []
    for fw in a.frameworks.split(","):
        runs = []
        for r in range(a.runs):
            order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]  # rotated: each case runs first in turn
            runs.append({})
            for c in order:
                t = torch.tensor([run[fw](c)])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step time of the slowest rank
                runs[-1][c] = 1e3 * float(t)
        for c, s in interleaved_summary(runs, BASELINE).items():
            rows.append({"framework": fw, "case": c, "step_ms": s["figure"], "runs_ms": s["runs"],
                         "speedup_vs_baseline": s["speedup_vs_baseline"]})  # fmt: skip
    if dist.get_rank() == 0:
        print(f"median [min-max] over {a.runs} interleaved run(s); speedup: {BASELINE}'s step / the case's, per run")
        print(f"{'framework':<11} {'case':<11} {'step ms':>23} {'speedup over own':>23}")
        for r in rows:
            print(f"{r['framework']:<11} {r['case']:<11} {fmt_spread(r['step_ms'], 1):>23} "
                  f"{fmt_spread(r['speedup_vs_baseline'], 3):>23}")  # fmt: skip
        if a.json:
            import accelerate
            import lightning
            import transformers

            from torsh_kernels.env import environment

            doc = {"suite": "integrations-overhead",
                   "what": "step time, torsh's framework glue against the framework's own DDP",
                   "command": " ".join(["torchrun --standalone --nproc_per_node", str(dist.get_world_size()),
                                        *sys.argv]),
                   "environment": {**environment(torch.device("cpu")), "network": "loopback",
                                   "world_size": dist.get_world_size(),
                                   "frameworks": {"lightning": lightning.__version__,
                                                  "accelerate": accelerate.__version__,
                                                  "transformers": transformers.__version__}},
                   "config": {"runs": a.runs, "steps": a.steps, "warmup": WARMUP,
                              "model": "GPT2LMHeadModel 4 layers x 256, vocab 2048, 64 tokens, batch 8 per rank",
                              "params": sum(p.numel() for p in model().parameters())},
                   "baseline": BASELINE, "rows": rows}  # fmt: skip
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
