"""The Pallas path of MLA decode: pack the query rows, schedule the work items (schedule.py), run a kernel variant on
grid (items, G * row blocks), merge each sequence's items. benchmarks/kernels_mla.py --breakdown times the stages.

Kernel variants (``MLATuning.kernel``), two bodies; all stream the item's pages through one producer warpgroup's SMEM
ring (pallas_common.py) and write the same per-item outputs:
- "recompute_scores" (default) and "pingpong": recompute_scores.py; every compute warpgroup computes the page's
  scores itself ("pingpong": taking turns at the tensor cores, FlashAttention-3's ping-pong);
- "shared_scores": shared_scores.py, FlashMLA's structure: warpgroup 0 computes the scores once per page and hands P
  to the other compute warpgroups through SMEM.
The default stays the variant measured on a GPU (docs/benchmarks.md "Kernels on GPU (H200)").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels_pallas._mosaic import HOPPER_SMS
from kernels_pallas.common import round_up
from kernels_pallas.mla.common import from_rows, to_rows
from kernels_pallas.mla.pallas_common import BLOCK_M
from kernels_pallas.mla.recompute_scores import recompute_scores_pallas
from kernels_pallas.mla.schedule import balanced_schedule, combine, even_schedule
from kernels_pallas.mla.shared_scores import shared_scores_pallas

KERNELS = ("recompute_scores", "shared_scores", "pingpong")


def check_kernel_knobs(kernel: str, num_stages: int) -> None:
    """The kernel variant and the ring depth (ValueError naming the knob)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got kernel={kernel!r}")
    if num_stages < 1:
        raise ValueError(f"{num_stages=} must be >= 1")


@dataclasses.dataclass(frozen=True)
class MLATuning:
    """The Pallas path's static knobs (``mla_decode``'s keyword arguments, resolved; checked on construction).

    num_splits: None = FlashMLA-style work items balanced over the batch's lengths (schedule.balanced_schedule), an
    int = that many equal KV splits per sequence; num_sms: the SMs the balanced schedule fills; block_dv: output
    columns per compute warpgroup (head_dim_v / block_dv compute warpgroups); num_stages: pages in flight in the SMEM
    ring; kernel: the variant (``KERNELS``, module docstring)."""

    num_splits: int | None = None
    num_sms: int = HOPPER_SMS
    block_dv: int = 256
    num_stages: int = 2
    kernel: str = "recompute_scores"

    def __post_init__(self):
        check_kernel_knobs(self.kernel, self.num_stages)
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be None or >= 1")
        if self.num_sms < 1:
            raise ValueError(f"num_sms={self.num_sms} must be None or >= 1")


def pallas_unsupported(d, head_dim_v, page_size, dtype, block_dv):
    """Why the Pallas kernels cannot run this cache layout (None: they can)."""
    if page_size != 64:
        return f"implementation='pallas' needs {page_size=} == 64 (FlashMLA's page size)"
    if d % 64 or block_dv < 64 or block_dv % 64 or head_dim_v % block_dv:
        return (f"implementation='pallas' needs d={d} divisible by 64 and head_dim_v={head_dim_v} divisible by "
                f"{block_dv=}, itself a multiple of 64")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (f"implementation='pallas' needs a bfloat16 or float16 cache (the wgmma operands; q is cast to it), "
                f"got {jnp.dtype(dtype).name}")
    return None


def pack_rows(q, h_kv, dtype):
    """q [B, Q, N, D] -> q_rows [B, G, R_pad, D] in ``dtype`` (common.to_rows), rows R..R_pad = 0: whole 64-row
    blocks."""
    q_rows = to_rows(q, h_kv)  # [B, G, R, D]
    r = q_rows.shape[2]
    return jnp.pad(q_rows, ((0, 0), (0, 0), (0, round_up(r, BLOCK_M) - r), (0, 0))).astype(dtype)


def schedule_items(seqlens, q_rows, page_size, max_pages, tuning: MLATuning):
    """The work items (schedule.py): balanced over the lengths (num_splits None; one program per 64-row block of each
    kv head; max_pages = the block table's width) or num_splits equal splits per sequence."""
    if tuning.num_splits is None:
        _, h_kv, r_pad, _ = q_rows.shape
        return balanced_schedule(seqlens, page_size=page_size, programs_per_item=h_kv * (r_pad // BLOCK_M),
                                 num_sms=tuning.num_sms, max_pages=max_pages)
    return even_schedule(seqlens, page_size=page_size, num_splits=tuning.num_splits)


def run_items(q_rows, kv_cache, seqlens, items, table, *, tuning: MLATuning, **kw):
    """Run the ``tuning.kernel`` variant: (o_part [N, G, R_pad, V] f32, lse_part [N, G, R_pad] f32 log2). kw: s_q, m,
    head_dim_v, scale, causal, interpret (the wrappers' other arguments)."""
    kw = dict(kw, block_dv=tuning.block_dv, num_stages=tuning.num_stages)
    if tuning.kernel == "shared_scores":
        return shared_scores_pallas(q_rows, kv_cache, seqlens, items, table, **kw)
    return recompute_scores_pallas(q_rows, kv_cache, seqlens, items, table, pingpong=tuning.kernel == "pingpong",
                                   **kw)


def decode_pallas(q, kv_cache, block_table, cache_seqlens, *, head_dim_v, scale, causal, tuning: MLATuning,
                  interpret):
    """Pack q rows, schedule the work items, run the variant, merge each sequence's items in jnp -> (out
    [B, Q, N, V] in q's dtype, lse [B, N, Q] f32). interpret: GPU interpret-mode parameters, or None (native)."""
    b, s_q, h_q, _ = q.shape
    if b == 0:  # an empty batch: no work items (the schedule indexes sequence 0), nothing to launch
        return jnp.zeros((0, s_q, h_q, head_dim_v), q.dtype), jnp.zeros((0, h_q, s_q), jnp.float32)
    h_kv = kv_cache.shape[2]
    q_rows = pack_rows(q, h_kv, kv_cache.dtype)  # [B, G, R_pad, D]
    seqlens = cache_seqlens.astype(jnp.int32)
    sched = schedule_items(seqlens, q_rows, kv_cache.shape[1], block_table.shape[1], tuning)
    o_part, lse_part = run_items(q_rows, kv_cache, seqlens, sched.items, block_table.astype(jnp.int32),
                                 tuning=tuning, s_q=s_q, m=h_q // h_kv, head_dim_v=head_dim_v, scale=scale,
                                 causal=causal, interpret=interpret)
    out, lse = combine(o_part, lse_part, sched.row_seq, batch=b, rows=s_q * (h_q // h_kv))  # [B, G, R, V], [B, G, R]
    out, lse = from_rows(out, lse, s_q)
    return out.astype(q.dtype), lse
