"""BucketSpec (the hook's and the synchronizer's bucket settings) and Quantize's scheme, which replaced
the quantize_mode keyword: construction, the keywords that build them, the deprecated keyword."""

from __future__ import annotations

import dataclasses

import pytest

from torsh_kernels.collectives.replica import ReplicaCommunicator
from torsh_kernels.compression import PowerSGD, Quantize, TopK
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.parallel import BucketSpec, CompressionHookState, GradientSynchronizer
from torsh_kernels.parallel.auto import default_candidates


def test_bucket_spec_validates_once():
    s = BucketSpec(start_iter=3, min_compression_rate=1, min_numel=0, policy="bucket", nonfinite="raise")
    assert s.min_compression_rate == 1.0 and type(s.min_compression_rate) is float
    assert hash(s) == hash(dataclasses.replace(s))
    for bad, err, text in [
        (dict(start_iter=-1), InvalidArgumentError, "start_iter=-1"),
        (dict(start_iter=1.0), ArgumentTypeError, "start_iter must be an int"),
        (dict(min_compression_rate=-0.5), InvalidArgumentError, "min_compression_rate=-0.5"),
        (dict(min_compression_rate="2"), ArgumentTypeError, "min_compression_rate must be a number"),
        (dict(min_numel=True), ArgumentTypeError, "min_numel must be an int"),
        (dict(policy="all"), InvalidArgumentError, "policy='all'"),
        (dict(nonfinite="skip"), InvalidArgumentError, "nonfinite='skip'"),
    ]:
        with pytest.raises(err, match=text):
            BucketSpec(**bad)


def test_resolved_takes_the_compressors_warmup():
    assert BucketSpec().resolved((0, 2.0), auto=False) == BucketSpec(start_iter=0, min_compression_rate=2.0)
    assert BucketSpec().resolved(PowerSGD(start_iter=7, min_compression_rate=3).warmup(), auto=False) == BucketSpec(
        start_iter=7, min_compression_rate=3.0
    )
    assert BucketSpec().resolved((0, 2.0), auto=True).start_iter == 2
    given = BucketSpec(start_iter=5, min_compression_rate=1.5)
    assert given.resolved((7, 3.0), auto=True) is given


def test_the_hook_takes_the_spec_or_its_fields_as_keywords():
    spec = BucketSpec(start_iter=4, min_numel=16, policy="bucket")
    a = CompressionHookState(None, TopK(0.1), bucket=spec)
    b = CompressionHookState(None, TopK(0.1), start_iter=4, min_numel=16, policy="bucket")
    assert a.bucket == b.bucket == BucketSpec(start_iter=4, min_compression_rate=2.0, min_numel=16, policy="bucket")
    assert (b.start_iter, b.min_numel, b.policy, b.nonfinite) == (4, 16, "bucket", "auto")
    c = CompressionHookState(None, TopK(0.1), bucket=spec, min_numel=8)  # a keyword refines the spec
    assert (c.bucket.start_iter, c.bucket.min_numel) == (4, 8)
    with pytest.raises(ArgumentTypeError, match=r"CompressionHookState: unexpected keyword argument.*'min_nume'"):
        CompressionHookState(None, TopK(0.1), min_nume=8)
    with pytest.raises(InvalidArgumentError, match="CompressionHookState: min_numel=-1"):
        CompressionHookState(None, TopK(0.1), min_numel=-1)
    with pytest.raises(ArgumentTypeError, match="bucket must be a BucketSpec or None, got dict"):
        CompressionHookState(None, TopK(0.1), bucket={"min_numel": 8})


def test_the_synchronizer_takes_the_spec_or_its_fields_as_keywords():
    import torch

    model = torch.nn.Linear(4, 3)
    comm = ReplicaCommunicator(1)
    s = GradientSynchronizer(model, comm, compressor=TopK(0.5), min_numel=1, policy="bucket", overlap=False)
    assert s.bucket == BucketSpec(start_iter=0, min_compression_rate=2.0, min_numel=1, policy="bucket")
    t = GradientSynchronizer(model, comm, compressor=TopK(0.5), bucket=BucketSpec(min_numel=1, policy="bucket"),
                             overlap=False)  # fmt: skip
    assert t.bucket == s.bucket


def test_quantize_scheme_is_a_setting_of_the_compressor():
    assert Quantize().scheme == "auto"
    assert dict(Quantize(scheme="shared_scale").signature())["scheme"] == "shared_scale"
    assert set(Quantize().schemes(1000, None, 2)) == {"all_gather", "shared_scale_all_reduce"}
    assert set(Quantize(scheme="all_gather").schemes(1000, None, 2)) == {"all_gather"}
    assert set(Quantize(scheme="shared_scale").schemes(1000, None, 2)) == {"shared_scale_all_reduce"}
    assert Quantize(scheme="shared_scale").label() == "int8:scheme=shared_scale" and Quantize().label() == "int8"
    with pytest.raises(InvalidArgumentError, match="Quantize: scheme='ring'"):
        Quantize(scheme="ring")


def test_the_deprecated_quantize_mode_sets_the_scheme():
    with pytest.warns(FutureWarning, match=r"quantize_mode= is deprecated.*Quantize\(\.\.\., scheme="):
        h = CompressionHookState(None, Quantize(8), quantize_mode="shared_scale")
    assert h.compressor.scheme == "shared_scale"
    with pytest.warns(FutureWarning):
        assert CompressionHookState(None, TopK(0.1), quantize_mode="shared_scale").compressor == TopK(0.1)
    with pytest.warns(FutureWarning), pytest.raises(InvalidArgumentError, match="disagree"):
        CompressionHookState(None, Quantize(8, scheme="all_gather"), quantize_mode="shared_scale")
    with pytest.warns(FutureWarning), pytest.raises(InvalidArgumentError, match="quantize_mode='x'"):
        CompressionHookState(None, Quantize(8), quantize_mode="x")
    with pytest.warns(FutureWarning):
        a = CompressionHookState(None, "auto", quantize_mode="all_gather")
    want = [dataclasses.replace(c, scheme="all_gather") if isinstance(c, Quantize) else c for c in default_candidates()]
    assert list(a._engine.auto.candidates) == want


def test_the_fsdp_comms_spec():
    from torsh_kernels.parallel import QuantizedCommSpec
    from torsh_kernels.parallel.fsdp_format import QuantizedFormat

    s = QuantizedCommSpec(weights="int4", grads=None, block=64)
    assert s.format("weights") == QuantizedFormat(bits=4, block=64) and s.format("grads") is None
    assert dict(s.signature_fields("comms"))["comms.weights"] == "int4"
    for bad, err, text in [
        (dict(weights="fp4"), InvalidArgumentError, "weights='fp4'"),
        (dict(block=48), InvalidArgumentError, "block must be a power of two"),
        (dict(block=True), InvalidArgumentError, "block must be a power of two"),
        (dict(error_feedback=1), ArgumentTypeError, "error_feedback must be True or False"),
    ]:
        with pytest.raises(err, match=text):
            QuantizedCommSpec(**bad)
    with pytest.raises(InvalidArgumentError, match=r"bits must be one of \(8, 4\)"):
        QuantizedFormat(bits=2)
    assert QuantizedCommSpec(weights="fp8", grads="fp8:e5m2").format("grads") == QuantizedFormat(bits=8, fmt="e5m2")
    with pytest.raises(InvalidArgumentError, match="fp8 codes"):
        QuantizedFormat(bits=4, fmt="e4m3")
    with pytest.raises(InvalidArgumentError, match="fmt="):
        QuantizedFormat(fmt="e3m4")
