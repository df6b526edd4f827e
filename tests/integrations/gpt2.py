"""What the framework jobs share: a small GPT-2 (Hugging Face's GPT2LMHeadModel from a config, random init, nothing
downloaded, dropout off so runs are repeatable), learnable token data, and checks across ranks.

The data are sequences of an affine recurrence modulo the vocabulary, ``x[t+1] = (a * x[t] + c) % V`` with a few
per-sequence (a, c), so the loss falls well below ``ln V`` in a few dozen steps."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, WIDTH, LAYERS, HEADS = 96, 24, 64, 2, 4


def config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip


def model(seed: int = 0):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(config())


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    """``n`` sequences of ``SEQ`` tokens, the same on every rank (a sampler splits them)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.tensor([1, 3, 5, 7])[torch.randint(0, 4, (n,), generator=g)]
    c = torch.randint(1, 9, (n,), generator=g)
    x = torch.empty(n, SEQ, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        x[:, t] = (a * x[:, t - 1] + c) % VOCAB
    return x


class TokenDataset(torch.utils.data.Dataset):
    """Map-style: item i is ``{"input_ids", "labels"}`` (the Trainer's format; the LM shifts the labels)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        self.x = tokens(n, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened in order, in fp32 (DTensors gathered whole)."""
    out = []
    for p in module.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.float().reshape(-1))
    return torch.cat(out)


def replica_spread(module: torch.nn.Module) -> float:
    """The largest difference of any parameter between this rank and rank 0 (0.0: identical replicas); every rank
    calls it."""
    mine = flat_params(module)
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    diff = torch.tensor([float((mine - theirs).abs().max())])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def write(out_dir: str, name: str, record: dict) -> None:
    """Rank R's results of the job ``name``: ``out_dir/name-rank{R}.json``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(record, f, indent=1)


def read(out_dir: str, name: str, world_size: int = 2) -> list[dict]:
    out = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"{name}-rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None):
    """Run ``script`` under torchrun with ``nproc`` local ranks (gloo, loopback) as a user would; the completed
    process (its output kept) is returned, and a failure fails with both ranks' output."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n"
                             f"{p.stderr[-12000:]}")  # fmt: skip
    return p
