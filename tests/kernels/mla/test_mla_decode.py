"""MLA decode (kernels_pallas.mla): reference vs independent numpy math, XLA path vs reference, every Mosaic GPU
kernel variant (kernel="recompute_scores" | "shared_scores" | "pingpong") in GPU interpret mode vs reference,
cross-lowering of the shipped kernel configurations, bad input and knobs.

Metric: FlashMLA's cal_diff(x, y) = 1 - 2 sum(x y) / sum(x^2 + y^2) (tests/test_flash_mla.py), < 1e-5 for out and
lse against fp32 math.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic, mla_decode, mla_decode_reference
from kernels_pallas.common import choose_implementation
from kernels_pallas.mla import KERNELS
from kernels_pallas.mla.pallas import pallas_unsupported

PAGE = 64
# A kernel whose barriers deadlock hangs GPU interpret mode (and the worker's later interpret calls); the thread
# timeout ends the worker, so the test fails instead (calls take 5-15 s).
INTERPRET_TIMEOUT = pytest.mark.timeout(300, method="thread")


def cal_diff(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 1.0 - 2.0 * (x * y).sum() / max((x * x + y * y).sum(), 1e-12)


def make_case(seed, seqlens, s_q, h_q, d, h_kv=1, dtype=jnp.bfloat16, extra_pages=2):
    """Random paged cache with shuffled pages; slots past each length and unreferenced pages hold NaN."""
    rng = np.random.default_rng(seed)
    b = len(seqlens)
    max_pages = max(-(-s // PAGE) for s in seqlens) + 1  # one spare table column per sequence
    num_pages = b * max_pages + extra_pages
    kv = rng.standard_normal((num_pages, PAGE, h_kv, d)).astype(np.float32)
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    used = np.zeros((num_pages, PAGE), bool)
    for i, s in enumerate(seqlens):
        for t in range(s):
            used[table[i, t // PAGE], t % PAGE] = True
    kv[~used] = np.nan
    q = rng.standard_normal((b, s_q, h_q, d)).astype(np.float32)
    q, kv = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32)), np.asarray(jnp.asarray(kv, dtype).astype(jnp.float32))
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(table), jnp.asarray(seqlens, jnp.int32)), (q, kv, table)


def numpy_mla(q, kv, table, seqlens, dv, causal):
    """Independent float64 math, one sequence and one head at a time."""
    b, s_q, h_q, d = q.shape
    h_kv = kv.shape[2]
    out = np.zeros((b, s_q, h_q, dv))
    lse = np.zeros((b, h_q, s_q))
    for i, s in enumerate(seqlens):
        keys = np.concatenate([kv[table[i, j]] for j in range(-(-s // PAGE))])[:s].astype(np.float64)  # [s, G, D]
        for n in range(h_q):
            k = keys[:, n // (h_q // h_kv)]  # [s, D]
            for t in range(s_q):
                vis = s - s_q + t + 1 if causal else s
                sc = k[:vis] @ q[i, t, n].astype(np.float64) * d ** -0.5
                mx = sc.max()
                e = np.exp(sc - mx)
                out[i, t, n] = e @ k[:vis, :dv] / e.sum()
                lse[i, n, t] = mx + np.log(e.sum())
    return out, lse


def check(out, lse, ref_out, ref_lse, shape):
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1]) and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    assert cal_diff(out, ref_out) < 1e-5, cal_diff(out, ref_out)
    assert cal_diff(lse, ref_lse) < 1e-5, cal_diff(lse, ref_lse)


# (seqlens, s_q, h_q, h_kv, d, dv, causal)
REF_CASES = [
    ((70, 1, 128, 200), 1, 16, 1, 64, 48, False),
    ((70, 2, 129), 2, 16, 1, 64, 48, True),
    ((5, 64, 1), 1, 128, 1, 64, 32, False),
    ((100, 3), 2, 128, 2, 32, 32, True),
    ((130, 17), 2, 16, 1, 576, 512, True),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,h_kv,d,dv,causal", REF_CASES)
def test_reference_matches_numpy(seqlens, s_q, h_q, h_kv, d, dv, causal):
    args, (q, kv, table) = make_case(0, seqlens, s_q, h_q, d, h_kv, dtype=jnp.float32)
    out, lse = mla_decode_reference(*args, head_dim_v=dv, causal=causal)
    check(out, lse, *numpy_mla(q, kv, table, seqlens, dv, causal), (len(seqlens), s_q, h_q, dv))


@pytest.mark.parametrize("seqlens,s_q,h_q,h_kv,d,dv,causal,block_pages", [
    case + (bp,) for case, bp in zip(REF_CASES, (1, 2, 16, 1, 16))] + [
    ((300, 64, 1, 65), 1, 32, 4, 64, 64, False, 2),
    ((257,), 2, 8, 8, 96, 64, True, 3),
])
def test_xla_matches_reference(seqlens, s_q, h_q, h_kv, d, dv, causal, block_pages):
    args, _ = make_case(1, seqlens, s_q, h_q, d, h_kv)
    ref = mla_decode_reference(*args, head_dim_v=dv, causal=causal)
    out, lse = mla_decode(*args, head_dim_v=dv, causal=causal, implementation="xla", block_pages=block_pages)
    assert out.dtype == jnp.bfloat16
    check(out, lse, *ref, (len(seqlens), s_q, h_q, dv))


def test_default_implementation_on_cpu_is_xla():
    args, _ = make_case(2, (70, 1), 1, 16, 64)
    out, lse = mla_decode(*args, head_dim_v=32)
    check(out, lse, *mla_decode_reference(*args, head_dim_v=32), (2, 1, 16, 32))


# GPU interpret mode costs ~5-15 s per call (it re-lowers each simulated warpgroup), so few small shapes, each run by
# both kernel variants. block_dv=64 with dv=128 runs the two-compute-warpgroup structure of V3 (d=576, dv=512,
# block_dv=256); block_dv=128 runs one compute warpgroup (shared_scores then has no P hand-off).
# The balanced schedule (num_splits=None) with num_sms=6 keeps the grid small (6 + B items): the lengths (300, 1, 70)
# are 5, 1 and 2 pages, so items hold at most cdiv(8 + 5 * 3, 6) = 4 pages (schedule.py): the first sequence
# spans 2 items (3 + 2 pages), launched first, and 5 items are empty.
PALLAS_CASES = [
    # >1 item per sequence, partial last pages, a length of 1, empty items, 2 compute WGs
    ((300, 1, 70), 1, 16, False, None, 6, 64),
    ((130,), 2, 128, True, 1, None, 128),  # causal MTP verification (s_q = 2), h_q = 128: four 64-row blocks
]


@pytest.mark.parametrize("seqlens,s_q,h_q,causal,num_splits,num_sms,block_dv,kernel", [
    case + (kernel,) for kernel in KERNELS for case in PALLAS_CASES] + [
    ((130,), 2, 128, True, 1, None, 64, "shared_scores"),  # the P hand-off under causal masks, P over 3 pages
])
@INTERPRET_TIMEOUT
def test_pallas_interpret_matches_reference(seqlens, s_q, h_q, causal, num_splits, num_sms, block_dv, kernel):
    args, _ = make_case(3, seqlens, s_q, h_q, 128)
    ref = mla_decode_reference(*args, head_dim_v=128, causal=causal)
    out, lse = mla_decode(*args, head_dim_v=128, causal=causal, implementation="pallas", interpret=True,
                          num_splits=num_splits, num_sms=num_sms, block_dv=block_dv, kernel=kernel)
    check(out, lse, *ref, (len(seqlens), s_q, h_q, 128))


# DeepSeek-V3's configuration as the entry ships it (d = 576, dv = 512, default block_dv = 256: two compute warpgroups
# whose V zeroing runs over 4 x 64 columns each, 2-stage ring of full pages), against float64 math: FlashMLA's MTP
# step (s_q = 2, causal) with h_q = 32 (one 64-row block) on a varlen batch under the balanced schedule with 6 SMs:
# 5 + 1 + 2 pages in items of at most cdiv(8 + 5 * 3, 6) = 4 (schedule.py), so sequence 0 spans two items, and
# 5 of the 9 items are empty; a length of 2 and partial pages. ~10 s per call in jax 0.10.2's interpreter, ~1.5 s
# in 0.11.2's (which runs the score wgmma itself).
@pytest.mark.parametrize("kernel", KERNELS)
@INTERPRET_TIMEOUT
def test_pallas_interpret_v3_configuration(kernel):
    seqlens, s_q, h_q = (300, 2, 70), 2, 32
    args, (q, kv, table) = make_case(5, seqlens, s_q, h_q, 576)
    out, lse = mla_decode(*args, causal=True, implementation="pallas", interpret=True, kernel=kernel, num_sms=6)
    check(out, lse, *numpy_mla(q, kv, table, seqlens, 512, True), (len(seqlens), s_q, h_q, 512))


@INTERPRET_TIMEOUT
def test_kernel_probes_interpret(benchmark_script):
    """The recompute_scores kernel's benchmark probes (benchmarks/kernels_mla.py ``PROBES``, --breakdown: hooks that
    replace the kernel's page ring or its page step). "compute" runs every step on the ring's first fill: it must
    equal attention over a block table whose page t is the item's page t % num_stages (float64 numpy). "stream"
    visits every page of every item (no barrier left waiting) and computes nothing: each item's rows come out 0
    with lse -inf."""
    from kernels_pallas.mla.common import from_rows
    from kernels_pallas.mla.pallas import pack_rows
    from kernels_pallas.mla.recompute_scores import recompute_scores_pallas
    from kernels_pallas.mla.schedule import combine, even_schedule

    km = benchmark_script("kernels_mla")
    seqlens, h_q, d, dv, stages = (300, 70), 16, 128, 128, 2          # 5 and 2 pages, both last ones partial
    (qj, kvj, tablej, lensj), (q, kv, table) = make_case(11, seqlens, 1, h_q, d)
    sched = even_schedule(lensj, page_size=PAGE, num_splits=1)           # one item per sequence
    q_rows = pack_rows(qj, 1, kvj.dtype)
    kw = dict(s_q=1, m=h_q, head_dim_v=dv, scale=d ** -0.5, causal=False, block_dv=64, num_stages=stages,
              interpret=_mosaic.interpret_params())
    o_part, lse_part = recompute_scores_pallas(q_rows, kvj, lensj, sched.items, tablej, **km.probe_hooks("compute"),
                                               **kw)
    out, lse = from_rows(*combine(o_part, lse_part, sched.row_seq, batch=len(seqlens), rows=h_q), 1)
    reused = table.copy()
    for i, s in enumerate(seqlens):
        reused[i, : -(-s // PAGE)] = table[i, np.arange(-(-s // PAGE)) % stages]
    check(out.astype(jnp.bfloat16), lse, *numpy_mla(q, kv, reused, seqlens, dv, False), (len(seqlens), 1, h_q, dv))

    o_part, lse_part = recompute_scores_pallas(q_rows, kvj, lensj, sched.items, tablej, **km.probe_hooks("stream"),
                                               **kw)
    np.testing.assert_array_equal(np.asarray(o_part)[:, :, :h_q], 0.0)
    assert np.isneginf(np.asarray(lse_part)[:, :, :h_q]).all()
    with pytest.raises(ValueError, match="probe must be"):
        km.probe_hooks("memory")


def test_benchmark_breakdown_lines(benchmark_script):
    """benchmarks/kernels_mla.py --breakdown's lines from one ``breakdown_case`` result, worked by hand: 10^6 bytes
    of pages in 500 us is 2 GB/s, in 1 ms 1 GB/s; the shared_scores kernel (no probes) gets the stages line only."""
    km = benchmark_script("kernels_mla")
    st = dict(schedule=1e-5, kernel=1e-3, combine=2e-5, items=8, nonempty=7, page_bytes=10**6, stream=5e-4,
              compute=2.5e-4)
    assert km.breakdown_lines(st) == [
        "  stages: schedule 10.0 us, kernel 1000.0 us, combine 20.0 us (7 of 8 items hold pages)",
        "  probes: stream 500.0 us (2 GB/s of pages), compute 250.0 us, kernel 1000.0 us (1 GB/s of pages)"]
    del st["stream"], st["compute"]
    assert len(km.breakdown_lines(st)) == 1


@pytest.mark.parametrize("kernel", KERNELS)
def test_producer_reads_page_id_before_waiting_for_its_slot(kernel):
    """In the producer's page loop (the loop that issues the page TMA), the block-table load comes before the wait
    for the ring slot, so its latency hides under the wait instead of delaying the refill (a SASS finding,
    docs/benchmarks.md). The kernel module a GPU compiles is read; the loads of mbarrier phases (allocas) aside."""
    S = jax.ShapeDtypeStruct
    args = (S((2, 1, 16, 576), jnp.bfloat16), S((16, PAGE, 1, 576), jnp.bfloat16), S((2, 8), jnp.int32),
            S((2,), jnp.int32))
    (module,) = _mosaic.kernel_modules(mla_decode, *args, head_dim_v=512, implementation="pallas",
                                       interpret=False, kernel=kernel)
    (body,) = [b for b in _mosaic.loop_bodies(module.text)
               if any("cp.async.bulk.tensor" in line for line in b)]
    table_loads = [i for i, line in enumerate(body) if "memref.load" in line and "%alloca" not in line]
    waits = [i for i, line in enumerate(body) if "mbarrier.try_wait" in line]
    assert table_loads and waits and table_loads[0] < waits[0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_interpreted_kernel_runs_its_own_score_wgmma_from_jax_0_11_2(kernel):
    """From jax 0.11.2 on, interpret mode runs the QK^T wgmma itself (the kernel's jaxpr holds it), so the interpret
    tests above check that instruction's operands as a GPU runs it; before, a value-level stand-in takes its place.
    (The P V wgmma, A in registers, is value-level in interpret mode on every release.)"""
    S = jax.ShapeDtypeStruct
    args = (S((2, 1, 16, 576), jnp.bfloat16), S((6, PAGE, 1, 576), jnp.bfloat16), S((2, 3), jnp.int32),
            S((2,), jnp.int32))
    text = str(jax.make_jaxpr(lambda *x: mla_decode(*x, implementation="pallas", interpret=True, kernel=kernel))(*args))
    assert ("wgmma" in text) == (jax.__version_info__ >= (0, 11, 2))


# Every configuration the entry ships for V3 shapes (block_dv=256 -> 2 compute warpgroups; num_stages=2; the
# balanced schedule and even splits; s_q 1 and 2 causal; h_q 16 and 128), in both kernel variants, lowers for cuda
# to a Mosaic GPU kernel (Mosaic GPU also refuses a kernel over 227 KB of shared memory here).
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("s_q,h_q,causal,num_splits,dtype", [
    (1, 16, False, None, jnp.bfloat16),
    (2, 128, True, 1, jnp.bfloat16),
    (2, 16, True, 4, jnp.float16),
])
def test_shipped_configs_lower_to_mosaic_gpu(s_q, h_q, causal, num_splits, dtype, kernel):
    S = jax.ShapeDtypeStruct
    args = (S((4, s_q, h_q, 576), dtype), S((64, PAGE, 1, 576), dtype), S((4, 16), jnp.int32), S((4,), jnp.int32))
    text = _mosaic.lower_for_cuda(mla_decode, *args, head_dim_v=512, causal=causal, implementation="pallas",
                                  interpret=False, num_splits=num_splits, kernel=kernel)
    assert _mosaic.has_mosaic_gpu_call(text)
    xla_text = _mosaic.lower_for_cuda(mla_decode, *args, head_dim_v=512, implementation="xla")
    assert not _mosaic.has_mosaic_gpu_call(xla_text)


# The CUDA launch Mosaic GPU builds (read from the kernel module before serialization): the row blocks that read
# the same pages are blockIdx.x, launched fastest (Pallas reverses the grid onto CUDA's), the work items blockIdx.y;
# 2 compute + 1 producer warpgroups; and the shared memory our smem_bytes accounting (and the docs) state for V3:
# q [64, 576] bf16 73728 + ring 2 x [64, 576] bf16 147456, 8 bytes per mbarrier, then recompute_scores: the default
# reduction scratch 2048 + 6 barriers; shared_scores: P [64, 64] bf16 8192 + alpha and l (1024 each, aligned) +
# 8 barriers, no reduction scratch.
@pytest.mark.parametrize("kernel,smem", [("recompute_scores", 73728 + 147456 + 2048 + 6 * 8),
                                         ("pingpong", 73728 + 147456 + 2048 + 8 * 8),  # + a turn per warpgroup
                                         ("shared_scores", 73728 + 147456 + 8192 + 2 * 1024 + 8 * 8)])
@pytest.mark.parametrize("num_splits,items", [(3, 4 * 3), (None, min(132 // 4 + 4, 4 * 16))])
def test_kernel_launch_grid_and_smem(kernel, smem, num_splits, items):
    S = jax.ShapeDtypeStruct
    args = (S((4, 2, 128, 576), jnp.bfloat16), S((64, PAGE, 1, 576), jnp.bfloat16), S((4, 16), jnp.int32),
            S((4,), jnp.int32))  # s_q 2 x h_q 128 = 256 rows: 4 row blocks of 64
    (launch,) = _mosaic.kernel_launches(mla_decode, *args, head_dim_v=512, causal=True, implementation="pallas",
                                        interpret=False, num_splits=num_splits, num_sms=132, kernel=kernel)
    assert launch.grid == (4, items, 1)
    assert launch.block == (3 * 128, 1, 1)
    assert launch.smem_bytes == smem


@pytest.mark.parametrize("change,match", [
    (dict(q=np.zeros((2, 16, 64), np.float32)), "rank 3"),
    (dict(kv_cache=np.zeros((4, PAGE, 64), np.float32)), "rank 3"),
    (dict(q=np.zeros((2, 1, 12, 64), np.float32), kv_cache=np.zeros((4, PAGE, 5, 64), np.float32)),
     "h_q=12 must be a multiple of h_kv=5"),
    (dict(head_dim_v=80), "head_dim_v=80"),
    (dict(block_table=np.zeros((2, 2), np.float32)), "block_table must be an integer"),
    (dict(cache_seqlens=np.zeros((3,), np.int32)), "cache_seqlens 3"),
    (dict(kv_cache=np.zeros((4, PAGE, 1, 32), np.float32)), "d=64 must equal kv_cache head dim 32"),
])
def test_bad_input_raises(change, match):
    kw = dict(q=np.zeros((2, 1, 16, 64), np.float32), kv_cache=np.zeros((4, PAGE, 1, 64), np.float32),
              block_table=np.zeros((2, 2), np.int32), cache_seqlens=np.ones((2,), np.int32), head_dim_v=32)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        mla_decode(**kw)


def test_bad_pallas_knobs_raise():
    kw = dict(q=np.zeros((2, 1, 16, 64), np.float32), kv_cache=np.zeros((4, 32, 1, 64), np.float32),
              block_table=np.zeros((2, 2), np.int32), cache_seqlens=np.ones((2,), np.int32), head_dim_v=64)
    with pytest.raises(ValueError, match="page_size=32"):
        mla_decode(**kw, implementation="pallas")
    kw["kv_cache"] = np.zeros((4, PAGE, 1, 64), np.float32)
    with pytest.raises(ValueError, match="block_dv=48"):
        mla_decode(**kw, implementation="pallas", block_dv=48)
    with pytest.raises(ValueError, match="implementation"):
        mla_decode(**kw, implementation="triton")
    with pytest.raises(ValueError, match="kernel='bogus'"):
        mla_decode(**kw, implementation="pallas", kernel="bogus")
    kw["kv_cache"] = np.zeros((4, PAGE, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_splits=0"):
        mla_decode(**kw, implementation="pallas", num_splits=0)
    with pytest.raises(ValueError, match="num_sms=0"):
        mla_decode(**kw, implementation="pallas", num_sms=0)
    with pytest.raises(ValueError, match="65536 work items exceed CUDA's grid limit of 65535"):
        mla_decode(**kw, implementation="pallas", num_splits=32768)  # b = 2


def test_float32_cache_decodes_with_xla_on_gpu_and_pallas_refuses_it():
    """The kernels take 16-bit caches (wgmma operands): on a GPU implementation=None falls back to the XLA path for
    float32 (a float32 model still decodes); an explicit implementation='pallas' says why it cannot."""
    reason = pallas_unsupported(576, 512, PAGE, jnp.float32, 256)
    assert "bfloat16 or float16 cache" in reason and "float32" in reason
    assert pallas_unsupported(576, 512, PAGE, jnp.bfloat16, 256) is None
    assert choose_implementation(None, gpu=True, unsupported=reason) == "xla"
    assert choose_implementation(None, gpu=True, unsupported=None) == "pallas"
    assert choose_implementation(None, gpu=False, unsupported=None) == "xla"
    with pytest.raises(ValueError, match="bfloat16 or float16 cache"):
        choose_implementation("pallas", gpu=True, unsupported=reason)
    kw = dict(q=np.zeros((2, 1, 16, 64), np.float32), kv_cache=np.zeros((4, PAGE, 1, 64), np.float32),
              block_table=np.zeros((2, 2), np.int32), cache_seqlens=np.ones((2,), np.int32), head_dim_v=64)
    with pytest.raises(ValueError, match="got float32"):
        mla_decode(**kw, implementation="pallas")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_empty_batch_returns_empty_results(implementation):
    q, kv = jnp.zeros((0, 1, 16, 64), jnp.bfloat16), jnp.zeros((4, PAGE, 1, 64), jnp.bfloat16)
    out, lse = mla_decode(q, kv, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32), head_dim_v=64,
                          implementation=implementation)
    assert out.shape == (0, 1, 16, 64) and out.dtype == jnp.bfloat16 and lse.shape == (0, 16, 1)


@pytest.mark.parametrize("kernel", KERNELS)
def test_pallas_smem_over_227kb_raises(kernel):
    """V3's d = 576 in bf16: q + 3 pages in flight = 288 KB of SMEM, over Hopper's 227 KB per CTA."""
    S = jax.ShapeDtypeStruct
    args = (S((2, 1, 16, 576), jnp.bfloat16), S((8, PAGE, 1, 576), jnp.bfloat16), S((2, 4), jnp.int32),
            S((2,), jnp.int32))
    with pytest.raises(ValueError, match="num_stages=3"):
        _mosaic.lower_for_cuda(mla_decode, *args, head_dim_v=512, implementation="pallas", interpret=False,
                               num_stages=3, kernel=kernel)
