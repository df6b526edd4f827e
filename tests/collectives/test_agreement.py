"""The signature exchange (collectives/agreement.py): every rank raises the same CollectiveMismatchError
naming each differing field and each rank's value (also through a compressed all-reduce), exchanges once
per key, leaves the group usable, and notices a peer that was not exchanging. Real processes (gloo),
world size 3; the ways the layers' ranks can differ are tested with each layer."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import count_calls
from torsh_kernels.collectives import run_local
from torsh_kernels.collectives.agreement import ENV, agree, agree_once, enabled, message
from torsh_kernels.collectives.replica import ReplicaCommunicator
from torsh_kernels.errors import ArgumentTypeError, CollectiveMismatchError, InvalidArgumentError


def _world3_worker(comm) -> dict:
    from torsh_kernels.collectives.communicator import TorchCommunicator

    out = {}
    with count_calls(TorchCommunicator, "all_gather") as calls:
        me = comm.rank
        # equal fields: one all-gather, no error
        agree(comm, "a test", [("ratio", 0.5), ("shape", (3, 4))], what="test")
        out["equal"] = calls["all_gather"]
        # rank 2 differs in one field; a long value differs only beyond what a message shows
        long = "x" * 300 + ("b" if me == 2 else "a")
        try:
            agree(comm, "a test", [("ratio", 0.5 if me < 2 else 0.25), ("shape", (3, 4)), ("long", long)], what="test")
        except CollectiveMismatchError as e:
            out["one"] = str(e)
        out["one_calls"] = calls["all_gather"] - out["equal"]  # the table, then the descriptions
        # ranks at different points (topics)
        try:
            agree(comm, "bucket" if me else "layer", [("n", 1)], what="test")
        except CollectiveMismatchError as e:
            out["topics"] = str(e)
        # through a layer: a compressed all-reduce whose top-k ratio differs on rank 2
        from torsh_kernels.compression import TopK, compressed_all_reduce

        c = TopK(0.25 if me == 2 else 0.1)
        try:
            compressed_all_reduce(torch.randn(100), comm, c, c.new_state(seed=me))
        except CollectiveMismatchError as e:
            out["topk"] = str(e)
        # the group is usable afterwards: nothing mismatched was sent
        t = torch.full((4,), float(me))
        comm.all_reduce(t)
        out["sum"] = t.tolist()
        # agree_once: one exchange per key, none when the key was agreed before
        n0 = calls["all_gather"]
        made = [agree_once(comm, ("k", 1), "a test", lambda: [("v", 1)], what="test") for _ in range(3)]
        made.append(agree_once(comm, ("k", 2), "a test", lambda: [("v", 2)], what="test"))
        out["once"] = (made, calls["all_gather"] - n0)
        # a peer that issues another collective of the table's size: the exchanging ranks see no marker
        if me == 0:
            comm.all_gather(torch.empty(3 * 8, dtype=torch.int64), torch.arange(8, dtype=torch.int64))
        else:
            try:
                agree(comm, "a test", [("v", 1)], what="test")
            except CollectiveMismatchError as e:
                out["stranger"] = str(e)
    return out


def test_every_rank_raises_the_same_error_naming_each_difference():
    out = run_local(_world3_worker, 3, op_timeout=30)
    for r, res in enumerate(out):
        assert res["equal"] == 1
        assert res["one"] == out[0]["one"]  # the same message on every rank
        m = res["one"]
        assert "ratio: 0.5 on ranks 0, 1, 0.25 on rank 2" in m and "shape" not in m, m
        assert "long: " + "x" * 200 in m and "(differs further on)" in m, m
        assert "nothing was sent" in m
        assert res["one_calls"] == 2
        assert "different points" in res["topics"] and "layer on rank 0, bucket on ranks 1, 2" in res["topics"]
        assert "compressor.ratio: 0.1 on ranks 0, 1, 0.25 on rank 2" in res["topk"], res["topk"]
        assert res["sum"] == [3.0] * 4
        assert res["once"] == ([True, False, False, True], 2)
        if r:
            assert "rank 0 issued another collective" in res["stranger"], res["stranger"]


def test_nothing_is_exchanged_without_peers():
    class NoNetwork(ReplicaCommunicator):
        def all_gather(self, *a, **kw):
            raise AssertionError("no collective expected")

    agree(NoNetwork(4), "a test", [("v", 1)], what="test")  # a replica's ranks are all this process
    assert not agree_once(NoNetwork(4), "k", "a test", lambda: [("v", 1)], what="test")
    agree(NoNetwork(1), "a test", [("v", 1)], what="test")


def test_message_groups_ranks_by_value_and_names_a_class_change_once():
    def desc(topic, **fields):
        return {"topic": topic, "fields": [[k, str(v), str(hash(str(v)))] for k, v in fields.items()]}

    m = message("w", [desc("t", compressor="TopK", **{"compressor.ratio": 0.1}),
                      desc("t", compressor="Quantize", **{"compressor.bits": 8})], "Fix it.")  # fmt: skip
    assert "compressor: TopK on rank 0, Quantize on rank 1" in m and "compressor." not in m and m.endswith("Fix it.")


def test_the_switch_and_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert enabled(None, "w") is True
    for v, want in (("0", False), ("off", False), ("1", True), ("", True), ("yes", True)):
        monkeypatch.setenv(ENV, v)
        assert enabled(None, "w") is want
    assert enabled(True, "w") is True and enabled(False, "w") is False
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(InvalidArgumentError, match=ENV):
        enabled(None, "w")
    for bad in (1, "yes", 0.0):
        with pytest.raises(ArgumentTypeError):
            enabled(bad, "w")


def test_fields_of_is_specs_then_layout_then_extra():
    from torsh_kernels.collectives.agreement import fields_of, layout
    from torsh_kernels.compression import TopK
    from torsh_kernels.parallel import BucketSpec

    ts = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)]
    assert layout(ts) == [
        ("tensors", 2),
        ("numel", 10),
        ("shapes", [(2, 3), (4,)]),
        ("dtypes", ["float32", "bfloat16"]),
    ]
    f = fields_of({"compressor": TopK(0.1), "bucket": BucketSpec(policy="bucket")}, ts, [("iteration", 3)])
    names = [n for n, _ in f]
    assert names[0] == "compressor" and "compressor.ratio" in names and "bucket.policy" in names
    assert names.index("bucket.policy") < names.index("tensors") < names.index("iteration") == len(names) - 1
    assert dict(f)["bucket.policy"] == "bucket" and dict(f)["compressor.ratio"] == 0.1
