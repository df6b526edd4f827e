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
per case: the median of the runs' median step times with the runs' range and the steps' p10/p90, and the median
(range) over runs of the ratio to torchtitan's median in the same run, which a shared machine's drifting load
disturbs less.
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

from torsh_kernels.collectives import run_local

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
    out = {n: {"run_medians_ms": [], "steps_ms": [], "bytes_per_step": None, "loss": None} for n in names}
    for run in range(args["runs"]):
        order = names[run % len(names) :] + names[: run % len(names)]
        for name in order:
            comms = models[name][2]
            b0 = sum(c.bytes_sent for c in comms)
            times = []
            for _ in range(args["steps"]):
                dt, loss = step(name)
                times.append(dt * 1e3)
            out[name]["run_medians_ms"].append(statistics.median(times))
            out[name]["steps_ms"] += times
            out[name]["bytes_per_step"] = (sum(c.bytes_sent for c in comms) - b0) // args["steps"]
            out[name]["loss"] = loss
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
    base = statistics.median(res["torchtitan"]["run_medians_ms"])
    base_runs = res["torchtitan"]["run_medians_ms"]
    for name, r in res.items():
        med = statistics.median(r["run_medians_ms"])
        paired = [a / b for a, b in zip(r["run_medians_ms"], base_runs)]  # the same run: minutes apart at most
        q = statistics.quantiles(r["steps_ms"], n=10)
        rows.append({
            "case": name, "step_ms": med, "run_medians_ms": r["run_medians_ms"],
            "min_run_ms": min(r["run_medians_ms"]), "max_run_ms": max(r["run_medians_ms"]),
            "p10_ms": q[0], "p90_ms": q[-1], "vs_torchtitan": med / base,
            "paired_ratio_median": statistics.median(paired), "paired_ratio_min": min(paired),
            "paired_ratio_max": max(paired),
            "bytes_per_step": r["bytes_per_step"], "loss": r["loss"],
        })  # fmt: skip
    from torsh_kernels.env import environment

    doc = {
        "suite": "integrations-torchtitan",
        "environment": {**environment(torch.device("cpu")), "network": "loopback", "world_size": 2},
        "config": {**args, "threads": a.threads, "model": "llama3 debugmodel", "wall_s": round(time.time() - t0)},
        "rows": rows,
    }
    for r in rows:
        print(f"{r['case']:<26} {r['step_ms']:8.1f} ms/step (runs {r['min_run_ms']:.1f}..{r['max_run_ms']:.1f}, "
              f"steps p10 {r['p10_ms']:.1f} p90 {r['p90_ms']:.1f}) x{r['vs_torchtitan']:.3f}, paired per run "
              f"x{r['paired_ratio_median']:.3f} ({r['paired_ratio_min']:.3f}..{r['paired_ratio_max']:.3f})  "
              f"{r['bytes_per_step'] / 1e6:.2f} MB/step sent")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
