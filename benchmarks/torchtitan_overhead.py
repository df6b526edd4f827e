"""torchtitan's llama3 debug model on 2 loopback gloo ranks: step time of torchtitan's own ``parallelize_llama``
against the same through ``torsh_kernels.integrations.torchtitan.quantized_parallelize`` with nothing quantized
(the glue's own cost) and with int8 gradients (qgZ), median of interleaved runs.

python benchmarks/torchtitan_overhead.py [--runs 5] [--steps 20] [--layers 6] [--seq 128]
    [--json benchmarks/results/integrations-torchtitan.json]

The model is ``llama3_debugmodel``'s (dim 256, 16 heads, vocab 2048; ``--layers`` of its 6) with what the CPU needs
(tests/integrations/test_torchtitan.py says why): ScaledDotProductAttention, the ``partial_dtensor`` backend, the
mesh on "cpu", and FSDP2's own reduce-scatter forced to a plain sum (gloo has no PREMUL_SUM) wherever it runs. Each
run times ``--steps`` steps (forward, torchtitan's CrossEntropyLoss, backward, AdamW) of every case in turn, the
order rotating per run, after 3 warm-up steps per case; the cases are built once, with the same weights. Reported
per case (:func:`torsh_kernels.apps.bench.harness.interleaved_summary`): the median [min-max] over runs of each
run's median step time, the steps' p10/p90, and the median [min-max] over runs of the speedup over torchtitan
paired within each run (torchtitan's median step / the case's, above 1 faster than torchtitan), which a shared
machine's drifting load disturbs less.

The JSON, the form ``benchmarks/bench_integrations.py`` writes too: ``suite``, ``command``, ``environment``,
``config``, ``baseline`` (the case the speedups are over) and ``rows``, one per case: ``case``, ``step_ms`` and
``speedup_vs_baseline`` (each ``{"median", "min", "max", "n"}`` over runs), ``runs_ms`` (each run's median step),
``p10_ms``/``p90_ms`` (over every timed step), ``bytes_per_step`` (sent per rank) and ``loss`` (the last step's).
Files written before this form (the committed ``integrations-torchtitan.json`` of f3a3fc9) have in each row
``step_ms`` as a number (the median over runs), ``run_medians_ms``, ``min_run_ms``, ``max_run_ms``,
``vs_torchtitan`` (the ratio of the medians) and ``paired_ratio_median``, ``paired_ratio_min``,
``paired_ratio_max``, the other way up: the case's step / torchtitan's, per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

from torsh_kernels.apps.bench.ddp_report import fmt_spread
from torsh_kernels.apps.bench.harness import interleaved_summary
from torsh_kernels.collectives import run_local

BASELINE = "torchtitan"
CASES = {
    "torchtitan": None,
    "glue, nothing quantized": {"weights": None, "grads": None},
    "glue, int8 grads": {"weights": None, "grads": "int8"},
}


def _worker(comm, args) -> dict:
    import torchtitan.distributed.parallel_dims as pdims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from torsh_kernels.integrations.torchtitan import installed_comms, quantized_parallelize
    from torsh_kernels.parallel.fsdp import count_traffic

    warnings.simplefilter("ignore")
    pdims.device_type = "cpu"
    config = llama3_debugmodel()
    config.training.seq_len = args["seq"]
    config.parallelism.data_parallel_shard_degree = comm.world_size
    config.parallelism.spmd_backend = "partial_dtensor"
    mc = config.model_spec.model
    mc.layers = mc.layers[: args["layers"]]
    for layer in mc.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    mc.update_from_config(config=config)
    parallel_dims = ParallelDims.from_config(config.parallelism, comm.world_size)
    parallel_dims.build_mesh()

    def build(fields):
        fn = parallelize_llama if fields is None else quantized_parallelize(parallelize_llama, **fields)
        with torch.device("meta"):
            model = mc.build()
        model = fn(model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
                   compile_config=config.compile, ac_config=config.activation_checkpoint,
                   dump_folder=config.dump_folder)  # fmt: skip
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)  # FSDP2's own reduce-scatter on gloo: no PREMUL_SUM
        comms = count_traffic(model, installed_comms(model) if fields is not None else ())
        return model, default_adamw(lr=8e-4).build(model_parts=[model]), comms

    models = {name: build(fields) for name, fields in CASES.items()}
    first = next(iter(models.values()))[0]
    with torch.no_grad():
        for model, _, _ in models.values():
            for a, b in zip(model.parameters(), first.parameters(), strict=True):
                a.to_local().copy_(b.to_local())
    loss_fn = CrossEntropyLoss.Config().build()
    tokens_all = torch.tensor(float(args["batch"] * args["seq"] * comm.world_size))
    gen = torch.Generator().manual_seed(comm.rank)

    def step(name) -> tuple[float, float]:
        model, opt, _ = models[name]
        tokens = torch.randint(0, mc.vocab_size, (args["batch"], args["seq"]), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        loss, _ = loss_fn(model(tokens), tokens, tokens_all)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, loss.item()

    names = list(CASES)
    for name in names:
        for _ in range(3):
            step(name)
    out = {"runs": [], "steps_ms": {n: [] for n in names}, "bytes_per_step": {}, "loss": {}}
    for run in range(args["runs"]):
        order = names[run % len(names) :] + names[: run % len(names)]
        out["runs"].append({})
        for name in order:
            comms = models[name][2]
            b0 = sum(c.bytes_sent for c in comms)
            times = []
            for _ in range(args["steps"]):
                dt, loss = step(name)
                times.append(dt * 1e3)
            out["runs"][-1][name] = times
            out["steps_ms"][name] += times
            out["bytes_per_step"][name] = (sum(c.bytes_sent for c in comms) - b0) // args["steps"]
            out["loss"][name] = loss
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    args = {k: getattr(a, k) for k in ("runs", "steps", "layers", "seq", "batch")}
    t0 = time.time()
    res = run_local(_worker, 2, args, threads=a.threads, op_timeout=300, timeout=3600)[0]  # rank 0's clock
    rows = []
    for name, sm in interleaved_summary(res["runs"], BASELINE).items():  # paired: the same run, minutes apart at most
        q = statistics.quantiles(res["steps_ms"][name], n=10)
        rows.append({"case": name, "step_ms": sm["figure"], "runs_ms": sm["runs"],
                     "speedup_vs_baseline": sm["speedup_vs_baseline"], "p10_ms": q[0], "p90_ms": q[-1],
                     "bytes_per_step": res["bytes_per_step"][name], "loss": res["loss"][name]})  # fmt: skip
    from torsh_kernels.env import environment

    doc = {
        "suite": "integrations-torchtitan",
        "command": " ".join(["python", *sys.argv]),
        "environment": {**environment(torch.device("cpu")), "network": "loopback", "world_size": 2},
        "config": {**args, "threads": a.threads, "model": "llama3 debugmodel", "wall_s": round(time.time() - t0)},
        "baseline": BASELINE,
        "rows": rows,
    }
    print(f"median [min-max] over {a.runs} interleaved run(s); speedup: {BASELINE}'s step / the case's, per run")
    for r in rows:
        print(f"{r['case']:<26} {fmt_spread(r['step_ms'], 1)} ms/step (steps p10 {r['p10_ms']:.1f} p90 "
              f"{r['p90_ms']:.1f}), speedup {fmt_spread(r['speedup_vs_baseline'], 3)}  "
              f"{r['bytes_per_step'] / 1e6:.2f} MB/step sent")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
