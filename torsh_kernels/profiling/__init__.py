"""Layer 5: observing the layers below. The timeline recorder (:mod:`~torsh_kernels.profiling.timeline`),
trace loading and analysis (:mod:`~.traces`, :mod:`~.analysis`), the terminal viewer (:mod:`~.viewer`,
``torsh timeline``), the bottleneck report (:mod:`~.report`, ``torsh report``), the kernel autotuner
(:mod:`~.autotune`, ``torsh tune``) and the machine-code report (:mod:`~.inspection`, ``torsh inspect``: each
kernel compiled for a GPU target as its launcher specializes it, :mod:`~.launches`, and its SASS read,
:mod:`~.sass`)."""

from __future__ import annotations

from .autotune import Tuner, TuneSpace, install, register_space, sync_tuning
from .inspection import inspect_kernels
from .timeline import Recorder, record, step
from .traces import Trace, load

__all__ = ["Recorder", "Trace", "TuneSpace", "Tuner", "inspect_kernels", "install", "load", "record",
           "register_space", "step", "sync_tuning"]  # fmt: skip
