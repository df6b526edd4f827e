"""Settings from elsewhere as torsh objects: a DeepSpeed config (:func:`from_deepspeed`), Megatron-Core's MoE
settings (:func:`from_megatron`) and PyTorch's DDP comm hooks (:func:`from_torch_hook`).

Each returns a :class:`Migration`: the gradient compressor and the hook's arguments, the torch optimizer and
the :class:`~torsh_kernels.parallel.OffloadedOptimizer` settings, the
:class:`~torsh_kernels.parallel.ParameterOffloader` settings, FSDP2's quantized comms, the MoE layer's
arguments, and helpers that build each. Every key of the input ends in one of three places:

- **mapped**: it became part of a torsh object or argument; where torsh's meaning differs from the source's,
  ``notes[key]`` says how (e.g. 1-bit Adam compresses the momentum, torsh's :class:`~torsh_kernels.compression.Sign`
  the gradient);
- ``ignored[key]``: outside torsh's scope (batch sizes, learning-rate schedules, logging, sharding, which is
  torch's FSDP2), with the reason and where that concern lives instead;
- the error: :class:`~torsh_kernels.errors.ConfigMappingError`, raised once the whole input was examined,
  with ``keys`` naming every key that cannot be mapped (unknown keys, values torsh has no equivalent for,
  such as an NVMe offload device, and wrong types) and why.

Every value that reaches a torsh object is checked when the settings are read (type, finiteness, a range; the
optimizer built and stepped on a throwaway parameter; a JSON file read with size, nesting and digit limits), so
a bad value is refused under its key here, not at the first step: see :mod:`.common`, :mod:`.optimizer_checks`
and :mod:`.reading` for the bounds and why.

A key the caller knows to be irrelevant can be left out with ``ignore=[dotted keys]``; it is then listed in
``ignored`` as left out on request. Nothing is dropped silently.

This package builds objects of :mod:`torsh_kernels.parallel` and :mod:`torsh_kernels.compression` and sits
above them; it imports neither DeepSpeed nor Megatron (their objects are read by attribute).
"""

from __future__ import annotations

from .deepspeed import from_deepspeed
from .megatron import from_megatron
from .migration import Migration
from .pytorch import from_torch_hook

__all__ = ["Migration", "from_deepspeed", "from_megatron", "from_torch_hook"]
