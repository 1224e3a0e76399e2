"""MLA decode over a paged latent cache: the public entry (FlashMLA's ``flash_mla_with_kvcache`` contract,
docs/architecture.md "FlashMLA decode contract").

Four parts (docs/architecture.md "Kernels"): the Mosaic GPU kernel bodies (recompute_scores.py, shared_scores.py) ->
their ``plgpu.kernel`` wrappers, run by the Pallas path with its work-item schedule and split combine (pallas.py,
schedule.py) -> ``mla_decode`` (this module: ``implementation="pallas" | "xla"``, tuning knobs) ->
``mla_decode_reference`` (reference.py, plain jnp, fp32). xla.py is the XLA path, which the engine uses on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import _mosaic
from kernels_pallas.common import choose_implementation
from kernels_pallas.mla.common import check_inputs
from kernels_pallas.mla.pallas import MLATuning, check_kernel_knobs, decode_pallas, pallas_unsupported
from kernels_pallas.mla.xla import chunked_attention


@functools.partial(jax.jit, static_argnames=("head_dim_v", "softmax_scale", "causal", "implementation",
                                             "interpret", "tuning", "block_pages"))
def _mla_decode_jit(q, kv_cache, block_table, cache_seqlens, *, head_dim_v, softmax_scale, causal, implementation,
                    interpret, tuning, block_pages):
    if implementation == "xla":
        return chunked_attention(q, kv_cache, block_table.astype(jnp.int32), cache_seqlens.astype(jnp.int32),
                                 head_dim_v=head_dim_v, softmax_scale=softmax_scale, chunk_pages=block_pages,
                                 causal=causal)
    return decode_pallas(q, kv_cache, block_table, cache_seqlens, head_dim_v=head_dim_v, scale=softmax_scale,
                         causal=causal, tuning=tuning, interpret=interpret)


def mla_decode(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=512, softmax_scale=None, causal=False,
               implementation=None, interpret=None, num_splits=None, num_sms=None, block_dv=None, num_stages=2,
               kernel="recompute_scores", block_pages=16):
    """MLA decode over a paged latent cache (FlashMLA ``flash_mla_with_kvcache`` semantics). Returns (out, lse).

    q [B, Q, N, D]; kv_cache [pages, S, G, D]; block_table [B, P] int32; cache_seqlens [B] int32 (>= Q when
    causal); V = kv_cache[..., :head_dim_v]. out [B, Q, N, head_dim_v] in q's dtype, lse [B, N, Q] float32.
    softmax_scale None = D ** -0.5. causal: query i sees keys < seqlen - Q + i + 1.

    implementation: None = "pallas" on a CUDA GPU where the kernels support the cache (page size 64, d and dv
    multiples of 64, a bfloat16 or float16 cache), "xla" elsewhere. interpret (pallas only): None = GPU interpret
    mode where the backend cannot run Mosaic GPU natively; True/False force it.
    Tuning knobs (pallas; ``MLATuning``): num_splits (None: FlashMLA-style work items balanced over the batch's
    lengths, ``schedule.balanced_schedule``; an int: that many equal KV splits per sequence), num_sms (the SMs the
    balanced schedule fills, e.g. fewer when communication kernels hold some, as DeepEP's do; None: the device's
    count, 132 where it has none), block_dv (output columns per compute warpgroup; None = min(256, head_dim_v)),
    num_stages (pages in flight; 2 fits D = 576 in SMEM; a configuration over the 227 KB per CTA raises
    ValueError), kernel ("recompute_scores": every compute warpgroup computes the page's scores itself; "pingpong":
    the same, the compute warpgroups taking turns at the tensor cores (FlashAttention-3's ping-pong);
    "shared_scores": warpgroup 0 computes them once and hands P to the others through SMEM, FlashMLA's structure;
    see pallas.py). xla: block_pages (pages per online-softmax step).
    """
    b, s_q, h_q, d, h_kv, _, ps = check_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v)
    block_dv = min(256, head_dim_v) if block_dv is None else block_dv
    check_kernel_knobs(kernel, num_stages)  # whatever the implementation, as fp8_gemm's kernel=
    implementation = choose_implementation(
        implementation, gpu=not _mosaic.default_interpret(),
        unsupported=pallas_unsupported(d, head_dim_v, ps, kv_cache.dtype, block_dv))
    scale = float(d ** -0.5 if softmax_scale is None else softmax_scale)
    tuning = None
    if implementation == "pallas":
        tuning = MLATuning(num_splits=num_splits, block_dv=block_dv, num_stages=num_stages, kernel=kernel,
                           num_sms=_mosaic.device_sm_count() if num_sms is None else num_sms)
        if interpret is None:
            interpret = _mosaic.default_interpret()
        interpret = _mosaic.interpret_params() if interpret else None
    elif block_pages < 1:
        raise ValueError(f"{block_pages=} must be >= 1")
    return _mla_decode_jit(q, kv_cache, block_table, cache_seqlens, head_dim_v=head_dim_v, softmax_scale=scale,
                           causal=bool(causal), implementation=implementation, interpret=interpret, tuning=tuning,
                           block_pages=block_pages)
