"""Layer 4: the kernel autotuner (:mod:`~torsh_kernels.profiling.autotune`). The timeline recorder, the
terminal viewer and the bottleneck report are a later issue."""

from __future__ import annotations

from .autotune import Tuner, TuneSpace, install, register_space, sync_tuning

__all__ = ["TuneSpace", "Tuner", "install", "register_space", "sync_tuning"]
