"""The live-metrics slot the lower layers publish to (layer 5's :mod:`torsh_kernels.profiling.live` fills it).

``publisher`` is None unless someone listens (:func:`torsh_kernels.profiling.live.watch`, or ``TORSH_LIVE`` /
``TORSH_LIVE_PROMETHEUS`` / ``TORSH_LIVE_TENSORBOARD`` at import). Then the DDP hook, the gradient
synchronizer, FSDP2's quantized comms and the expert-parallel layer each hand it one record per step
(:data:`FIELDS`), which it sends to its sinks (files, Prometheus, TensorBoard). Every call site reads
``live.publisher`` once per step and does nothing else when it is None, so a job nobody watches pays one
global load per step. This module imports nothing from the package, so every layer may import it.
"""

from __future__ import annotations

__all__ = ["FIELDS", "SCHEMA", "publisher"]

SCHEMA = "torsh-live/1"
"""The record format's name and version (each record's ``schema``)."""

FIELDS = (
    "schema", "time", "job", "rank", "world_size", "source", "step", "step_s", "compute_s", "comm_s", "compress_s",
    "wire_bytes", "payload_bytes", "sent_bytes", "link_Bps", "ratio", "error", "nonfinite", "compressor", "switch",
    "alerts",
)  # fmt: skip
"""Every key of a record, in order (docs/profiling.md "Live metrics" says what each means)."""

publisher = None
"""The active publisher (a ``profiling.live.Publisher``), or None: nobody listens."""
