"""torsh_kernels.checks (the one checker module) and torsh_kernels.specs (the Spec base)."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest
import torch

from torsh_kernels.checks import check_bool, check_choice, check_int, check_number, check_optional_int, short
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.specs import Spec, local, plain


def test_check_bool():
    assert check_bool(True, "f", "x") is True and check_bool(False, "f", "x") is False
    for bad in (0, 1, None, "True", np.bool_(True), torch.tensor(True)):
        with pytest.raises(ArgumentTypeError, match="f: x must be True or False"):
            check_bool(bad, "f", "x")


def test_check_int():
    assert check_int(3, "f", "n") == 3
    v = check_int(np.int64(7), "f", "n", 0, 9)
    assert v == 7 and type(v) is int  # a NumPy integer comes back as an int
    for bad in (True, 2.0, "3", None, torch.tensor(3)):
        with pytest.raises(ArgumentTypeError, match="f: n must be an int"):
            check_int(bad, "f", "n")
    with pytest.raises(InvalidArgumentError, match=r"f: n=0 must be an int >= 1"):
        check_int(0, "f", "n", 1)
    with pytest.raises(InvalidArgumentError, match=r"f: n=10 must be an int in \[1, 9\]"):
        check_int(10, "f", "n", 1, 9)
    with pytest.raises(InvalidArgumentError, match=r"f: n=10 must be an int <= 9"):
        check_int(10, "f", "n", hi=9)
    big = 10**100
    with pytest.raises(InvalidArgumentError, match=r"\.\.\. must be an int"):  # cut to a readable length
        check_int(big, "f", "n", hi=9)
    assert check_optional_int(None, "f", "n", 1) is None and check_optional_int(2, "f", "n", 1) == 2


def test_check_number():
    assert check_number(2, "f", "x") == 2.0 and type(check_number(2, "f", "x")) is float
    assert check_number(np.float32(0.5), "f", "x", lo=0, hi=1) == 0.5
    for bad in (True, "1", None, torch.tensor(1.0)):
        with pytest.raises(ArgumentTypeError, match="f: x must be a number"):
            check_number(bad, "f", "x")
    for bad in (math.nan, math.inf, -math.inf, 10**400):
        with pytest.raises(InvalidArgumentError, match="must be a finite number"):
            check_number(bad, "f", "x")
    with pytest.raises(InvalidArgumentError, match=r"x=0 must be a finite number > 0"):
        check_number(0, "f", "x", lo=0, lo_open=True)
    with pytest.raises(InvalidArgumentError, match=r"x=1 must be a finite number in \[0, 1\)"):
        check_number(1, "f", "x", lo=0, hi=1, hi_open=True)
    assert check_number(0, "f", "x", lo=0) == 0.0


def test_check_choice():
    assert check_choice("a", "f", "mode", ("a", "b")) == "a"
    for bad in ("c", None, 1, b"a"):
        with pytest.raises(InvalidArgumentError, match=r"f: mode=.*; expected one of 'a', 'b'"):
            check_choice(bad, "f", "mode", ("a", "b"))


def test_short():
    assert short(torch.zeros(2, 3)) == "tensor(2, 3)"
    assert len(short(list(range(1000)))) == 60


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Demo(Spec):
    k: int
    """Required."""
    mode: str = "a"
    """A choice."""
    provider: str | None = local(None)
    """Not agreed on."""

    def __post_init__(self) -> None:
        self.normalize("k", check_int(self.k, "_Demo", "k", 1))
        check_choice(self.mode, "_Demo", "mode", ("a", "b"))


def test_a_spec_is_validated_once_frozen_hashable_and_picklable():
    s = _Demo(k=np.int32(2))
    assert s.k == 2 and type(s.k) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.k = 3  # type: ignore[misc]
    assert hash(s) == hash(_Demo(k=2)) and s == _Demo(k=2) and s != _Demo(k=2, mode="b")
    assert pickle.loads(pickle.dumps(s)) == s
    assert not hasattr(s, "__dict__")  # slotted
    with pytest.raises(InvalidArgumentError, match="_Demo: k=0"):
        _Demo(k=0)
    with pytest.raises(TypeError):
        _Demo(2)  # type: ignore[misc]  # keyword-only
    assert s.replace(mode="b").mode == "b"
    with pytest.raises(InvalidArgumentError, match="mode="):
        s.replace(mode="c")  # validated again


def test_signature_leaves_out_local_fields_and_nests_specs():
    s = _Demo(k=2, provider="cpu")
    assert s.signature() == (("spec", "_Demo"), ("k", 2), ("mode", "a"))
    assert s.signature() == _Demo(k=2, provider="torch").signature()
    assert s.signature_fields("router") == [("router.k", 2), ("router.mode", "a")]
    assert plain(s) == s.signature() and plain([s, 1]) == (s.signature(), 1)
    assert plain(object()) == "<object>"


def test_build_from_keywords():
    assert _Demo.build(None, {"k": 3}, "f") == _Demo(k=3)
    assert _Demo.build(None, {"k": 3}, "f") is _Demo.build(None, {"k": 3}, "f")  # built once per keywords
    with pytest.raises(ArgumentTypeError, match="k must be an int"):  # equal to 3, cached, but not an int
        _Demo.build(None, {"k": 3.0}, "f")
    base = _Demo(k=2)
    assert _Demo.build(base, {}, "f") is base
    assert _Demo.build(base, {"mode": "b"}, "f") == _Demo(k=2, mode="b")  # keywords refine a spec
    with pytest.raises(ArgumentTypeError, match=r"f: unexpected keyword argument.*'kk'.*fields are k, mode, provider"):
        _Demo.build(None, {"kk": 3}, "f")
    with pytest.raises(ArgumentTypeError, match=r"f: .*missing 1 required keyword-only argument: 'k'"):
        _Demo.build(None, {}, "f")
    with pytest.raises(ArgumentTypeError, match="f: spec must be a _Demo or None, got dict"):
        _Demo.build({"k": 1}, {}, "f")
    with pytest.raises(InvalidArgumentError, match="f: k=0"):
        _Demo.build(None, {"k": 0}, "f")
