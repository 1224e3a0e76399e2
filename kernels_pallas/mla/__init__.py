"""MLA decode over a paged latent cache (FlashMLA's contract): api.py (the entry), reference.py, xla.py (the XLA path,
also the engine's CPU attention), query_blocks.py (the XLA path for a step laid out in query blocks, and the
expanded form over a step's own keys), pallas.py (the Pallas path) with its kernels (recompute_scores.py,
shared_scores.py, pallas_common.py) and work-item schedule (schedule.py); common.py: shapes and checks they
share."""

from kernels_pallas.mla.api import mla_decode
from kernels_pallas.mla.pallas import KERNELS, MLATuning
from kernels_pallas.mla.reference import mla_decode_reference
from kernels_pallas.mla.query_blocks import expanded_new_key_attention, query_block_attention
from kernels_pallas.mla.xla import DecodeWindow, chunked_attention

__all__ = ["KERNELS", "DecodeWindow", "MLATuning", "chunked_attention", "expanded_new_key_attention", "mla_decode",
           "mla_decode_reference", "query_block_attention"]
