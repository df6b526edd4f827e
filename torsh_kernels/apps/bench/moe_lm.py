"""``torsh bench moe --ep-lm``: a small MoE language model trained with its expert-parallel dispatch in bf16 and
in fp8, side by side in one run (issue 43: the fp8 dispatch's final loss within 1% of the bf16 dispatch's).

The model: a token embedding, ``--lm-layers`` pre-norm transformer blocks (causal self-attention, then an
:class:`~torsh_kernels.parallel.ExpertParallelMoE` feed-forward: E experts over the ranks, top-k routing, the
load-balancing loss added to the loss), a final LayerNorm and the tied embedding as the head; fp32 weights,
AdamW. Every rank builds the same model from one seed; each wire's copy differs only in the MoE layers'
``wire=`` ("bf16": dispatch and combine in bf16; "fp8": dispatch in e4m3 with a scale per 128 channels, combine in
bf16, DeepSeek-V3's recipe; "int8"; "none": fp32 rows). The attention, embedding and norms are data-parallel
(their gradients averaged over the ranks), the routers' through ``reduce_gradients(average=True)``.

The text is synthetic and its entropy known: an order-2 Markov source over ``--lm-vocab`` tokens in which the
token after ``(a, b)`` is one of 8 candidates that depend on ``b``, ranked by a Zipf law (exponent 1.5) rotated
by ``a mod 8``. A model that reads only the last token can reach ln 8 = 2.08 nats at best; one that reads the
last two, the source's entropy rate (1.51 nats), the floor printed with the results.

Each step every wire's model trains on the same batches (each rank its own), one after the other (interleaved,
so the machine's load hits them alike). Reported per wire: the training loss per step (the ranks' mean), the
final loss (mean of the last 20 steps) and the loss on held-out batches after training, against the bf16
dispatch's; the step time (the slowest rank's, median and p20-p80); the bytes the MoE layers' all-to-alls sent per
step on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from ... import cli_common
from ...collectives import init_from_env, run_local
from . import emit, environment, quantile

__all__ = ["MarkovText", "add_arguments", "run"]

WIRES = ("none", "bf16", "fp8", "e5m2", "int8")
_CANDIDATES = 8
_ZIPF = 1.5
_TAIL = 20  # the final loss: mean of the last this many steps


class MarkovText:
    """The synthetic order-2 source (module docstring): ``batch(n, length, seed)`` samples ``n`` sequences,
    ``entropy_rate`` is its entropy in nats per token (every context's next-token distribution is a permutation
    of the same Zipf law, so it is that law's entropy)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        if vocab < _CANDIDATES:
            raise cli_common.UsageError(f"--lm-vocab {vocab}: at least {_CANDIDATES} tokens")
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.candidates = torch.stack([torch.randperm(vocab, generator=g)[:_CANDIDATES] for _ in range(vocab)])
        w = torch.arange(1, _CANDIDATES + 1, dtype=torch.float64) ** -_ZIPF
        self.zipf = w / w.sum()
        self.entropy_rate = float(-(self.zipf * self.zipf.log()).sum())
        rot = torch.stack([self.zipf.roll(r) for r in range(_CANDIDATES)])  # [8 rotations, 8 candidates]
        self._probs = rot.float()

    def batch(self, n: int, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(n, length, dtype=torch.long)
        out[:, :2] = torch.randint(self.vocab, (n, 2), generator=g)
        for t in range(2, length):
            a, b = out[:, t - 2], out[:, t - 1]
            pick = torch.multinomial(self._probs[a % _CANDIDATES], 1, generator=g).squeeze(1)
            out[:, t] = self.candidates[b, pick]
        return out


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, moe: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, d))
        return x + self.moe(self.ln2(x).reshape(B * S, d)).view(B, S, d)


class _LM(nn.Module):
    def __init__(self, cfg: dict, moes: list[nn.Module]) -> None:
        super().__init__()
        d = cfg["hidden"]
        self.emb = nn.Embedding(cfg["vocab"], d)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.blocks = nn.ModuleList(_Block(d, cfg["heads"], m) for m in moes)
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token cross-entropy over ``tokens`` [B, S+1], and the MoE layers' auxiliary losses."""
        x = self.emb(tokens[:, :-1])
        for b in self.blocks:
            x = b(x)
        logits = self.ln(x) @ self.emb.weight.t()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        return ce, sum(b.moe.aux_loss for b in self.blocks)


def _models(comm, cfg: dict) -> dict[str, _LM]:
    """One model per wire, the same weights (one seed, on every rank); the MoE layers expert-parallel."""
    from ...parallel import ExpertParallelMoE, MoELayer

    torch.manual_seed(cfg["seed"])
    bases = [MoELayer(cfg["hidden"], cfg["ffn_hidden"], cfg["experts"], cfg["k"]) for _ in range(cfg["layers"])]
    dense = _LM(cfg, [nn.Identity() for _ in bases])
    models = {}
    for w in cfg["wires"]:
        m = copy.deepcopy(dense)
        for blk, base in zip(m.blocks, bases):
            blk.moe = ExpertParallelMoE.from_layer(base, comm, wire=None if w == "none" else w)
        models[w] = m
    return models


def _sync_grads(comm, model: _LM) -> None:
    """Average the data-parallel gradients (everything but the MoE layers) in one all-reduce; the MoE layers'
    replicated ones through reduce_gradients, their experts' divided by W (the loss is the ranks' mean)."""
    dense = [p for n, p in model.named_parameters() if ".moe." not in n and p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in dense])
    comm.all_reduce(flat, "sum")
    flat /= comm.world_size
    for p, g in zip(dense, torch.split(flat, [p.numel() for p in dense])):
        p.grad.copy_(g.view_as(p))
    for b in model.blocks:
        b.moe.reduce_gradients(average=True)


def _bytes(d: dict) -> int:
    """The bytes a MoE layer's four all-to-alls sent in its last step (forward and backward)."""
    return int(d.get("bytes_sent", 0)) + int(d.get("backward_bytes_sent", 0))


def _lr(step: int, cfg: dict) -> float:
    warm = max(1, cfg["steps"] // 15)
    if step < warm:
        return cfg["lr"] * (step + 1) / warm
    frac = (step - warm) / max(1, cfg["steps"] - warm)
    return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))  # cosine to a tenth


def _mean(comm, v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    comm.all_reduce(t, "sum")
    return float(t) / comm.world_size


def _worker(comm, cfg: dict) -> dict | None:
    torch.set_num_threads(cfg["threads"])
    me = comm.rank
    text = MarkovText(cfg["vocab"], seed=cfg["seed"])
    models = _models(comm, cfg)
    opts = {w: torch.optim.AdamW(m.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
            for w, m in models.items()}  # fmt: skip
    losses: dict[str, list[float]] = {w: [] for w in models}
    times: dict[str, list[float]] = {w: [] for w in models}
    sent: dict[str, int] = {}
    for step in range(cfg["steps"]):
        tokens = text.batch(cfg["batch"], cfg["seq"] + 1, seed=1_000_003 * (step + 1) + me)
        for w, model in models.items():
            for group in opts[w].param_groups:
                group["lr"] = _lr(step, cfg)
            comm.barrier()
            t0 = time.perf_counter()
            ce, aux = model(tokens)
            (ce + aux).backward()
            _sync_grads(comm, model)
            opts[w].step()
            opts[w].zero_grad(set_to_none=True)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            comm.all_reduce(dt, "max")
            times[w].append(float(dt))
            losses[w].append(_mean(comm, ce.item()))
            if step == cfg["steps"] - 1:
                sent[w] = sum(_bytes(b.moe.last_dispatch) for b in model.blocks)
        if me == 0 and (step + 1) % cfg["progress_every"] == 0:
            line = "  ".join(f"{w} {losses[w][-1]:.4f}" for w in models)
            print(f"  step {step + 1}/{cfg['steps']}: loss {line}", file=sys.stderr, flush=True)
    held: dict[str, float] = {}
    with torch.no_grad():
        for w, model in models.items():
            vals = [model(text.batch(cfg["batch"], cfg["seq"] + 1, seed=7_000_001 + 1000 * i + me))[0].item()
                    for i in range(cfg["held_out_batches"])]  # fmt: skip
            held[w] = _mean(comm, statistics.fmean(vals))
    if me != 0:
        return None
    ref = "bf16" if "bf16" in models else next(iter(models))
    rows = []
    for w in models:
        final = statistics.fmean(losses[w][-_TAIL:])
        ref_final = statistics.fmean(losses[ref][-_TAIL:])
        ts = times[w][1:] or times[w]  # the first step builds caches
        rows.append({
            "wire": w, "final_loss": final, "held_out_loss": held[w],
            "final_loss_vs_" + ref: final / ref_final - 1, "held_out_loss_vs_" + ref: held[w] / held[ref] - 1,
            "max_abs_loss_gap_vs_" + ref: max(abs(a - b) for a, b in zip(losses[w], losses[ref])),
            "step_ms": 1e3 * statistics.median(ts), "p20_ms": 1e3 * quantile(ts, 0.2),
            "p80_ms": 1e3 * quantile(ts, 0.8), "moe_bytes_per_step": sent[w], "losses": losses[w],
        })  # fmt: skip
    _print(rows, cfg, text.entropy_rate, ref, comm.world_size)
    env = environment(torch.device("cpu"))
    return {"suite": "moe-ep-lm", **env, "config": {**cfg, "world_size": comm.world_size,
            "link": os.environ.get("TORSH_BENCH_NETWORK", "loopback" if "RANK" not in os.environ else "see note"),
            "entropy_rate_nats": text.entropy_rate, "unigram_nats": math.log(cfg["vocab"]),
            "first_order_floor_nats": math.log(_CANDIDATES), "reference": ref,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}, "rows": rows}  # fmt: skip


def _print(rows: list[dict], cfg: dict, entropy: float, ref: str, world: int) -> None:
    params = cfg["layers"] * 3 * cfg["experts"] * cfg["hidden"] * cfg["ffn_hidden"]
    print(f"torsh bench moe --ep-lm: {cfg['layers']} blocks, H={cfg['hidden']}, E={cfg['experts']} "
          f"(k={cfg['k']}, ffn {cfg['ffn_hidden']}, {params / 1e6:.1f} M expert weights), vocab {cfg['vocab']}, "
          f"{cfg['batch']} x {cfg['seq']} tokens a rank, {world} ranks, {cfg['steps']} steps; the source's entropy "
          f"{entropy:.4f} nats, last-token-only floor {math.log(_CANDIDATES):.4f}")  # fmt: skip
    print(f"{'wire':6} {'final loss':>10} {'vs ' + ref:>9} {'held-out':>9} {'vs ' + ref:>9} {'step ms':>8} "
          f"{'p20-p80':>15} {'MoE MiB/step':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['wire']:6} {r['final_loss']:10.4f} {100 * r['final_loss_vs_' + ref]:+8.2f}% "
              f"{r['held_out_loss']:9.4f} {100 * r['held_out_loss_vs_' + ref]:+8.2f}% {r['step_ms']:8.1f} "
              f"{r['p20_ms']:7.1f}-{r['p80_ms']:<7.1f} {r['moe_bytes_per_step'] / 2**20:12.2f}")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a small MoE language model, expert-parallel (--ep-lm)")
    at_least_1 = cli_common.int_at_least(1)
    g.add_argument("--ep-lm", action="store_true",
                   help="instead: train a small MoE LM, bf16 and fp8 dispatch side by side")  # fmt: skip
    g.add_argument("--lm-wires", type=cli_common.choice_list(WIRES, "wire"), default=["bf16", "fp8"],
                   help=f"the MoE layers' wire= per model, from {','.join(WIRES)} (bf16,fp8; the reference: bf16, "
                   "else the first)")  # fmt: skip
    g.add_argument("--lm-steps", type=at_least_1, default=300, help="training steps (300)")
    g.add_argument("--lm-layers", type=at_least_1, default=2, help="transformer blocks (2)")
    g.add_argument("--lm-hidden", type=at_least_1, default=256, help="model width (256)")
    g.add_argument("--lm-heads", type=at_least_1, default=4, help="attention heads (4)")
    g.add_argument("--lm-experts", type=at_least_1, default=8, help="experts per MoE layer (8)")
    g.add_argument("--lm-ffn", type=at_least_1, default=256, help="each expert's width (256)")
    g.add_argument("--lm-vocab", type=at_least_1, default=128, help="the synthetic text's vocabulary (128)")
    g.add_argument("--lm-batch", type=at_least_1, default=16, help="sequences a rank per step (16)")
    g.add_argument("--lm-seq", type=at_least_1, default=128, help="tokens per sequence (128)")
    g.add_argument("--lm-lr", type=float, default=3e-3, help="AdamW's peak learning rate (3e-3; warmup, cosine)")
    g.add_argument("--lm-seed", type=cli_common.int_at_least(0), default=0, help="the model's and text's seed (0)")


def run(args: argparse.Namespace) -> int:
    if args.lm_hidden % args.lm_heads:
        raise cli_common.UsageError(f"--lm-hidden {args.lm_hidden} is not a multiple of --lm-heads {args.lm_heads}")
    if args.k > args.lm_experts:
        raise cli_common.UsageError(f"--k {args.k} is more than --lm-experts {args.lm_experts}")
    if not 0 < args.lm_lr < 1:
        raise cli_common.UsageError(f"--lm-lr {args.lm_lr}: expected a learning rate in (0, 1)")
    cfg = {"steps": args.lm_steps, "layers": args.lm_layers, "hidden": args.lm_hidden, "heads": args.lm_heads,
           "experts": args.lm_experts, "k": args.k, "ffn_hidden": args.lm_ffn, "vocab": args.lm_vocab,
           "batch": args.lm_batch, "seq": args.lm_seq, "lr": args.lm_lr, "seed": args.lm_seed,
           "wires": list(dict.fromkeys(args.lm_wires)), "threads": args.ep_threads, "held_out_batches": 8,
           "progress_every": max(1, args.lm_steps // 10)}  # fmt: skip
    if args.note is not None:
        cfg["note"] = args.note
    if "RANK" in os.environ:
        torch.set_num_threads(args.ep_threads)
        doc = _worker(init_from_env(timeout=600), cfg)
    else:
        doc = run_local(_worker, args.ep_world, cfg, threads=args.ep_threads, timeout=7200, op_timeout=600)[0]
    if doc is not None:
        emit(args, doc)
    sys.stdout.flush()
    return 0
