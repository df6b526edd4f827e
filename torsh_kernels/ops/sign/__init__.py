"""1-bit sign compression ops: sign_compress (with error feedback) and sign_decompress.

- ``sign_compress(x, residual=)`` -> ``(bits, scale)``: 8 signs per byte (element 8i + j in bit j; 1 for
  ``v >= 0``) and ``scale = mean(|v|)`` (summed in fp64), v = x + residual; with a residual, it is left
  holding ``v - scale * sign(v)`` (EF-SignSGD). ``sign_decompress`` gives ``+-scale``.

See ``ops.common`` for what the compression families share (fp32 compute, the non-finite checks).

The family's modules:

- ``api.py``: the public ops, their ``torsh::`` custom ops and fake implementations, their CPU fast paths;
- ``reference.py``: the torch references (``*_ref``), the oracles of the tests;
- ``providers.py``: the implementations registered per provider, the Triton launch geometry (``SUM_BLOCK``,
  ``SIGN_BYTES``, ``UNPACK_BYTES``, ``SIGN_TAIL``) and the torch provider's packing; the kernels, one module per
  provider, imported on its first launch: ``triton.py``, ``numba.py`` (CUDA), ``cpu.py`` (Numba's CPU target).
"""

from __future__ import annotations

from .api import sign_compress, sign_decompress
from .providers import SIGN_BYTES as SIGN_BYTES
from .providers import SIGN_TAIL as SIGN_TAIL
from .providers import SUM_BLOCK as SUM_BLOCK
from .providers import UNPACK_BYTES as UNPACK_BYTES
from .reference import sign_compress_ref, sign_decompress_ref

__all__ = ["sign_compress", "sign_compress_ref", "sign_decompress", "sign_decompress_ref"]
