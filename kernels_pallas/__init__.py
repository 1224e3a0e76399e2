"""Pallas kernels (Mosaic GPU for Hopper) with pure-jnp references, one package per op: mla/ (MLA decode over a paged
latent cache) and fp8/ (FP8 GEMMs with fine-grained scales, and the FP8 casts).

Each kernel comes in four parts (docs/architecture.md "Kernels"): kernel body, pallas wrapper, jitted entry with
``implementation=`` and tuning knobs, and a ``*_reference``. common.py holds what the packages share, _mosaic.py the
one use of private JAX APIs. This package is the lowest layer: it imports nothing of jaxinfer.
"""

from kernels_pallas.fp8 import (fp8_gemm, fp8_gemm_reference, fp8_grouped_gemm_contiguous,
                                fp8_grouped_gemm_contiguous_reference, fp8_grouped_gemm_masked,
                                fp8_grouped_gemm_masked_reference, per_block_cast_to_fp8, per_token_cast_to_fp8)
from kernels_pallas.mla import mla_decode, mla_decode_reference

__all__ = ["fp8_gemm", "fp8_gemm_reference", "fp8_grouped_gemm_contiguous", "fp8_grouped_gemm_contiguous_reference",
           "fp8_grouped_gemm_masked", "fp8_grouped_gemm_masked_reference", "mla_decode", "mla_decode_reference",
           "per_block_cast_to_fp8", "per_token_cast_to_fp8"]
