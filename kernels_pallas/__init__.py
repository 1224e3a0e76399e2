"""Pallas kernels (Mosaic GPU for Hopper) with pure-jnp references: MLA decode, FP8 GEMMs, FP8 quantization.

Each kernel comes in four parts (DESIGN.md "Kernels"): kernel body, pallas wrapper, jitted entry with
``implementation=`` and tuning knobs, and a ``*_reference``. The kernels land with their own issue.
"""

from kernels_pallas.mla_decode import mla_decode, mla_decode_reference  # noqa: F401
from kernels_pallas.fp8_gemm import fp8_gemm, fp8_gemm_reference  # noqa: F401
from kernels_pallas.fp8_grouped_gemm import (  # noqa: F401
    fp8_grouped_gemm_contiguous,
    fp8_grouped_gemm_contiguous_reference,
    fp8_grouped_gemm_masked,
    fp8_grouped_gemm_masked_reference,
)
from kernels_pallas.quant import per_block_cast_to_fp8, per_token_cast_to_fp8  # noqa: F401
