"""The static tuning of one FP8 GEMM call (``Tiling``: kernel variant, tile sizes, pipeline depth, multicast): the
defaults and the checks of the knobs, for both kernels (pipelined.py, warp_specialized.py).

Defaults follow DeepGEMM's heuristic (deep_gemm/jit_kernels/gemm.py ``get_best_configs``, early 2025): among the
candidate tile widths, the fewest waves of output tiles over the SMs, then the fullest last wave, then (same
block_m) the narrower tile; then the deepest TMA pipeline that fits shared memory. Ours differs where our kernels
do:
- widths that divide n come first: the wrappers pad B to a multiple of block_n (a copy of the weights per call),
  DeepGEMM's TMA reads past the edge instead;
- the pipelined kernel (one warpgroup per CTA, not persistent) always takes 64-row tiles and asks for a pipeline
  shallow enough that two CTAs share an SM, so one CTA's promotion overlaps the other's wgmma (what DeepGEMM gets
  from its two math warpgroups);
- every config must keep its accumulators in registers (``check_registers``);
- the warp-specialized kernel takes the deepest ring that divides the k-steps (at least MIN_CHAINED_STAGES deep)
  when one fits: its pipelines then chain from one output tile to the next (``chains_tiles``, warp_specialized.py), so
  the producer loads the next tile while the consumers finish this one, as DeepGEMM's TMA warp does. DeepGEMM
  keeps its stage count and pads a tile's last round of stages with empty ones instead; emit_pipeline has no
  empty steps, hence the divisor.

Register rule: per k-step a warpgroup holds the wgmma's fresh fp32 accumulator and the promoted fp32 sum, each
rows x block_n / 128 registers per thread (128 threads). A thread has at most 255 registers (sm90; 232 in the
warp-specialized consumers, after setmaxnreg); with the addresses, scale vectors and loop state, two accumulators
must stay within MAX_ACC_REGISTERS. The limit is ptxas's own verdict on these kernels (ptxas -v for sm_90a,
benchmarks/kernels_ptxas.py --offline; docs/benchmarks.md "Kernel registers and spills (ptxas, no GPU)"): 160
accumulator registers compile without spills in both kernels, 192 spill in the k-loop in both. DeepGEMM's
BLOCK_M = 128 likewise splits the rows over two math warpgroups (64 each).
"""

from __future__ import annotations

import dataclasses

from kernels_pallas.common import SMEM_BYTES, cdiv

BLOCK_K = 128             # one scale per 128 channels (DeepGEMM): a k-step is one scale block
NUM_CONSUMERS = 2         # warp-specialized kernel: DeepGEMM get_num_math_warpgroups(BLOCK_M = 128) = 2
MAX_ACC_REGISTERS = 160   # two fp32 accumulator tiles per thread; 192 spill (ptxas, module docstring)
SMEM_SLACK = 2048         # barriers and allocation alignment
# Default widths: divisors of 128 and no wider, so no tile straddles two 128-column scale blocks. Explicit block_n 96
# and 160 are valid: a straddling tile promotes 32 columns at a time with one B scale each (pallas_common.promote).
# DeepGEMM's wave rule would take 160 at n = 7168 (45 column tiles: 11 waves of 132 against 14 at 128), but 160
# divides none of the goal shapes' n, so our wrappers would copy B per call; the GPU check's tiling sweep
# (128x160x4) says whether the fewer waves pay for it. At 64 rows, wider pipelined tiles would leave one CTA per SM;
# 160 is the register rule's limit at block_m = 128.
PIPELINED_BLOCK_NS = (128, 64, 32)
WS_BLOCK_NS = (128, 64, 32)
PIPELINED_MAX_STAGES = 6
WS_STAGES = (8, 7, 6, 5, 4, 3, 2)                 # DeepGEMM's candidates (8 .. 3), deepest that fits first
MIN_CHAINED_STAGES = 3    # a shallower chained ring is not worth the depth it gives up (a judgement, unmeasured)
KERNELS = ("pipelined", "warp_specialized")
# B's block scales per k-step copy (pallas_common.load_scales): 32 floats = 128 bytes, from a multiple of 16, so the
# window holds the one or two 128-column blocks a tile spans. Mosaic GPU (Lane semantics) splits a copy's bytes over
# the 128 threads of a warpgroup; 64-byte copies did not lower (hence also block_n % 32 == 0).
SCALE_WINDOW = 32
SCALE_WINDOW_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The static tuning of one FP8 GEMM call: CTA rows and columns, TMA pipeline depth, multicast and the kernel
    variant (``KERNELS``)."""

    block_m: int
    block_n: int
    stages: int
    multicast: int = 1     # warp_specialized: 2 = CTA pairs (a cluster) share each A tile by TMA multicast
    kernel: str = "pipelined"

    def stage_bytes(self) -> int:
        """Bytes one k-step's copies bring into SMEM (one ring slot): the e4m3 A and B tiles, the f32 A-row scales
        and B's window of block scales."""
        return (self.block_m + self.block_n) * BLOCK_K + 4 * (self.block_m + SCALE_WINDOW)

    def smem_bytes(self, out_itemsize: int) -> int:
        """Shared memory of one CTA: the ring (``stage_bytes`` per stage) and the epilogue tile."""
        return self.stages * self.stage_bytes() + self.block_m * self.block_n * out_itemsize + SMEM_SLACK


def rows_per_warpgroup(kernel: str, block_m: int) -> int:
    """Rows of the CTA tile one (consumer) warpgroup accumulates."""
    return block_m // NUM_CONSUMERS if kernel == "warp_specialized" else block_m


def accumulator_registers(rows: int, block_n: int) -> int:
    """fp32 registers per thread for a warpgroup's fresh and promoted accumulators of rows x block_n."""
    return 2 * rows * block_n // 128


def check_registers(kernel: str, block_m: int, block_n: int):
    rows = rows_per_warpgroup(kernel, block_m)
    regs = accumulator_registers(rows, block_n)
    if regs > MAX_ACC_REGISTERS:
        limit = MAX_ACC_REGISTERS * 128 // (2 * rows) // 32 * 32
        where = "per consumer warpgroup" if kernel == "warp_specialized" else "in the CTA's one warpgroup"
        raise ValueError(f"block_m={block_m} x block_n={block_n} ({rows} rows {where}) needs {regs} fp32 "
                         f"accumulator registers per thread (> {MAX_ACC_REGISTERS}, the most ptxas keeps without "
                         f"spilling in these kernels): use block_n <= {limit} at block_m={block_m}")


def check_knobs(t: Tiling, out_itemsize: int) -> Tiling:
    """Raise ValueError naming the bad knob; returns the tiling."""
    kernel = t.kernel
    check_kernel(kernel)
    if kernel == "warp_specialized":
        if t.block_m not in (128, 256):
            raise ValueError(f"block_m must be 128 or 256 for kernel='warp_specialized' (two consumer warpgroups "
                             f"of 64 or 128 rows, wgmma M granularity 64), got block_m={t.block_m}")
    elif t.block_m not in (64, 128):
        raise ValueError(f"block_m must be 64 or 128 (wgmma M granularity 64, one warpgroup), got "
                         f"block_m={t.block_m}")
    if t.block_n % 32 or not 32 <= t.block_n <= 256:
        raise ValueError(f"block_n must be a multiple of 32 in [32, 256] (wgmma N <= 256; the tile's B scales, "
                         f"block_n f32, are one TMA copy whose bytes Mosaic GPU splits over 128 threads), "
                         f"got block_n={t.block_n}")
    check_registers(kernel, t.block_m, t.block_n)
    if t.multicast not in (1, 2) or (t.multicast == 2 and kernel != "warp_specialized"):
        raise ValueError(f"multicast must be 1, or 2 with kernel='warp_specialized' (CTA pairs that share their A "
                         f"tile, DeepGEMM's TMA multicast), got multicast={t.multicast} with kernel={kernel!r}")
    if t.stages < 1:
        raise ValueError(f"stages must be >= 1, got stages={t.stages}")
    need = t.smem_bytes(out_itemsize)
    if need > SMEM_BYTES:
        raise ValueError(f"stages={t.stages} with block_m={t.block_m} block_n={t.block_n} needs {need} bytes of "
                         f"shared memory (> {SMEM_BYTES}): lower stages or block_n")
    return t


def pick_block_n(row_tiles: int, n: int, slots: int, candidates) -> int:
    """DeepGEMM's wave rule over the candidate widths (module docstring); widths dividing n first."""
    exact = [bn for bn in candidates if n % bn == 0]

    def cost(bn):
        tiles = row_tiles * cdiv(n, bn)
        waves = cdiv(tiles, slots)
        return waves, -(tiles - (waves - 1) * slots), bn

    return min(exact or candidates, key=cost)


def _pipelined_stages(t: Tiling, out_itemsize: int) -> int:
    """Deepest pipeline (<= PIPELINED_MAX_STAGES) with two CTAs per SM, else with one (at most 4)."""
    for ctas, cap in ((2, PIPELINED_MAX_STAGES), (1, 4)):
        for s in range(cap, 1, -1):
            if ctas * dataclasses.replace(t, stages=s).smem_bytes(out_itemsize) <= SMEM_BYTES:
                return s
    return 1


def chains_tiles(k_steps: int, stages: int) -> bool:
    """Whether the warp-specialized kernel chains its per-tile pipelines (emit_pipeline_warp_specialized's
    ``pipeline_state``): every tile must start at ring slot 0, so the ring depth must divide the k-steps."""
    return stages > 1 and k_steps % stages == 0


def check_kernel(kernel: str):
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel=}")


def resolve(kernel: str, block_m, block_n, block_k: int, stages, *, rows: int, n: int, num_sms: int,
            out_itemsize: int, multicast: int = 1, k_steps: int | None = None) -> Tiling:
    """Fill the knobs left None (module docstring) and check all of them. rows: rows whose tiles may run (dense
  m, contiguous m, masked G * m_max); num_sms: the persistent grid / wave size; k_steps: ceil(k / 128) (None:
  unknown, the deepest ring)."""
    check_kernel(kernel)
    if block_k != BLOCK_K:
        raise ValueError(f"block_k must be {BLOCK_K} (one scale per k-step), got {block_k=}")
    ws = kernel == "warp_specialized"
    if block_m is None:
        block_m = 128 if ws else 64
    if block_n is None:   # widths whose accumulators fit, and (multicast) that pair up the column tiles
        candidates = [bn for bn in (WS_BLOCK_NS if ws else PIPELINED_BLOCK_NS)
                      if accumulator_registers(rows_per_warpgroup(kernel, block_m), bn) <= MAX_ACC_REGISTERS
                      and cdiv(n, bn) % multicast == 0]
        block_n = pick_block_n(cdiv(rows, block_m), n, num_sms, candidates or [32])
    if stages is None:
        t = Tiling(block_m, block_n, 1)
        if ws:
            fits = [s for s in WS_STAGES
                    if dataclasses.replace(t, stages=s).smem_bytes(out_itemsize) <= SMEM_BYTES]
            chained = [s for s in fits if s >= MIN_CHAINED_STAGES and k_steps and chains_tiles(k_steps, s)]
            stages = (chained or fits or [1])[0]
        else:
            stages = _pipelined_stages(t, out_itemsize)
    t = check_knobs(Tiling(block_m, block_n, stages, multicast, kernel), out_itemsize)
    if multicast == 2 and cdiv(n, block_n) % 2:
        raise ValueError(f"multicast=2 pairs column tiles: n={n} with block_n={block_n} gives {cdiv(n, block_n)} "
                         f"tiles, an odd number (DeepGEMM's is_tma_multicast_legal): pick another block_n")
    return t
