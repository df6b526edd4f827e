"""Layer 3: gradient compression. The Compressor contract (:mod:`.base`), one module per compressor
(:mod:`.cast`: none, fp16, bf16; :mod:`.topk`; :mod:`.quantize`; :mod:`.fp8`; :mod:`.sign`;
:mod:`.powersgd`), the
compressed all-reduce driver that runs any compressor's rounds (:mod:`.allreduce`) and the planner that
prices them and picks one (:mod:`.planner`), and one name per compressor (:mod:`.names`: ``"int8"``,
``"topk:0.01"``, ``"powersgd:4"``, accepted wherever a compressor is). A new compressor is one new module
here, and one line in :mod:`.names`."""

from __future__ import annotations

from .allreduce import QUANTIZE_MODES, CompressedReduction, compressed_all_reduce, start_compressed_all_reduce
from .base import CompressionState, Compressor, Payload, roundtrip
from .cast import BF16, FP16, NoCompression
from .fp8 import FP8
from .names import COMPRESSOR_NAMES, DEFAULT_CANDIDATE_NAMES, compressor_from_name, compressor_name
from .planner import DEFAULT_CANDIDATES, Plan, compressed_time, measure_compute, plan
from .powersgd import PowerSGD, matrix_shape
from .quantize import Quantize, quantize_codes_dtype, quantize_shared_scale_cheaper
from .sign import Sign, sign_chunk, sign_segment_bytes
from .topk import TopK

__all__ = [
    "BF16",
    "COMPRESSOR_NAMES",
    "DEFAULT_CANDIDATES",
    "DEFAULT_CANDIDATE_NAMES",
    "FP8",
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
    "compressor_from_name",
    "compressor_name",
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
