"""What the test modules share: the device and dtype tolerances, random and poisoned tensors, compressor
factories, batches and models. One home for what several of them need.

(``conftest.py`` sets the interpreter switches and the tuning cache, and holds the fixtures.) The
compressor classes are imported at the top: importing torsh_kernels loads no Triton and no Numba, so the
switches conftest sets still come before any kernel is defined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os

import pytest
import torch
from torch import nn

from torsh_kernels.compression import BF16, FP8, FP16, Compressor, PowerSGD, Quantize, Sign, TopK

GPU = torch.cuda.is_available() and os.environ.get("TORSH_TEST_INTERPRET", "0") != "1"
"""Whether the tests run the compiled kernels on a GPU (else Triton's interpreter and Numba's simulator)."""
DEVICE = torch.device("cuda") if GPU else torch.device("cpu")
PROVIDERS = ("triton", "numba", "torch") if GPU else ("triton", "numba", "cpu", "torch")
"""The providers every op test runs with. The cpu provider's kernels take CPU tensors: on a GPU machine,
where the tests' tensors live on the GPU, the CPU run covers them."""

# (dtype, atol, rtol): about two units in the last place of each dtype, so a wrong element or a missed
# element (the outputs are poisoned with NaN) fails. A one-ulp rounding error passes these; rounding
# modes are checked separately, bit for bit (test_casts_round_to_nearest_even).
DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-6, 1e-6, id="fp32"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
    pytest.param(torch.bfloat16, 8e-3, 8e-3, id="bf16"),
]


def rand(shape, dtype, gen, device=DEVICE) -> torch.Tensor:
    """Random normal data (never zeros), made on the CPU from ``gen`` then moved."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def poison(shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def close(a, b, atol, rtol) -> None:
    """assert_close of fp32 CPU copies; a NaN (an element left poisoned) never matches."""
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=atol, rtol=rtol, equal_nan=False)


_COMPRESSORS = {
    "none": lambda p: None,
    "fp16": lambda p: FP16(provider=p),
    "bf16": lambda p: BF16(provider=p),
    "topk": lambda p: TopK(0.1, provider=p),
    "topk-exact": lambda p: TopK(0.05, exact=True, provider=p),
    "int8": lambda p: Quantize(8, block=64, provider=p),
    "fp8": lambda p: FP8("e4m3", block=64, provider=p),
    "int4": lambda p: Quantize(4, block=32, stochastic=True, provider=p),
    "sign": lambda p: Sign(provider=p),
    "powersgd": lambda p: PowerSGD(2, start_iter=1, provider=p),
}
COMPRESSOR_NAMES = tuple(_COMPRESSORS)


def make_compressor(name: str, provider: str | None = None, **overrides) -> Compressor | None:
    """A compressor by test name (small blocks and ratios for small tensors); ``None`` for "none".
    A suffix after the base name ("int8-gather", "int4-shared") names the same compressor under another
    scheme. ``overrides`` replace fields (e.g. ``ratio=0.05``)."""
    base = name if name in _COMPRESSORS else name.rsplit("-", 1)[0]
    c = _COMPRESSORS[base](provider)
    return dataclasses.replace(c, **overrides) if overrides else c


def batch(step: int, rank: int, *, rows: int, features: int, classes: int, salt: tuple[int, int] = (7919, 31)):
    """A classification batch (x [rows, features], labels [rows]), different per step and rank."""
    g = torch.Generator().manual_seed(salt[0] * step + salt[1] * rank)
    return torch.randn(rows, features, generator=g), torch.randint(0, classes, (rows,), generator=g)


class MLP(nn.Module):
    """Linear layers named a, b, c, ... with an activation between them, initialised from ``seed``. With
    ``side=True`` also a linear branch from input to output that ``forward`` uses only when asked, so its
    parameters get no gradient otherwise (unused-parameter cases)."""

    def __init__(self, *sizes: int, act: type[nn.Module] = nn.ReLU, side: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.names = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            name = "abcdefghijklmnop"[i]
            setattr(self, name, nn.Linear(a, b))
            self.names.append(name)
        self.act = act()
        self.side = nn.Linear(sizes[0], sizes[-1]) if side else None

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        h = x
        for i, name in enumerate(self.names):
            h = getattr(self, name)(h)
            if i + 1 < len(self.names):
                h = self.act(h)
        return h + self.side(x) if side else h


class SparseNet(nn.Module):
    """Sparse embeddings (``Embedding`` and ``EmbeddingBag`` with ``sparse=True``) beside dense layers, as a
    recommendation model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(99)
        self.emb = nn.Embedding(301, 24, sparse=True)
        self.bag = nn.EmbeddingBag(157, 24, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 10))

    def forward(self, ids, bag_ids):
        return self.mlp(torch.cat([self.emb(ids).mean(1), self.bag(bag_ids)], dim=1))


def sparse_batch(step: int, rank: int):
    """(ids [16, 5], bag ids [16, 3], labels [16]) for :class:`SparseNet`, different per step and rank."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank)
    return (torch.randint(0, 301, (16, 5), generator=g), torch.randint(0, 157, (16, 3), generator=g),
            torch.randint(0, 10, (16,), generator=g))  # fmt: skip


class Pty:
    """A command on a pseudo-terminal that is its controlling terminal, as a user at a terminal runs it:
    ``out`` collects what it prints, ``send`` types keys (``b"\\x03"`` is Ctrl-C: the terminal sends SIGINT),
    ``wait`` awaits its exit with a deadline, so a command that does not stop fails its test instead of
    hanging the suite. The command starts with SIGINT at its default, whatever the suite inherited (a shell
    that runs it in the background makes it ignore SIGINT, and children inherit that)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        import pty
        import signal

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: never returns into the test process
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.environ.update(env or {})
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.out = b""

    def read_for(self, seconds: float) -> None:
        """Collect output for ``seconds`` (less if the terminal closes)."""
        import select
        import time

        end = time.time() + seconds
        while time.time() < end:
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:
                    return

    def read_until(self, needle: bytes, seconds: float = 60) -> None:
        """Collect output until ``needle`` appears or ``seconds`` pass."""
        import time

        deadline = time.time() + seconds
        while needle not in self.out and time.time() < deadline:
            self.read_for(0.5)

    def send(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, seconds: float = 30) -> int | None:
        """The exit code (negative: killed by that signal), or None if it still ran after ``seconds`` (it is
        then killed)."""
        import signal
        import time

        deadline = time.time() + seconds
        while time.time() < deadline:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return None


@contextlib.contextmanager
def count_calls(cls: type, *names: str):
    """Count the calls of ``cls``'s methods ``names`` inside the block (every instance's); the dict it yields
    holds the counts, by name. The methods are put back when the block ends, however it ends."""
    calls = dict.fromkeys(names, 0)
    originals = {n: getattr(cls, n) for n in names}

    def counted(name: str, fn):
        def call(self, *a, **kw):
            calls[name] += 1
            return fn(self, *a, **kw)

        return call

    for n, fn in originals.items():
        setattr(cls, n, counted(n, fn))
    try:
        yield calls
    finally:
        for n, fn in originals.items():
            setattr(cls, n, fn)


def assert_named_on_every_rank(out: list[dict], named: dict[str, str]) -> None:
    """A mismatch test's check: for each case of ``named``, every rank's result (``out[rank][case]``: the
    error message, None where none was raised) holds the expected text and is the same message as rank 0's."""
    for res in out:
        for name, want in named.items():
            assert res[name] is not None, f"{name}: no error"
            assert want in res[name] and res[name] == out[0][name], (name, res[name])
