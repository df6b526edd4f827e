"""What :class:`~torsh_kernels.parallel.GradientSynchronizer` reports: :class:`SyncStats` (a step's
statistics) and :class:`GradientConsistency` (the cross-rank gradient check)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..env import fmt_bytes

__all__ = ["GradientConsistency", "SyncStats"]


@dataclass(slots=True)
class GradientConsistency:
    """Result of :meth:`GradientSynchronizer.check_gradient_consistency`."""

    consistent: bool
    """Whether every rank holds bit-identical gradients (and the same set of gradients)."""
    mismatched: list[str]
    """Names of the parameters whose gradients differ between ranks."""
    checksums: list[list[int]] = field(repr=False)
    """Per rank, per parameter: a checksum of the gradient's bits (-1: no gradient)."""

    def __repr__(self) -> str:
        """One line: the verdict, the first mismatched names; the checksums are an attribute."""
        shown = ", ".join(map(repr, self.mismatched[:3])) + (", ..." if len(self.mismatched) > 3 else "")
        ranks, params = len(self.checksums), len(self.checksums[0]) if self.checksums else 0
        return (
            f"GradientConsistency(consistent={self.consistent}, mismatched={len(self.mismatched)} [{shown}], "
            f"{ranks} ranks x {params} parameters)"
        )


class SyncStats(dict):
    """The statistics :meth:`GradientSynchronizer.sync_gradients` and :meth:`~GradientSynchronizer.get_sync_stats`
    return: a ``dict`` (every key as documented there: per-bucket figures, unused parameters, ``auto``'s
    decision, ...) that prints as one line of totals."""

    __slots__ = ()

    def __repr__(self) -> str:
        if "iteration" not in self:
            return f"SyncStats(no sync yet, syncs={self.get('syncs', 0)})"
        unused = len(self["unused_parameters"])
        extra = "".join(f", {k}={self[k]}" for k in ("syncs", "compressor") if k in self) + (
            f", auto={self['auto']['choice']!r}" if self.get("auto") else ""
        )
        wire = self["bytes_on_wire"]
        return (
            f"SyncStats(iteration={self['iteration']}, parameters={self['parameters_with_gradients']}/"
            f"{self['parameters']} with gradients, buckets={len(self['buckets'])}, payload "
            f"{fmt_bytes(self['payload_bytes'])} of {fmt_bytes(self['bytes_before'])} "
            f"({self['compression_ratio']:.3g}x), wire {'-' if wire is None else fmt_bytes(wire)}, "
            f"{self['seconds_after_backward']:.3g} s after backward, "
            f"unused={unused}, nonfinite={self['nonfinite']}, nonfinite_steps={self['nonfinite_steps']}{extra})"
        )
