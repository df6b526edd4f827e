"""Sign on one process, and the chunking of its two-phase all-reduce (tested end to end in test_allreduce)."""

from __future__ import annotations

import torch

from tests.helpers import rand
from torsh_kernels.compression import Sign, roundtrip, sign_chunk, sign_segment_bytes
from torsh_kernels.ops import sign_compress_ref, sign_decompress_ref


def test_roundtrip_is_scale_times_sign_with_the_error_kept(gen):
    c = Sign()
    state = c.new_state()
    x = rand(999, torch.float32, gen)
    out, (p,) = roundtrip(c, x, state)
    bits, scale = sign_compress_ref(x)
    assert torch.equal(p.tensors["bits"], bits)
    torch.testing.assert_close(out, sign_decompress_ref(bits, scale, 999), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state.tensors["residual"], x - out, atol=1e-6, rtol=1e-6)
    assert p.nbytes == c.payload_nbytes(999) == 125 + 4


def test_chunks_align_the_scales_and_the_wire_matches():
    for n, ws in ((1, 2), (999, 3), (4097, 4), (5, 8)):
        chunk = sign_chunk(n, ws)
        assert chunk % 32 == 0 and chunk * ws >= n  # whole 32-bit words: the scale after the bits is aligned
        seg = sign_segment_bytes(n, ws)
        assert seg == chunk // 8 + 4
        a2a, ag = Sign().schemes(n, torch.float32, ws)["all_to_all+all_gather"]
        assert (a2a.collective, a2a.nbytes, ag.collective, ag.nbytes) == ("all_to_all", ws * seg, "all_gather", seg)
