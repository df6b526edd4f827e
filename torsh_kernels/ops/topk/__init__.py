"""Top-k sparsification ops: topk_compress (with error feedback) and topk_decompress.

- ``topk_compress(x, ratio=, residual=, exact=)`` -> ``(values, indices)``: the k = ceil(ratio * n)
  largest magnitudes of ``x + residual``, indices ascending (int32 when n < 2**31). With a residual, the
  residual is left holding exactly what was not sent: ``x + residual_old - scatter(values)``.
  *Approximate mode* (the default, as in Deep Gradient Compression): a threshold is estimated from a
  strided sample, one fused pass compacts the candidates ``|v| >= threshold`` into a buffer of
  ``CAP = k + ceil(TOPK_SLACK * k)`` slots, and the k largest candidates are kept. The estimate is
  *refined* (threshold re-estimated from the sample with the observed count) when the candidate count
  misses the band ``[k, CAP]``: below k (too few) or above ``(1 + TOPK_SLACK) * k`` (overflow), at most
  ``TOPK_REFINE`` times, then the exact path runs. Whenever the count lands in the band, every one of
  the true top k is a candidate, so the result equals the exact top-k (ties at the threshold may be
  broken differently); what is approximate is the threshold, and its cost is one pass plus a top-k
  over at most CAP elements instead of a top-k over n. When the sample would hold every element (n up
  to ``TOPK_MIN_SAMPLE``), approximate mode takes the exact path: the sample's top-k would already be a
  top-k over all n. ``exact=True`` selects with a top-k over all n.
- ``topk_decompress(values, indices, numel, out=, accumulate=, alpha=)``: scatter (or scatter-add, with
  duplicate indices summed: the all-gathered payloads of several ranks) ``alpha * values``.

See ``ops.common`` for what the compression families share (fp32 compute, the non-finite checks).

The family's modules:

- ``api.py``: the public ops, their ``torsh::`` custom ops and fake implementations, their CPU fast paths,
  and the approximate mode's host side (its constants, the sample's stride and threshold, the refinement);
- ``reference.py``: the torch references (``*_ref``), the oracles of the tests, and what every module
  shares: ``topk_count`` (k for a ratio), ``index_dtype``;
- ``providers.py``: the implementations registered per provider (the candidate pass, the scatter) and their
  launch geometry; the kernels, one module per provider, imported on its first launch: ``triton.py``,
  ``numba.py`` (CUDA), ``cpu.py`` (Numba's CPU target; also the cpu provider's exact selection).
"""

from __future__ import annotations

from .api import TOPK_MIN_SAMPLE as TOPK_MIN_SAMPLE
from .api import TOPK_REFINE as TOPK_REFINE
from .api import TOPK_SAMPLE_PER_K as TOPK_SAMPLE_PER_K
from .api import TOPK_SLACK as TOPK_SLACK
from .api import topk_compress, topk_decompress
from .providers import CAND_BLOCK as CAND_BLOCK
from .providers import CAND_WARPS as CAND_WARPS
from .providers import SCATTER_BLOCK as SCATTER_BLOCK
from .providers import SCATTER_WARPS as SCATTER_WARPS
from .reference import index_dtype, topk_compress_ref, topk_count, topk_decompress_ref

# The names the module this package replaced exported. Its public constants stay importable from here (the
# approximate mode's, the Triton launch geometry) but are read where they are defined: patch them there.
__all__ = ["index_dtype", "topk_compress", "topk_compress_ref", "topk_count", "topk_decompress", "topk_decompress_ref"]
