"""torchtitan: :func:`quantized_parallelize`, a model's ``parallelize_fn`` with torsh's FSDP2 quantized comms.

torchtitan builds the model on the meta device, calls the ``ModelSpec``'s ``parallelize_fn`` (for llama3
``parallelize_llama``, which applies ``fully_shard`` through ``apply_fsdp_to_decoder``), then materialises it
(``model.to_empty(device=...)``) and initialises it (``model.init_weights(buffer_device=...)``). The function this
module returns calls the given ``parallelize_fn``, then :func:`~torsh_kernels.parallel.fsdp.apply_quantized_comm` on
the sharded model, and wraps that model's ``init_weights`` (on the instance) so that the error-feedback residuals,
uninitialised memory after ``to_empty``, are zeroed once the weights are initialised
(:func:`~torsh_kernels.parallel.fsdp.reset_residuals`). The residuals are module buffers, so torchtitan's
``CheckpointManager`` (its ``ModelWrapper``, ``load_state_dict``) saves and restores them with the model.

A user swaps the ``ModelSpec``'s ``parallelize_fn``::

    spec = model_registry("debugmodel")
    spec = dataclasses.replace(spec, parallelize_fn=quantized_parallelize(spec.parallelize_fn, grads="int8"))

Imports nothing of torchtitan: the glue only calls what torchtitan hands it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..checks import check_timeout
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..parallel.fsdp_format import QuantizedCommSpec

__all__ = ["QuantizedParallelize", "installed_comms", "quantized_parallelize"]

_INSTALLED = "_torsh_installed"  # the model's list of Installed (instance attribute)


class QuantizedParallelize:
    """A torchtitan ``parallelize_fn``: ``parallelize_fn(model, **kwargs)``, then ``apply_quantized_comm(model,
    spec)``, and ``model.init_weights`` wrapped to zero the residuals after it runs. Made by
    :func:`quantized_parallelize`; its ``repr`` is what torchtitan's ``config.to_dict()`` records."""

    def __init__(self, parallelize_fn: Callable[..., nn.Module], spec: QuantizedCommSpec,
                 timeout: float | None, check_signatures: bool | None) -> None:  # fmt: skip
        self.parallelize_fn = parallelize_fn
        """The model's own parallelize function (``parallelize_llama``, ...)."""
        self.spec = spec
        """What is installed (weights, grads, error feedback, block), validated."""
        self.timeout = timeout
        self.check_signatures = check_signatures

    def __repr__(self) -> str:
        name = getattr(self.parallelize_fn, "__qualname__", type(self.parallelize_fn).__name__)
        return f"quantized_parallelize({name}, {self.spec!r})"

    def __call__(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        from ..parallel.fsdp import apply_quantized_comm

        out = self.parallelize_fn(model, *args, **kwargs)
        if not isinstance(out, nn.Module):
            raise ArgumentTypeError(
                f"quantized_parallelize: {self!r}: the parallelize function returned {type(out).__name__}, not the "
                "model (torchtitan's parallelize functions return it)"
            )
        installed = apply_quantized_comm(out, self.spec, timeout=self.timeout, check_signatures=self.check_signatures)
        out.__dict__[_INSTALLED] = installed
        _reset_after_init(out)
        return out


def _reset_after_init(model: nn.Module) -> None:
    """Wrap ``model.init_weights`` (the instance's) so the residuals are zeroed after it runs: torchtitan calls it
    once the model is materialised (``to_empty``), which leaves the residual buffers uninitialised."""
    from ..parallel.fsdp import reset_residuals

    init = getattr(model, "init_weights", None)
    if init is None or getattr(init, "_torsh_resets", False):
        return

    def init_weights(*args: Any, **kwargs: Any) -> Any:
        out = init(*args, **kwargs)
        reset_residuals(model)
        return out

    init_weights._torsh_resets = True  # type: ignore[attr-defined]
    init_weights.__wrapped__ = init  # type: ignore[attr-defined]
    init_weights.__doc__ = init.__doc__
    model.__dict__["init_weights"] = init_weights


def quantized_parallelize(parallelize_fn: Callable[..., nn.Module], spec: QuantizedCommSpec | None = None, *,
                          timeout: float | None = None, check_signatures: bool | None = None,
                          **fields: object) -> QuantizedParallelize:  # fmt: skip
    """torchtitan's ``parallelize_fn`` with torsh's FSDP2 quantized comms: a function with the signature of the
    one given (``parallelize_llama(model, *, parallel_dims, training, parallelism, compile_config, ac_config,
    dump_folder)``) that calls it, then :func:`~torsh_kernels.parallel.fsdp.apply_quantized_comm` on the model it
    returns, and makes that model's ``init_weights`` zero the error-feedback residuals after it runs (torchtitan
    calls it after ``to_empty``, which leaves them uninitialised; a quantized reduce-scatter refuses a residual that
    was neither reset nor loaded). Put it in the ``ModelSpec`` in place of the model's own.

    Args:
        parallelize_fn: the model's parallelize function (``model_spec.parallelize_fn``).
        spec: a :class:`~torsh_kernels.parallel.QuantizedCommSpec`, or None to build one from ``fields``
            (``weights="int8"``, ``grads="int8"``, ``error_feedback``, ``block``; the names of
            ``apply_quantized_comm``).
        timeout, check_signatures: ``apply_quantized_comm``'s.

    What was installed is :func:`installed_comms(model) <installed_comms>` (each comm's ``bytes_sent``, ``calls``;
    :func:`~torsh_kernels.parallel.fsdp.count_traffic` takes it). Calling ``init_states`` instead of
    ``init_weights`` skips the reset: call :func:`~torsh_kernels.parallel.fsdp.reset_residuals` then.
    """
    what = "quantized_parallelize"
    if not callable(parallelize_fn):
        raise ArgumentTypeError(
            f"{what}: parallelize_fn must be the model's parallelize function (model_spec.parallelize_fn, e.g. "
            f"torchtitan.models.llama3.parallelize_llama), got {type(parallelize_fn).__name__}"
        )
    if isinstance(parallelize_fn, QuantizedParallelize):
        raise InvalidArgumentError(
            f"{what}: parallelize_fn is already {parallelize_fn!r}; wrap the model's own parallelize function once"
        )
    spec = QuantizedCommSpec.build(spec, fields, what)
    if timeout is not None:
        timeout = check_timeout(timeout, what)
    if check_signatures is not None and not isinstance(check_signatures, bool):
        raise ArgumentTypeError(
            f"{what}: check_signatures must be a bool or None, got {type(check_signatures).__name__}"
        )
    return QuantizedParallelize(parallelize_fn, spec, timeout, check_signatures)


def installed_comms(model: nn.Module) -> list:
    """What :func:`quantized_parallelize` installed on ``model`` (the model its parallelize function returned):
    one :class:`~torsh_kernels.parallel.fsdp.Installed` per FSDP module, each comm counting ``bytes_sent`` and
    ``calls``."""
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"installed_comms: model must be an nn.Module, got {type(model).__name__}")
    installed = model.__dict__.get(_INSTALLED)
    if installed is None:
        raise InvalidArgumentError(
            "installed_comms: this model was not parallelised by quantized_parallelize (pass the model the "
            "parallelize function returned, e.g. trainer.model_parts[0])"
        )
    return list(installed)
