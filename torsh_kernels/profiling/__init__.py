"""Layer 5: observing the layers below. The timeline recorder (:mod:`~torsh_kernels.profiling.timeline`),
trace loading and analysis (:mod:`~.traces`, :mod:`~.analysis`), the terminal viewer (:mod:`~.viewer`,
``torsh timeline``), the bottleneck report (:mod:`~.report`, ``torsh report``) and the kernel autotuner
(:mod:`~.autotune`, ``torsh tune``)."""

from __future__ import annotations

from .autotune import Tuner, TuneSpace, install, register_space, sync_tuning
from .timeline import Recorder, record, step
from .traces import Trace, load

__all__ = ["Recorder", "Trace", "TuneSpace", "Tuner", "install", "load", "record", "register_space", "step",
           "sync_tuning"]  # fmt: skip
