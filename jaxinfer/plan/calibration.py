"""One calibration for every prediction: the fractions of the hardware's peaks that DeepSeek's published kernels
reach, computed from their published figures on H800 (``ANCHORS``) and never fitted to a system-level figure.

- FP8 GEMMs (DeepGEMM README, H800 SXM5): up to 1358 TFLOPS on large shapes; up to 2668 GB/s on small-M shapes,
  which are bound by reading the weights. A GEMM's time is modelled as its FLOPs at the first rate plus its bytes
  (weights, input, output) at the second: on the README's 18 dense shapes (M = 64, 128, 4096) that sum is 0.78-1.45x
  the published time (geometric mean 1.08), where the larger of the two (a roofline) is 0.46-1.0x (0.81): the
  kernels do not overlap the two fully at M <= 128 (tests/plan/test_predict.py checks the rows).
- Sparse attention (FlashMLA README, H800 SXM5; DeepSeek-V3.2's and V4's kernels, which read each query's
  selected entries): 410 TFLOPS decoding (FP8 cache, bf16 products), 640 TFLOPS prefilling. V4 models price their
  attention core at these (v4.py); V3's dense core at the next line's.
- MLA decoding (FlashMLA README, H800 SXM5): 3000 GB/s memory-bound, 660 TFLOPS compute-bound (bf16). The
  memory-bound kernels between the products (norms, quantization, SiLU, permutes) are priced at the same
  bandwidth: FlashMLA's is the published figure of a memory-bound kernel that streams HBM.
- Expert dispatch / combine (DeepEP, docs/legacy.md, H800 with one CX7 400 Gb/s NIC per GPU; FP8 dispatch, BF16
  combine): normal kernels 153 / 158 GB/s over NVLink within a node and 43-58 GB/s over RDMA across nodes
  ("bottleneck bandwidth", EP16-64); low-latency kernels, 128 tokens per rank, top-8: dispatch 77 us at EP8 to
  194 us at EP256, combine 114 us to 360 us. The normal kernels run on SMs taken from compute while they overlap
  it: 24 in DeepEP's example configuration (``Buffer.set_num_sms(24)``); the low-latency kernels on none (their
  receive hook).

The low-latency kernels send one message per (token, expert) pair, a share ``min(1, gpus_per_node / ep)`` of them
to GPUs of the sender's own node; their time is modelled as the slower of the two link classes, each at its own
rate: the rates come from the EP8 row (all pairs within a node) and the EP256 row (31/32 of them across), and the
rows between (EP16-128) are left as a check of the model (tests/plan/test_calibration.py).
Efficiencies are fractions of the H800's peaks (hardware.py); other GPUs are assumed to reach the same fractions.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.plan.hardware import PRESETS, Hardware
from jaxinfer.plan.shapes import dispatch_payload_bytes

# Published figures (units in the names). Each is a measurement of one kernel on H800 SXM5.
ANCHORS = {
    "deepgemm_peak_tflops": 1358.0,
    # dense FP8 GEMMs {M: [(N, K, TFLOPS)]}; the rows are checked, not fitted (the peaks above are their maxima)
    "deepgemm_dense": {64: [(2112, 7168, 206), (24576, 1536, 289), (32768, 512, 219), (7168, 16384, 336),
                            (4096, 7168, 287), (7168, 2048, 295)],
                       128: [(2112, 7168, 352), (24576, 1536, 535), (32768, 512, 358), (7168, 16384, 645),
                             (4096, 7168, 533), (7168, 2048, 510)],
                       4096: [(2112, 7168, 1058), (24576, 1536, 990), (32768, 512, 590), (7168, 16384, 1358),
                              (4096, 7168, 1304), (7168, 2048, 1025)]},
    "deepgemm_peak_gb_s": 2668.0,
    "flashmla_gb_s": 3000.0,
    "flashmla_tflops": 660.0,
    "flashmla_sparse_decode_tflops": 410.0,
    "flashmla_sparse_prefill_tflops": 640.0,
    "deepep_normal_nvlink_gb_s": (153.0, 158.0),                        # dispatch, combine (EP8)
    "deepep_normal_rdma_gb_s": (43.0, 43.0, 58.0, 57.0, 51.0, 50.0),    # dispatch, combine at EP16, 32, 64
    "deepep_normal_sms": 24,
    # low latency: {ep: (dispatch us, combine us)}, 128 tokens per rank, hidden 7168, top-8
    "deepep_ll_us": {8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0),
                     128: (192.0, 369.0), 256: (194.0, 360.0)},
}
LL_TOKENS, LL_HIDDEN, LL_TOPK = 128, 7168, 8   # DeepEP's low-latency test setting
CALIBRATION_HARDWARE = PRESETS["h800"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Achieved fractions of a GPU's peaks (hardware.py) and the low-latency kernels' link rates as fractions of
    the links' peaks."""

    gemm_flops: float         # FP8 GEMM, compute-bound
    gemm_memory: float        # FP8 GEMM, bound by its weights' bytes
    mla_flops: float          # MLA decoding kernel, compute-bound (bf16)
    mla_memory: float         # MLA decoding kernel, bound by the latent cache's bytes
    sparse_decode_flops: float   # sparse attention decoding (FlashMLA's, V4's core), compute-bound
    sparse_prefill_flops: float  # sparse attention prefill, compute-bound
    stream_memory: float      # memory-bound kernels between the products (FlashMLA's bandwidth: the module doc)
    normal_nvlink: float      # normal dispatch / combine over NVLink
    normal_rdma: float        # normal dispatch / combine over RDMA
    normal_sms: int           # SMs the normal kernels hold while they overlap compute
    ll_dispatch_nvlink: float  # low-latency dispatch, pairs within the node
    ll_dispatch_rdma: float    # low-latency dispatch, pairs across nodes
    ll_combine_nvlink: float
    ll_combine_rdma: float


def ll_remote_share(ep: int, gpus_per_node: int) -> float:
    """The share of a rank's (token, expert) pairs sent to other nodes when experts are spread evenly over ep
    ranks of gpus_per_node per node (uniform routing: a pair lands on each rank alike)."""
    return 1.0 - min(1.0, gpus_per_node / ep)


def calibrate(anchors: dict = ANCHORS, hw: Hardware = CALIBRATION_HARDWARE) -> Calibration:
    """The calibration from the published figures (see the module doc)."""
    ll = anchors["deepep_ll_us"]
    pairs = LL_TOKENS * LL_TOPK
    rates = []
    for k, fp8 in ((0, True), (1, False)):  # dispatch carries FP8 with scales, combine BF16
        payload = pairs * dispatch_payload_bytes(LL_HIDDEN, fp8)
        intra = payload / (ll[8][k] * 1e-6)                                              # EP8: all in the node
        remote = payload * ll_remote_share(256, hw.gpus_per_node) / (ll[256][k] * 1e-6)  # EP256: the RDMA share
        rates += [intra / hw.nvlink_bw, remote / hw.net_bw]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return Calibration(
        gemm_flops=anchors["deepgemm_peak_tflops"] / hw.fp8_tflops,
        gemm_memory=anchors["deepgemm_peak_gb_s"] / hw.hbm_gb_s,
        mla_flops=anchors["flashmla_tflops"] / hw.bf16_tflops,
        mla_memory=anchors["flashmla_gb_s"] / hw.hbm_gb_s,
        sparse_decode_flops=anchors["flashmla_sparse_decode_tflops"] / hw.bf16_tflops,
        sparse_prefill_flops=anchors["flashmla_sparse_prefill_tflops"] / hw.bf16_tflops,
        stream_memory=anchors["flashmla_gb_s"] / hw.hbm_gb_s,
        normal_nvlink=mean(anchors["deepep_normal_nvlink_gb_s"]) / hw.nvlink_gb_s,
        normal_rdma=mean(anchors["deepep_normal_rdma_gb_s"]) / hw.net_gb_s,
        normal_sms=anchors["deepep_normal_sms"],
        ll_dispatch_nvlink=rates[0], ll_dispatch_rdma=rates[1], ll_combine_nvlink=rates[2], ll_combine_rdma=rates[3],
    )


DEFAULT = calibrate()


# For a measured hardware description (hardware.py ``measured``): its rates are already what programs reach.
MEASURED = Calibration(**{f.name: 1.0 for f in dataclasses.fields(Calibration) if f.name != "normal_sms"},
                       normal_sms=0)
