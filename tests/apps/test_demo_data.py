"""The digits data `torsh demo` trains on ships with the package (apps/data/digits.npz): its arrays are
pinned by SHA-256, and, where scikit-learn happens to be installed, equal to ``load_digits()`` and give the
same split as the demo's earlier loader, which read them through scikit-learn."""

from __future__ import annotations

import hashlib
from importlib.resources import files

import numpy as np
import pytest
import torch

from torsh_kernels.apps.demo import load_digits_split

SHA256 = {
    "images": "8f26b2bd9d135c256808f68f14fdabddde6d9c7f869ae419704b051f0f14b3b3",
    "target": "8ba4f891220f5e4c9c819638d1602d74b83618f167043c6da52a2a247841ddf0",
}


def _arrays() -> dict[str, np.ndarray]:
    with files("torsh_kernels.apps").joinpath("data", "digits.npz").open("rb") as f, np.load(f) as d:
        return {k: d[k] for k in d.files}


def test_shipped_digits_are_the_pinned_arrays():
    a = _arrays()
    assert set(a) == set(SHA256)
    assert a["images"].dtype == np.uint8 and a["images"].shape == (1797, 64)
    assert a["target"].dtype == np.uint8 and a["target"].shape == (1797,)
    assert a["images"].max() == 16 and a["target"].max() == 9
    assert np.bincount(a["target"]).min() >= 170  # ten classes of about 180 images
    for k, digest in SHA256.items():
        assert hashlib.sha256(np.ascontiguousarray(a[k]).tobytes()).hexdigest() == digest, k


def test_split_is_fixed_per_seed_and_scaled():
    xtr, ytr, xte, yte = load_digits_split(0)
    assert xtr.shape == (1438, 64) and xte.shape == (359, 64) and ytr.shape == (1438,) and yte.shape == (359,)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert float(xtr.min()) == 0.0 and float(xtr.max()) == 1.0
    again = load_digits_split(0)
    assert all(torch.equal(u, v) for u, v in zip((xtr, ytr, xte, yte), again))
    assert not torch.equal(load_digits_split(1)[3], yte)


def test_same_data_and_split_as_scikit_learn():
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is not installed (not a dependency)")
    d = datasets.load_digits()
    a = _arrays()
    assert np.array_equal(a["images"], d.data) and np.array_equal(a["target"], d.target)
    for seed in (0, 3):  # the demo's loader before the data shipped with the package
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.int64)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        te, tr = perm[: len(y) // 5], perm[len(y) // 5 :]
        for got, want in zip(load_digits_split(seed), (x[tr], y[tr], x[te], y[te])):
            assert got.dtype == want.dtype and torch.equal(got, want)
