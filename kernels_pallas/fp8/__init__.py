"""FP8 GEMMs with fine-grained scales (DeepGEMM's contract) and the FP8 casts: api.py (the entries), reference.py,
xla.py, pallas.py and grouped.py (the Pallas paths) with their kernels (pipelined.py, warp_specialized.py,
pallas_common.py) and tuning (tiling.py); quant.py: the casts; common.py: the operand checks."""

from kernels_pallas.fp8.api import fp8_gemm, fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked
from kernels_pallas.fp8.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from kernels_pallas.fp8.reference import (fp8_gemm_reference, fp8_grouped_gemm_contiguous_reference,
                                          fp8_grouped_gemm_masked_reference)
from kernels_pallas.fp8.tiling import KERNELS, Tiling

__all__ = ["KERNELS", "Tiling", "fp8_gemm", "fp8_gemm_reference", "fp8_grouped_gemm_contiguous",
           "fp8_grouped_gemm_contiguous_reference", "fp8_grouped_gemm_masked", "fp8_grouped_gemm_masked_reference",
           "per_block_cast_to_fp8", "per_token_cast_to_fp8"]
