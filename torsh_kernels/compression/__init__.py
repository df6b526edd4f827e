"""Layer 3: gradient compression. The Compressor contract (:mod:`.base`), one module per compressor
(:mod:`.cast`: none, fp16, bf16; :mod:`.topk`; :mod:`.quantize`; :mod:`.sign`; :mod:`.powersgd`), the
compressed all-reduce driver that runs any compressor's rounds (:mod:`.allreduce`) and the planner that
prices them and picks one (:mod:`.planner`). A new compressor is one new module here."""

from __future__ import annotations

from .allreduce import QUANTIZE_MODES, CompressedReduction, compressed_all_reduce, start_compressed_all_reduce
from .base import CompressionState, Compressor, Payload, roundtrip
from .cast import BF16, FP16, NoCompression
from .planner import DEFAULT_CANDIDATES, Plan, compressed_time, measure_compute, plan
from .powersgd import PowerSGD, matrix_shape
from .quantize import Quantize, quantize_codes_dtype, quantize_shared_scale_cheaper
from .sign import Sign, sign_chunk, sign_segment_bytes
from .topk import TopK

__all__ = [
    "BF16",
    "DEFAULT_CANDIDATES",
    "FP16",
    "QUANTIZE_MODES",
    "CompressedReduction",
    "CompressionState",
    "Compressor",
    "NoCompression",
    "Payload",
    "Plan",
    "PowerSGD",
    "Quantize",
    "Sign",
    "TopK",
    "compressed_all_reduce",
    "compressed_time",
    "matrix_shape",
    "measure_compute",
    "plan",
    "quantize_codes_dtype",
    "quantize_shared_scale_cheaper",
    "roundtrip",
    "sign_chunk",
    "sign_segment_bytes",
    "start_compressed_all_reduce",
]
