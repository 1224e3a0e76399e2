"""FP8 GEMM with fine-grained scales (DeepGEMM's contract), as a Mosaic GPU (Hopper) Pallas kernel.

D[m, n] = sum over k-blocks kb of dot(A[m, kb], B[n, kb]) * As[m, kb] * Bs[n // 128, kb], fp32 accumulation
(DeepGEMM README / tests/test_core.py; DESIGN.md "DeepGEMM FP8 contract"). A [m, k] e4m3 with per-token-per-128
scales [m, ceil(k/128)]; B [n, k] e4m3 (checkpoint layout out x in) with 128x128 block scales
[ceil(n/128), ceil(k/128)]. Partial last blocks are zero-padded.

Four parts (DESIGN.md "Kernels"): ``_tile_kernel`` (body) -> ``tiled_fp8_gemm_pallas`` (``plgpu.kernel``
wrapper) -> ``fp8_gemm`` (jitted entry, ``implementation=``, tuning knobs) -> ``fp8_gemm_reference`` (jnp, fp32);
the warp-specialized variant's body and wrapper are ``_ws_kernel`` / ``ws_fp8_gemm_pallas`` in fp8_gemm_ws.py.

The kernel is shared with the grouped GEMMs (fp8_grouped_gemm.py): it multiplies row tiles of A, each tagged
with the group whose weights it uses (-1: skip the tile, its output rows are left unwritten). The dense GEMM is
the one-group case. Per output tile (block_m x block_n) and per k-step of 128 (so one A scale per row and one B
scale per column): an fp8 wgmma into a fresh fp32 accumulator, then promotion into the main fp32 accumulator
with the outer product of the A-row and B-column scales (DeepGEMM's two-level accumulation: the tensor cores'
fp8 accumulation only ever sums 128 products). K-steps are TMA-pipelined ``stages`` deep (``plgpu.emit_pipeline``).
B's block scales stay blocks: ``prepare_b`` only transposes and pads them ([G, kb, nbw], about 1/16384 byte per
weight), and each k-step copies a 32-scale window of them (fp8_tiling.py ``SCALE_WINDOW``). A tile inside one
128-block of n reads its single scale as one scalar; a tile that spans two (block_n 96, 160) is promoted 32 columns
at a time, each chunk with its block's scale (``load_scales``, ``promote``).

Two kernel variants, chosen with the static knob ``kernel=`` of every entry (fp8_gemm and the grouped GEMMs):
- ``"pipelined"`` (default): this file's ``_tile_kernel``, one warpgroup per CTA, grid (row tiles, column tiles),
  wgmma -> wait -> promote per k-step, so a CTA's tensor core work idles during each wait and promotion; its
  default tiles (64 rows, pipeline shallow enough for two CTAs per SM: fp8_tiling.py) let a second CTA fill them.
- ``"warp_specialized"``: fp8_gemm_ws.py, DeepGEMM's structure (a TMA producer warpgroup and two consumer
  warpgroups that each own half of a 128- or 256-row CTA tile, persistent grid of one CTA per SM, epilogue stores
  overlapped with the next tile). Same operands, tile -> group table and skipped tiles; not yet measured on a GPU,
  hence not the default.

GPU interpret mode runs the native code path itself from jax 0.11.2 on (the wgmma on the K-major B ref,
``plgpu.load`` with a layout; layouts are no-ops there). Before 0.11.2 (``_mosaic.substitute_wgmma``) it cannot run
either: the k-step product is then a value-level ``dot_general`` of the same two SMEM tiles and layouts are left
implicit. Everything else (grid, tile->group lookup, skipped tiles, TMA pipeline, scale vectors, promotion,
epilogue copies) is the same code in every mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernels_pallas import _mosaic, fp8_tiling
from kernels_pallas.fp8_gemm_ws import (check_probe, epilogue_smem, load_scales, num_sms, probe_step, promote,
                                        run_tile, scale_window_start, store_acc, ws_fp8_gemm_pallas)
from kernels_pallas.fp8_tiling import (BLOCK_K, KERNELS, SCALE_WINDOW, Tiling, _cdiv,  # noqa: F401 (re-exported)
                                       check_kernel)

FP8 = jnp.float8_e4m3fn


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


# ----------------------------------------------------------------------------------------------- validation
def check_operands(a, a_scale, b, b_scale, *, a_batch: tuple[int, ...] = (), b_batch: tuple[int, ...] = ()):
    """Validate A [*a_batch, m, k] / B [*b_batch, n, k] and their scales; returns (m, n, k). Raises ValueError."""
    for name, x, want in (("a", a, FP8), ("b", b, FP8), ("a_scale", a_scale, jnp.float32),
                          ("b_scale", b_scale, jnp.float32)):
        if jnp.dtype(x.dtype) != jnp.dtype(want):
            raise ValueError(f"{name} must be {jnp.dtype(want).name}, got {jnp.dtype(x.dtype).name}")
    if a.ndim != len(a_batch) + 2 or b.ndim != len(b_batch) + 2:
        raise ValueError(f"a must have {len(a_batch) + 2} dims and b {len(b_batch) + 2}, got {a.shape=} {b.shape=}")
    *ab, m, k = a.shape
    *bb, n, k2 = b.shape
    if tuple(ab) != tuple(a_batch) or tuple(bb) != tuple(b_batch):
        raise ValueError(f"batch dims: expected a {a_batch} and b {b_batch}, got {a.shape=} {b.shape=}")
    if k != k2:
        raise ValueError(f"contraction dims differ: a has k={k}, b has k={k2}")
    kb, nb = _cdiv(k, BLOCK_K), _cdiv(n, BLOCK_K)
    if a_scale.shape != (*a_batch, m, kb):
        raise ValueError(f"a_scale must be {(*a_batch, m, kb)} (ceil(k/128) = {kb}), got {a_scale.shape}")
    if b_scale.shape != (*b_batch, nb, kb):
        raise ValueError(f"b_scale must be {(*b_batch, nb, kb)} (ceil(n/128) = {nb}), got {b_scale.shape}")
    return m, n, k


def resolve(implementation, interpret):
    """implementation None -> "pallas" on a CUDA GPU, "xla" elsewhere; interpret None -> per backend."""
    if implementation is None:
        implementation = "xla" if _mosaic.default_interpret() else "pallas"
    if implementation not in ("pallas", "xla"):
        raise ValueError(f"implementation must be None, 'pallas' or 'xla', got {implementation!r}")
    if interpret is None:
        interpret = _mosaic.default_interpret()
    return implementation, bool(interpret)


# ----------------------------------------------------------------------------------------------- reference
def _block_product(a, a_scale, b, b_scale):
    """fp32 [m, n] = sum_kb (A_kb @ B_kb^T) * As[:, kb] * Bs[n // 128, kb], one k-block at a time (contract)."""
    m, k = a.shape
    n = b.shape[0]
    kb = _cdiv(k, BLOCK_K)
    ap = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, kb * BLOCK_K - k))).reshape(m, kb, BLOCK_K)  # (m, kb, 128)
    bp = jnp.pad(b.astype(jnp.float32), ((0, 0), (0, kb * BLOCK_K - k))).reshape(n, kb, BLOCK_K)  # (n, kb, 128)
    bs_col = jnp.repeat(b_scale, BLOCK_K, axis=0)[:n]                                              # (n, kb)

    def step(acc, j):
        part = jnp.dot(ap[:, j], bp[:, j].T, precision=lax.Precision.HIGHEST)                       # (m, n)
        return acc + part * a_scale[:, j, None] * bs_col[None, :, j], None

    acc, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), jnp.arange(kb))
    return acc


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_gemm_reference(a, a_scale, b, b_scale, *, out_dtype=jnp.bfloat16):
    """Plain-jnp fp32 reference of fp8_gemm: a [m, k] e4m3, b [n, k] e4m3 -> [m, n] out_dtype."""
    check_operands(a, a_scale, b, b_scale)
    return _block_product(a, a_scale, b, b_scale).astype(out_dtype)


# ----------------------------------------------------------------------------------------------- xla path
def dequantize_a(a, a_scale):
    """[..., m, k] e4m3 * per-token-per-128 scales -> float32."""
    k = a.shape[-1]
    return a.astype(jnp.float32) * jnp.repeat(a_scale, BLOCK_K, axis=-1)[..., :k]


def dequantize_b(b, b_scale):
    """[..., n, k] e4m3 * 128x128 block scales -> float32."""
    n, k = b.shape[-2:]
    s = jnp.repeat(jnp.repeat(b_scale, BLOCK_K, axis=-2), BLOCK_K, axis=-1)[..., :n, :k]
    return b.astype(jnp.float32) * s


def _fp8_gemm_xla(a, a_scale, b, b_scale, out_dtype):
    """Dequantize blockwise (exact in fp32) and one fp32 dot: the contract's sum, reassociated."""
    out = jnp.dot(dequantize_a(a, a_scale), dequantize_b(b, b_scale).T, precision=lax.Precision.HIGHEST,
                  preferred_element_type=jnp.float32)                                              # (m, n)
    return out.astype(out_dtype)


# ----------------------------------------------------------------------------------------------- kernel
def _tile_kernel(tile_group_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, o_gmem, o_smem, *,
                 block_m, block_n, num_k, stages, sim, probe=None):
    """One (block_m, block_n) output tile of row tile ti, group tile_group[ti] (-1: skip).

  a_gmem [T*bm, kp] e4m3, as_gmem [kb, T*bm] f32 (A scales, transposed), b_gmem [G, np, kp] e4m3,
  bs_gmem [G, kb, nbw] f32 (B block scales, transposed: prepare_b), o_gmem [T*bm, np]; o_smem (bm, bn) scratch.
  probe: fp8_gemm_ws.py ``PROBES`` (None: the kernel).
  """
    ti, ni = lax.axis_index("m"), lax.axis_index("n")
    g = tile_group_gmem[ti]
    swizzle = 128  # 128 fp8 = 128 bytes per k-row of a tile
    tiles = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))

    @pl.when(g >= 0)
    def _():
        gg = jnp.maximum(g, 0)

        def k_step(_, a_smem, b_smem, as_smem, bs_smem, acc):
            # scales first, so their SMEM latency hides under the wgmma (DeepGEMM reads them before it)
            sa, sb = load_scales(as_smem, bs_smem, ni * block_n, block_n, sim=sim)                  # (bm,), scalar(s)
            if sim:   # interpret mode: same tiles, value-level product (see module docstring)
                part = lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)                          # (bm, bn)
            else:
                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))                 # fp8, K-major B
                    return acc_ref[...]
                part = pl.run_scoped(mma, plgpu.ACC((block_m, block_n), jnp.float32))               # (bm, bn)
            # The step's one barrier: every thread's reads of this ring slot (scales, wgmma operands) are done
            # before emit_pipeline refills it right after this body. It stands in for the four barriers Pallas
            # would put before the four refill copies (CompilerParams(unsafe_no_auto_barriers=True) below).
            plgpu.commit_smem()
            return promote(acc, part, sa, sb)

        def probe_k_step(_, a_smem, b_smem, as_smem, bs_smem, acc):
            acc = probe_step(acc, a_smem, b_smem, probe=probe, sim=sim)
            plgpu.commit_smem()   # the k-step's one barrier, as in k_step
            return acc

        rows, cols = pl.ds(ti * block_m, block_m), pl.ds(ni * block_n, block_n)

        def run(acc0):
            return plgpu.emit_pipeline(
                k_step if probe is None else probe_k_step,
                grid=(num_k,),
                in_specs=[
                    plgpu.BlockSpec((block_m, BLOCK_K), lambda k: (0, k), transforms=tiles),
                    plgpu.BlockSpec((block_n, BLOCK_K), lambda k: (0, k), transforms=tiles),
                    plgpu.BlockSpec((None, block_m), lambda k: (k, 0)),
                    plgpu.BlockSpec((None, SCALE_WINDOW), lambda k: (k, 0)),
                ],
                max_concurrent_steps=stages,
                init_carry=acc0,
            )(a_gmem.at[rows], b_gmem.at[gg, cols], as_gmem.at[:, rows],
              bs_gmem.at[gg, :, pl.ds(scale_window_start(ni * block_n), SCALE_WINDOW)])

        acc = run_tile(run, (block_m, block_n), probe=probe, sim=sim)              # (bm, bn), or its column chunks
        store_acc(o_smem, acc)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)


def tiled_fp8_gemm_pallas(tile_group, a, a_scale_t, b, b_scale_t, *, block_m, block_n, stages, out_dtype,
                          interpret, probe=None):
    """Pallas wrapper. tile_group [T] int32; a [T*bm, kp]; a_scale_t [kb, T*bm]; b [G, np, kp];
  b_scale_t [G, kb, nbw] (prepare_b) -> [T*bm, np] out_dtype (rows of skipped tiles unwritten). kp = kb*128,
  np % bn = 0. probe: fp8_gemm_ws.py ``PROBES`` (None: the kernel)."""
    check_probe(probe)
    (t,) = tile_group.shape
    rows, kp = a.shape
    _, n_pad, _ = b.shape
    kernel = plgpu.kernel(
        functools.partial(_tile_kernel, block_m=block_m, block_n=block_n, num_k=kp // BLOCK_K, stages=stages,
                          sim=_mosaic.substitute_wgmma(interpret), probe=probe),
        out_type=jax.ShapeDtypeStruct((rows, n_pad), out_dtype),
        scratch_types=[epilogue_smem((block_m, block_n), out_dtype)],
        grid=(t, n_pad // block_n),
        grid_names=("m", "n"),
        # No automatic barriers: Pallas puts a warpgroup barrier before each of a k-step's four refill copies (A, B
        # and both scale windows: jax/_src/pallas/mosaic_gpu/primitives.py, copy_gmem_to_smem); the kernel places
        # the one it needs per k-step itself (k_step), and its epilogue's commit_smem orders the output tile's
        # writes before the TMA store. Safe by CompilerParams' two conditions: no thread reads and writes the same
        # SMEM, and no committed SMEM is read and then overwritten by an async copy.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=True),
        interpret=_mosaic.interpret_params() if interpret else False,
    )
    return kernel(tile_group, a, a_scale_t, b, b_scale_t)


def resolve_tiling(kernel: str, block_m, block_n, block_k: int, stages, *, rows: int, n: int, k: int, out_dtype,
                   interpret: bool, multicast: int = 1) -> Tiling:
    """The static knobs of a Pallas entry, None filled by fp8_tiling's DeepGEMM-style defaults and all checked
  (ValueError naming the knob). rows: rows whose tiles may run (dense m, contiguous m, masked G * m_max)."""
    return fp8_tiling.resolve(kernel, block_m, block_n, block_k, stages, rows=rows, n=n,
                              num_sms=num_sms(interpret), out_itemsize=jnp.dtype(out_dtype).itemsize,
                              multicast=multicast, k_steps=_cdiv(k, BLOCK_K))


def run_tiles(tile_group, a, a_scale_t, b, b_scale_t, *, kernel, tiling: Tiling, out_dtype, interpret, probe=None):
    """Dispatch to the chosen kernel variant (same operands, same result; see the module docstring)."""
    if kernel == "warp_specialized":
        return ws_fp8_gemm_pallas(tile_group, a, a_scale_t, b, b_scale_t, cfg=tiling, out_dtype=out_dtype,
                                  interpret=interpret, probe=probe)
    return tiled_fp8_gemm_pallas(tile_group, a, a_scale_t, b, b_scale_t, block_m=tiling.block_m,
                                 block_n=tiling.block_n, stages=tiling.stages, out_dtype=out_dtype,
                                 interpret=interpret, probe=probe)


def prepare_b(b, b_scale, block_n):
    """b [G, n, k], b_scale [G, nb, kb] -> padded b [G, np, kp] and the block scales transposed [G, kb, nbw],
  zero-padded so that every tile's window (fp8_tiling.py ``SCALE_WINDOW``) lies inside."""
    _, n, k = b.shape
    kb, nb = _cdiv(k, BLOCK_K), b_scale.shape[1]
    n_pad = _round_up(n, block_n)
    b_p = jnp.pad(b, ((0, 0), (0, n_pad - n), (0, kb * BLOCK_K - k)))                          # (G, np, kp)
    nbw = scale_window_start(n_pad - 1) + SCALE_WINDOW                   # the last tile's window end (>= nb)
    bs_t = jnp.pad(b_scale, ((0, 0), (0, nbw - nb), (0, 0))).swapaxes(1, 2)                     # (G, kb, nbw)
    return b_p, bs_t


def prepare_a(a, a_scale, rows):
    """a [m, k], a_scale [m, kb] -> a [rows, kp] zero-padded, transposed scales [kb, rows]."""
    m, k = a.shape
    kb = _cdiv(k, BLOCK_K)
    a_p = jnp.pad(a, ((0, rows - m), (0, kb * BLOCK_K - k)))                                    # (rows, kp)
    return a_p, jnp.pad(a_scale, ((0, rows - m), (0, 0))).T                                     # (kb, rows)


# ----------------------------------------------------------------------------------------------- entry
@functools.partial(jax.jit, static_argnames=("out_dtype", "implementation", "interpret", "block_m", "block_n",
                                             "block_k", "stages", "kernel", "multicast"))
def fp8_gemm(a, a_scale, b, b_scale, *, out_dtype=jnp.bfloat16, implementation=None, interpret=None,
             block_m=None, block_n=None, block_k=BLOCK_K, stages=None, kernel="pipelined", multicast=1):
    """D [m, n] = A [m, k] (e4m3, per-token-per-128 scales) x B [n, k]^T (e4m3, 128x128 block scales).

  implementation None: "pallas" on a CUDA GPU, "xla" elsewhere. interpret None: interpret the kernel where the
  backend cannot run it. Tuning (None: fp8_tiling.py's DeepGEMM-style defaults for this shape and GPU): kernel
  ("pipelined" | "warp_specialized", module docstring), block_m (pipelined: 64 | 128, None: 64; warp_specialized:
  128 | 256, None: 128), block_n (multiple of 32 in [32, 256] whose accumulators fit registers: pipelined <= 160
  at block_m 64, <= 64 at 128; warp_specialized <= 160 at 128, <= 64 at 256), block_k (must be 128: one scale per
  k-step), stages (TMA pipeline depth; the ring and the epilogue tile must fit in 227 KB of SMEM), multicast
  (warp_specialized: 2 = pairs of CTAs take adjacent column tiles of one row tile and share its A tile by TMA
  multicast, DeepGEMM's; needs an even number of column tiles; not in interpret mode)."""
    m, n, k = check_operands(a, a_scale, b, b_scale)
    check_kernel(kernel)
    implementation, interpret = resolve(implementation, interpret)
    if implementation == "xla":
        return _fp8_gemm_xla(a, a_scale, b, b_scale, out_dtype)
    tiling = resolve_tiling(kernel, block_m, block_n, block_k, stages, rows=m, n=n, k=k, out_dtype=out_dtype,
                            interpret=interpret, multicast=multicast)
    return dense_pallas(a, a_scale, b, b_scale, kernel=kernel, tiling=tiling, out_dtype=out_dtype,
                        interpret=interpret)


def dense_pallas(a, a_scale, b, b_scale, *, kernel, tiling: Tiling, out_dtype, interpret, probe=None):
    """fp8_gemm's Pallas path for a resolved tiling (checked operands): pad, run the kernel, crop -> [m, n].
  probe (benchmarks/kernels_fp8.py --breakdown only): fp8_gemm_ws.py ``PROBES``."""
    m, n = a.shape[0], b.shape[0]
    rows = _round_up(m, tiling.block_m)
    a_p, as_t = prepare_a(a, a_scale, rows)
    b_p, bs_t = prepare_b(b[None], b_scale[None], tiling.block_n)
    tile_group = jnp.zeros((rows // tiling.block_m,), jnp.int32)
    out = run_tiles(tile_group, a_p, as_t, b_p, bs_t, kernel=kernel, tiling=tiling, out_dtype=out_dtype,
                    interpret=interpret, probe=probe)                                              # (rows, np)
    return out[:m, :n]
