"""A compressor's per-bucket state (:class:`CompressionState`: the residuals, PowerSGD's Q, the step, the seed)
and the checks its ``load_state_dict`` makes: the kind, the tensors' dtypes and dimensions, a checksum of their
bytes, their finiteness (:func:`check_state_dict`)."""

from __future__ import annotations

import numbers

import torch

from ..errors import ArgumentTypeError, DTypeError, InvalidArgumentError, NonFiniteError, ShapeError

__all__ = ["STATE_TENSORS", "CompressionState", "check_seed", "check_state_dict", "tensor_checksum"]


STATE_TENSORS = {"residual": 1, "server_residual": 1, "q": 2}
"""The persistent tensors the compressors here keep in a state, by name, with their number of dimensions;
all are fp32 (``load_state_dict`` checks them; other names are taken as they are, any tensor)."""

_INT64 = (-(1 << 63), 1 << 63)


class CompressionState:
    """Per-bucket compressor state: persistent tensors (residual, PowerSGD's Q), step count, seed.

    Workspace buffers live beside them and are rebuilt on demand; only the persistent part goes into
    ``state_dict()``.
    """

    __slots__ = ("kind", "seed", "step", "tensors", "work")

    def __init__(self, seed: int = 0, kind: str | None = None) -> None:
        self.kind = kind
        """The compressor class whose state this is (``Compressor.new_state`` sets it; None: not said)."""
        self.step = 0
        """Number of compress calls so far."""
        self.seed = check_seed(seed, "CompressionState")
        """Seed of the random parts (stochastic rounding noise, PowerSGD's initial Q)."""
        self.tensors: dict[str, torch.Tensor] = {}
        self.work: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        """The persistent part, with the compressor's kind and a checksum of the tensors' bytes (``load_state_dict``
        refuses a state of another compressor and a damaged one)."""
        tensors = {k: v.clone() for k, v in self.tensors.items()}
        return {"kind": self.kind, "step": self.step, "seed": self.seed, "tensors": tensors,
                "checksum": tensor_checksum(tensors)}  # fmt: skip

    def load_state_dict(self, sd: dict) -> None:
        """Restore from ``state_dict()``, all or nothing: every entry is checked (types, ranges; the
        persistent tensors of :data:`STATE_TENSORS` fp32 with their number of dimensions) before anything
        changes, and a typed error names the first bad one: another compressor's state (``kind``), a damaged one
        (``checksum``), NaN or Inf in a tensor."""
        step, seed, tensors = check_state_dict(sd, "CompressionState.load_state_dict", self.kind)
        self.step, self.seed = step, seed
        self.tensors = {k: v.clone() for k, v in tensors.items()}
        self.work = {}

    def residual(self, like: torch.Tensor) -> torch.Tensor:
        """The fp32 error-feedback residual for a tensor like ``like`` (zeros the first time)."""
        r = self.tensors.get("residual")
        if r is None or r.numel() != like.numel() or r.device != like.device:
            if r is not None:
                raise ShapeError(
                    f"compression state holds a residual of {r.numel()} elements on {r.device}, the tensor has "
                    f"{like.numel()} on {like.device}; use one state per bucket"
                )
            r = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self.tensors["residual"] = r
        return r

    def buffer(self, name: str, numel: int, device: torch.device, *, zero: bool = False) -> torch.Tensor:
        b = self.work.get(name)
        if b is None or b.numel() != numel or b.device != device:
            b = (torch.zeros if zero else torch.empty)(numel, dtype=torch.float32, device=device)
            self.work[name] = b
        return b

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"CompressionState(step={self.step}, seed={self.seed}, tensors={shapes})"


def check_seed(seed: object, what: str) -> int:
    if type(seed) is int and _INT64[0] <= seed < _INT64[1]:
        return seed  # the common case, without the abstract-class checks (a state is made per call of the driver)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ArgumentTypeError(f"{what}: seed must be an int, got {type(seed).__name__} {seed!r}")
    if not _INT64[0] <= int(seed) < _INT64[1]:
        raise InvalidArgumentError(f"{what}: seed {seed} does not fit in int64")
    return int(seed)


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> int:
    """A checksum of the tensors' bytes: per tensor, the sum of its bytes, combined in name order. Any damaged byte
    changes it (a byte that changes changes the sum); it is not a cryptographic hash. One pass over each tensor on
    its device, one host read for all."""
    parts = [t.detach().contiguous().view(-1).view(torch.uint8).sum(dtype=torch.int64).view(1)
             for _, t in sorted(tensors.items()) if t.numel()]  # fmt: skip
    total = 0
    for i, v in enumerate(torch.cat([p.cpu() for p in parts]).tolist() if parts else []):
        total = (total * 1_000_003 + v + i) % (1 << 61)
    return total


def check_state_dict(sd: object, what: str, kind: str | None = None) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(step, seed, tensors) of a ``CompressionState.state_dict()``, every entry checked; a typed error
    naming the first bad one (nothing is changed by the check). ``kind``: the loading state's compressor, which a
    saved ``kind`` must match; a saved ``checksum`` must match the tensors' bytes; every tensor is finite."""
    keys = {"step", "seed", "tensors"}
    optional = {"kind", "checksum"}  # (absent from states saved before they were recorded)
    if not isinstance(sd, dict):
        raise ArgumentTypeError(f"{what}: expected a dict from state_dict() with keys {sorted(keys)}, got "
                                f"{type(sd).__name__}")  # fmt: skip
    if not keys <= set(sd) or not set(sd) <= keys | optional:
        missing, extra = sorted(keys - set(sd), key=str), sorted(set(sd) - keys - optional, key=str)
        raise InvalidArgumentError(
            f"{what}: expected a dict from state_dict() with keys {sorted(keys)}; missing {missing}, unexpected {extra}"
        )
    step = sd["step"]
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ArgumentTypeError(f"{what}: 'step' must be an int, got {type(step).__name__} {step!r}")
    if not 0 <= int(step) < _INT64[1]:
        raise InvalidArgumentError(f"{what}: 'step' must be >= 0 (a count of compress calls), got {step}")
    seed = check_seed(sd["seed"], f"{what}: 'seed'")
    tensors = sd["tensors"]
    if not isinstance(tensors, dict):
        raise ArgumentTypeError(f"{what}: 'tensors' must be a dict of name -> tensor, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"{what}: tensor names must be strings, got {type(name).__name__} {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{what}: tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type == "meta" or t.is_sparse or t.layout != torch.strided:
            raise InvalidArgumentError(f"{what}: tensors[{name!r}] must be a dense tensor with data, got a "
                                       f"{t.layout} tensor on {t.device}")  # fmt: skip
        dims = STATE_TENSORS.get(name)
        if dims is not None:
            if t.dtype != torch.float32:
                raise DTypeError(f"{what}: tensors[{name!r}] must be float32 (the compressors keep it in fp32), "
                                 f"got {t.dtype}")  # fmt: skip
            if t.dim() != dims:
                raise ShapeError(f"{what}: tensors[{name!r}] must have {dims} dimension(s), got shape "
                                 f"{tuple(t.shape)}")  # fmt: skip
    saved_kind = sd.get("kind")
    if saved_kind is not None and not isinstance(saved_kind, str):
        raise ArgumentTypeError(f"{what}: 'kind' must be a compressor's class name, got {type(saved_kind).__name__}")
    if saved_kind is not None and kind is not None and saved_kind != kind:
        raise InvalidArgumentError(f"{what}: this is a {saved_kind} state; a {kind} state cannot load it (their "
                                   "tensors mean different things)")  # fmt: skip
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{what}: tensors[{name!r}] holds NaN or Inf; a state saved after a non-finite step "
                                 "would spread it into every later step")  # fmt: skip
    if "checksum" in sd:
        c = sd["checksum"]
        if isinstance(c, bool) or not isinstance(c, int):
            raise ArgumentTypeError(f"{what}: 'checksum' must be an int, got {type(c).__name__}")
        if c != tensor_checksum(tensors):
            raise InvalidArgumentError(f"{what}: the tensors' checksum does not match the one saved with them: the "
                                       "checkpoint was damaged (or edited) after it was written")  # fmt: skip
    return int(step), seed, tensors


# -- helpers every compressor module uses -------------------------------------------------------------
