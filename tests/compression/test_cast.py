"""The casting compressors: NoCompression, FP16, BF16 on one process, and what they declare for the wire."""

from __future__ import annotations

import torch

from tests.helpers import DEVICE, rand
from torsh_kernels.compression import BF16, FP16, NoCompression, roundtrip


def test_roundtrips_are_the_casts(gen):
    x = rand((33, 17), torch.float32, gen)
    out, (p,) = roundtrip(NoCompression(), x, NoCompression().new_state())
    assert torch.equal(out, x) and p.tensors["data"].data_ptr() == x.data_ptr()  # a view: nothing copied
    for c, dtype in ((FP16(), torch.float16), (BF16(), torch.bfloat16)):
        out, (p,) = roundtrip(c, x, c.new_state())
        assert p.tensors["data"].dtype == dtype and p.nbytes == 2 * x.numel()
        assert torch.equal(out, x.to(dtype).float())  # one rounding, to nearest even, and back


def test_decompress_scales_and_accumulates(gen):
    x = rand(101, torch.float32, gen)
    c = BF16()
    p = c.compress(x, c.new_state())
    out = rand(101, torch.float32, gen)
    start = out.clone()
    c.decompress(p, None, out, alpha=0.25, accumulate=True)
    torch.testing.assert_close(out, start + 0.25 * x.to(torch.bfloat16).float(), atol=1e-6, rtol=1e-6)
    assert out.device == DEVICE


def test_wire_description():
    for c, nbytes in ((NoCompression(), 4000), (FP16(), 2000), (BF16(), 2000)):
        (r,) = c.schemes(1000, torch.float32, 8)["all_reduce"]
        assert (r.collective, r.nbytes) == ("all_reduce", nbytes) == ("all_reduce", c.payload_nbytes(1000))
        assert c.is_linear and not c.stateful
    assert NoCompression().schemes(1000, torch.bfloat16, 8)["all_reduce"][0].nbytes == 2000
    assert FP16().prescale and not BF16().prescale and not NoCompression().prescale  # fp16 sums cannot overflow
    assert (NoCompression().passes, FP16().passes) == (0.0, 3.0)
