"""``predict``: what one DeepSeek-style deployment delivers per GPU, step by step (docs/plan.md says how to read it).

A deployment is ``ep`` GPUs serving one phase: attention data-parallel over ``dp`` groups (tensor-parallel over
``ep // dp`` GPUs within a group; DeepSeek serves dp = ep), routed experts spread over all ``ep`` GPUs (``(E +
redundant) / ep`` slots each, EPLB's redundant copies included), shared experts and dense layers on every GPU.
Every GPU runs the same step; a step's time is the sum over layers of each part's time: a GEMM's FLOPs at the
calibrated compute rate plus its bytes (weights, input and output activations) at the calibrated bandwidth, the
attention core the slower of its FLOPs and the cache it reads (V3's MLA latents; DeepSeek-V4's window, selected and
compressed entries, with its indexer an FP8 product over its keys: v4.py), the kernels between the products (norms,
quantization, RoPE, SiLU, moving rows to and from the experts: shapes.py ``elementwise_bytes``) their bytes at the
bandwidth a memory-bound kernel reaches, the expert dispatch / combine at the calibrated link rates
(calibration.py):

- decode: ``requests_per_gpu`` requests with ``context_len`` cached tokens each compute 1 + ``mtp_drafts`` tokens
  per step (MTP speculative decoding verifies the drafts, ``mtp_acceptance`` the chance each is accepted, so a
  step yields 1 + p + ... + p^k tokens), reading every weight once and the latent cache once per step (FlashMLA
  scores all of a request's query tokens over one read); DeepEP's low-latency kernels move (token, expert) pairs.
  The MTP module drafts: one more MoE layer (its dispatch and combine included) and the head per draft; in
  prefill (with ``mtp_acceptance``) it runs once over the computed tokens, filling its cache.
- prefill: ``tokens_per_gpu`` prompt tokens per step in prompts of ``prompt_len`` (``cache_hit_rate`` of each
  prompt read from the KV cache: its latents decompressed for attention, not recomputed); DeepEP's normal kernels
  move each token once per destination node over RDMA and once per destination GPU over NVLink (uniform routing:
  group-limited routing would only lower it).
- dual-microbatch overlap (``dbo``): the step runs as two microbatches of half the tokens, each reading the
  weights again, one computing while the other's dispatch or combine runs, stage by stage as DeepSeek's schedules
  place them (overlap.py): a transfer is hidden by the compute its schedule puts beside it, and the step waits
  for the rest. The MoE layers (the MTP module's too) run so; the dense layers, the head and the MTP module's
  projection and head run as two microbatches in turn. In prefill the normal kernels hold
  ``Calibration.normal_sms`` SMs meanwhile: compute runs on the rest. Without it, compute plus communication.

The step waits for the busiest expert GPU: routed-expert work, and the dispatch it receives and the combine it sends
back, are scaled by ``expert_imbalance`` (max / mean load; default 1.05 with redundant experts, EPLB's balance, and
1.3 without: docs/benchmarks.md "EPLB balance").
Not modelled: host overhead, kernel launches, queueing, load that varies in time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from jaxinfer.config import ModelConfig
from jaxinfer.plan.calibration import DEFAULT, MEASURED, Calibration, ll_remote_share
from jaxinfer.plan.hardware import Hardware, hardware as get_hardware
from jaxinfer.plan.overlap import PROGRAMS, timeline
from jaxinfer.plan.shapes import Shapes, dispatch_payload_bytes
from jaxinfer.plan.v4 import V4_FLASH, V4Config, V4Shapes

PHASES = ("decode", "prefill")
KV_DTYPE_BYTES = 2      # the latent cache in bfloat16 (DeepSeek's MLA)
HEAD_DTYPE_BYTES = 2    # embedding and LM head kept in bfloat16 (DeepSeek-V3 report, 3.3: high-precision parts)
WEIGHT_BYTES = 1        # every other product in FP8 (e4m3; the 128 x 128 block scales add 0.02%)
ACTIVATION_COPIES = 8   # bf16 hidden-state buffers alive per token in a step (residual, norms, projections)


V4_PRESETS = {"deepseek-v4-flash": V4_FLASH}  # models the planner prices and the engine does not run (v4.py)


def model_config(model: str | pathlib.Path | ModelConfig | V4Config) -> ModelConfig | V4Config:
    """A preset name (jaxinfer.config PRESETS, or V4_PRESETS), a checkpoint directory or config.json (a
    DeepSeek-V4 one by its model_type), a ModelConfig or a V4Config."""
    if isinstance(model, (ModelConfig, V4Config)):
        return model
    from jaxinfer.config import PRESETS

    if str(model) in PRESETS:
        return ModelConfig.preset(str(model))
    if str(model) in V4_PRESETS:
        return V4_PRESETS[str(model)]
    path = pathlib.Path(model)
    if not path.exists():
        raise ValueError(f"model {str(model)!r}: not a preset ({', '.join([*PRESETS, *V4_PRESETS])}) nor a "
                         "checkpoint directory or config.json")
    config = path / "config.json" if path.is_dir() else path
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "deepseek_v4":
        return V4Config.from_hf_config(config)
    return ModelConfig.from_hf_config(path)


def model_shapes(cfg: ModelConfig | V4Config) -> Shapes | V4Shapes:
    """The arithmetic of ``cfg``'s family (shapes.py, v4.py)."""
    return V4Shapes(cfg) if isinstance(cfg, V4Config) else Shapes(cfg)


@dataclasses.dataclass
class _Step:
    """Seconds of one step: per part, and per part and the resource bounding that share of it."""

    by: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)   # (part, bound) -> seconds
    comm: dict[str, float] = dataclasses.field(default_factory=dict)
    ops: dict[str, float] = dataclasses.field(default_factory=dict)  # the same seconds by overlap.OPS name

    def add(self, part: str, seconds: float, bound: str, op: str = "other") -> None:
        self.by[part, bound] = self.by.get((part, bound), 0.0) + seconds
        self.ops[op] = self.ops.get(op, 0.0) + seconds

    def add_comm(self, part: str, seconds: float) -> None:
        self.comm[part] = self.comm.get(part, 0.0) + seconds
        self.ops[part] = self.ops.get(part, 0.0) + seconds

    def scaled(self, compute: float, comm: float) -> _Step:
        return _Step({k: v * compute for k, v in self.by.items()}, {k: v * comm for k, v in self.comm.items()},
                     {k: v * (comm if k in self.comm else compute) for k, v in self.ops.items()})

    @property
    def compute(self) -> dict[str, float]:
        out = {}
        for (part, _), seconds in self.by.items():
            out[part] = out.get(part, 0.0) + seconds
        return out

    def resources(self) -> dict[str, float]:
        out = {}
        for (_, bound), seconds in self.by.items():
            out[bound] = out.get(bound, 0.0) + seconds
        return out


class _Rates:
    """Calibrated seconds for FLOPs and bytes on one GPU."""

    def __init__(self, hw: Hardware, cal: Calibration, weight_bytes: int):
        self.hw, self.cal = hw, cal
        self.gemm_peak = hw.fp8_flops if weight_bytes == 1 else hw.bf16_flops  # FP8 products, else bf16 ones

    def gemm(self, flops: float, weight_bytes: float, activation_bytes: float = 0.0) -> tuple[float, str]:
        """A GEMM: its FLOPs at DeepGEMM's fraction of the peak plus its bytes (weights, input and output
        activations) at DeepGEMM's bandwidth (calibration.py says why a sum, and checks it on DeepGEMM's shapes
        with the same bytes); bound by the larger, the bytes named by the larger of their two kinds."""
        c = flops / (self.gemm_peak * self.cal.gemm_flops)
        m = (weight_bytes + activation_bytes) / (self.hw.hbm_bw * self.cal.gemm_memory)
        return c + m, "compute" if c >= m else "weights" if weight_bytes >= activation_bytes else "activations"

    def stream(self, nbytes: float) -> tuple[float, str]:
        """Memory-bound kernels between the products: their bytes at the bandwidth such a kernel reaches."""
        return nbytes / (self.hw.hbm_bw * self.cal.stream_memory), "activations"

    def mla(self, flops: float, cache_bytes: float, kernel: str = "dense") -> tuple[float, str]:
        """The attention core (bf16 products): FLOPs at FlashMLA's rate ("dense": V3's MLA; "sparse_decode" /
        "sparse_prefill": the kernels that read selected entries, V4's) or the cache at its bandwidth."""
        c = flops / (self.hw.bf16_flops * {"dense": self.cal.mla_flops, "sparse_decode": self.cal.sparse_decode_flops,
                                           "sparse_prefill": self.cal.sparse_prefill_flops}[kernel])
        m = cache_bytes / (self.hw.hbm_bw * self.cal.mla_memory)
        return (c, "compute") if c >= m else (m, "kv_cache")


def _check(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def predict(model: str | pathlib.Path | ModelConfig | V4Config = "deepseek-v3",
            hardware: str | pathlib.Path | Hardware = "h800",
            phase: str = "decode", ep: int = 8, dp: int | None = None, requests_per_gpu: float | None = None,
            tokens_per_gpu: float | None = None, context_len: float = 4096, prompt_len: float | None = None,
            gpus_per_node: int | None = None, num_redundant_experts: int = 0, fp8_dispatch: bool = True,
            dbo: bool = True, mtp_acceptance: float | None = None, cache_hit_rate: float = 0.0, *,
            mtp_drafts: int = 1, expert_imbalance: float | None = None, calibration: Calibration = DEFAULT,
            weight_bytes: int = WEIGHT_BYTES) -> dict:
    """The predicted step of one GPU of the deployment (see the module doc). Returns a dict:

    tok_s_per_gpu, tok_s_per_node (output tokens for decode, input tokens, cached ones included, for prefill),
    step_s, tpot_s (decode: step_s per token a request gains) or ttft_s (prefill: the steps a prompt takes),
    bound (the resource taking the largest share of the step: "compute", "weights", "activations" (bytes of the
    tokens' hidden states), "kv_cache", or "communication", the time the computation waits for transfers:
    communication_wait_s), memory_per_gpu_bytes and memory (its parts: weights, kv_cache, buffers;
    headroom_bytes), parts (seconds per step of each part: attention projections, attention core, indexer (V4),
    routed experts, shared experts, dense MLP, head, elementwise (the kernels between the products), drafts;
    dispatch and combine), and the inputs as used. weight_bytes: bytes per weight of the products (1: FP8, as
    DeepSeek serves; 2: bf16, as jaxinfer computes on CPU). calibration: ignored for a measured hardware
    description (the "cpu" preset), whose rates are already achieved ones. Raises ValueError naming the argument
    of a deployment that cannot run."""
    cfg = model_config(model)
    hw = get_hardware(hardware)
    calibration = MEASURED if hw.measured else calibration
    gpn = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    shapes = model_shapes(cfg)
    dp = ep if dp is None else dp
    _check("phase", phase in PHASES, f"{phase!r} is not one of {PHASES}")
    _check("ep", isinstance(ep, int) and ep >= 1, f"must be a positive integer, got {ep!r}")
    _check("dp", isinstance(dp, int) and dp >= 1 and ep % dp == 0, f"{dp!r} must divide ep={ep}")
    tp = ep // dp
    _check("dp", cfg.num_attention_heads % tp == 0,
           f"attention tensor parallelism ep / dp = {tp} does not divide the {cfg.num_attention_heads} heads")
    slots = cfg.n_routed_experts + num_redundant_experts
    _check("num_redundant_experts", num_redundant_experts >= 0, f"must be >= 0, got {num_redundant_experts}")
    _check("ep", slots % ep == 0, f"ep={ep} does not divide the {cfg.n_routed_experts} routed experts + "
           f"{num_redundant_experts} redundant ones ({slots} expert slots)")
    _check("gpus_per_node", isinstance(gpn, int) and gpn >= 1, f"must be a positive integer, got {gpn!r}")
    _check("gpus_per_node", ep <= gpn or ep % gpn == 0, f"ep={ep} is not a whole number of {gpn}-GPU nodes")
    _check("context_len", context_len >= 0, f"must be >= 0, got {context_len}")
    _check("cache_hit_rate", 0.0 <= cache_hit_rate < 1.0, f"must be in [0, 1), got {cache_hit_rate}")
    drafts = 0
    _check("mtp_drafts", mtp_acceptance is not None or mtp_drafts == 1, "drafts need mtp_acceptance")
    if mtp_acceptance is not None:
        _check("mtp_acceptance", 0.0 <= mtp_acceptance <= 1.0, f"must be in [0, 1], got {mtp_acceptance}")
        _check("mtp_acceptance", cfg.num_nextn_predict_layers >= 1, "the model has no MTP module")
        _check("mtp_drafts", isinstance(mtp_drafts, int) and mtp_drafts >= 1, f"must be >= 1, got {mtp_drafts}")
        drafts = mtp_drafts
    imbalance = expert_imbalance if expert_imbalance is not None else (1.05 if num_redundant_experts else 1.3)
    _check("expert_imbalance", imbalance >= 1.0, f"max / mean load is >= 1, got {imbalance}")
    _check("weight_bytes", weight_bytes in (1, 2, 4), f"1 (FP8), 2 (bf16) or 4 (float32), got {weight_bytes!r}")
    rates = _Rates(hw, calibration, weight_bytes)
    experts_per_gpu = slots // ep
    expert_bytes = shapes.expert_bytes(weight_bytes)  # V4's MXFP4 experts beside FP8 products (v4.py)

    if phase == "decode":
        _check("requests_per_gpu", requests_per_gpu is not None and requests_per_gpu > 0,
               f"decode needs requests_per_gpu > 0, got {requests_per_gpu!r}")
        rows = requests_per_gpu * (1 + drafts)          # tokens the main model computes per GPU and step
        requests = requests_per_gpu
    else:
        _check("tokens_per_gpu", tokens_per_gpu is not None and tokens_per_gpu > 0,
               f"prefill needs tokens_per_gpu > 0, got {tokens_per_gpu!r}")
        prompt_len = tokens_per_gpu if prompt_len is None else prompt_len
        _check("prompt_len", prompt_len > 0, f"must be > 0, got {prompt_len}")
        rows = tokens_per_gpu * (1.0 - cache_hit_rate)  # tokens computed per GPU and step
        requests = tokens_per_gpu / prompt_len

    head = cfg.vocab_size * cfg.hidden_size
    shared = cfg.n_shared_experts * shapes.expert_params
    absorbed = phase == "decode"
    act = shapes.activation_bytes(absorbed, in_bytes=weight_bytes)  # products' inputs in their own dtype
    between = shapes.elementwise_bytes(absorbed, quantized=weight_bytes == 1, fp8_dispatch=fp8_dispatch,
                                       permute=phase == "prefill")  # normal kernels: the contiguous layout

    def attention(s: _Step, n: int, rows: float, requests: float, part: str = "") -> None:
        """n layers' attention for ``rows`` computed tokens of ``requests`` requests (per GPU). A TP group
        computes its tp GPUs' tokens, each GPU with 1 / tp of the heads and weights: per GPU, rows tokens' FLOPs;
        each GPU reads the latents of all the group's requests."""
        for op, params in zip(("prepare", "core"), shapes.attention_params_split(absorbed)):
            s.add(part or "attention_projections", *_times(n, rates.gemm(
                2.0 * params * rows, params * weight_bytes / tp, rows * act[op])), op)
            s.add(part or "elementwise", *_times(n, rates.stream(rows * between[op])), op)
        if phase == "decode":
            core = shapes.decode_core(context_len, KV_DTYPE_BYTES)
            cache = tp * (requests * core["bytes_per_request"] + rows * core["bytes_per_token"])
            s.add(part or "attention_core", *_times(n, rates.mla(rows * core["flops_per_token"], cache,
                                                                 shapes.core_kernel("decode"))), "core")
            if core["index_flops_per_token"]:  # an FP8 product of the queries with the indexer's keys
                s.add(part or "indexer", *_times(n, rates.gemm(rows * core["index_flops_per_token"],
                                                               tp * requests * core["index_bytes_per_request"])),
                      "prepare")
            return
        new, cached = prompt_len * (1.0 - cache_hit_rate), prompt_len * cache_hit_rate
        core_flops, index_flops = shapes.prefill_core(new, cached)
        s.add(part or "attention_core", *_times(n, rates.mla(requests * core_flops, 0.0,
                                                             shapes.core_kernel("prefill"))), "core")
        if index_flops:
            s.add(part or "indexer", *_times(n, rates.gemm(requests * index_flops, 0.0)), "prepare")
        if cached:
            s.add(part or "prefix_decompression", *_times(n, rates.gemm(shapes.decompress_flops(requests * cached),
                                                                        0.0)), "prepare")

    def experts(s: _Step, n: int, rows: float, part: str = "") -> None:
        """n MoE layers' routed and shared experts and their dispatch / combine for ``rows`` tokens per GPU."""
        pairs = rows * cfg.num_experts_per_tok * imbalance   # (token, expert) pairs of the busiest expert GPU
        s.add(part or "routed_experts", *_times(n, rates.gemm(
            2.0 * shapes.expert_params * pairs, experts_per_gpu * shapes.expert_params * expert_bytes,
            pairs * act["expert"])), "experts")
        s.add(part or "elementwise", *_times(n, rates.stream(rows * between["route"])), "core")
        s.add(part or "elementwise", *_times(n, rates.stream(pairs * between["expert_pair"])), "experts")
        if shared:
            s.add(part or "shared_experts", *_times(n, rates.gemm(
                2.0 * shared * rows, shared * weight_bytes, rows * cfg.n_shared_experts * act["expert"])), "shared")
            s.add(part or "elementwise", *_times(n, rates.stream(rows * between["shared"])), "shared")
        for name in ("dispatch", "combine"):
            fp8 = fp8_dispatch and name == "dispatch"
            s.add_comm(name, n * imbalance * _comm_seconds(phase == "decode", name, rows, cfg, ep, gpn, hw,
                                                           calibration, fp8))  # the busiest GPU's rows

    # The MTP module (an MoE layer behind a projection of [embedding; hidden], then the shared head). Decode: one
    # pass per draft over the step's requests; prefill: one pass over the computed tokens, filling its cache, and
    # the first draft after each prompt.
    passes = (drafts if phase == "decode" else 1) if drafts else 0

    def head_gemm(tokens: float) -> tuple[float, str]:  # the bf16 head: hidden states in, bf16 logits out
        return rates.gemm(2.0 * head * tokens, head * HEAD_DTYPE_BYTES,
                          tokens * HEAD_DTYPE_BYTES * (cfg.hidden_size + cfg.vocab_size))

    def mtp_tokens(rows: float, requests: float) -> float:
        return requests if phase == "decode" else rows

    def step_parts(rows: float, requests: float) -> _Step:
        """The parts of a step (or of one microbatch) of ``rows`` computed tokens for ``requests`` requests."""
        s = _Step()
        attention(s, cfg.num_hidden_layers, rows, requests)
        experts(s, shapes.num_moe_layers, rows)
        if passes:
            attention(s, passes, mtp_tokens(rows, requests), requests, part="mtp_drafts")
            experts(s, passes, mtp_tokens(rows, requests), part="mtp_drafts")
        if shapes.num_dense_layers:
            s.add("dense_mlp", *_times(shapes.num_dense_layers, rates.gemm(
                2.0 * shapes.dense_mlp_params * rows, shapes.dense_mlp_params * weight_bytes, rows * act["dense_mlp"])))
            s.add("elementwise", *_times(shapes.num_dense_layers, rates.stream(rows * between["dense_mlp"])))
        sampled = rows if phase == "decode" else requests  # prefill samples after each prompt's last token
        s.add("head", *head_gemm(sampled))
        if passes:
            drafted = mtp_tokens(rows, requests)  # [embedding; hidden] (bf16) -> hidden
            s.add("mtp_drafts", *_times(passes, rates.gemm(2.0 * shapes.mtp_extra_params * drafted,
                                                          shapes.mtp_extra_params * weight_bytes,
                                                          drafted * 3 * 2 * cfg.hidden_size)))
            s.add("mtp_drafts", *_times(passes, head_gemm(requests)))
        return s

    def moe_layer(rows: float, requests: float, part: str = "") -> _Step:
        """One MoE layer for ``rows`` computed tokens of ``requests`` requests (its ``ops``: overlap.OPS)."""
        s = _Step()
        attention(s, 1, rows, requests, part)
        experts(s, 1, rows, part)
        return s

    if dbo:  # two microbatches of half the step each, overlapped stage by stage (overlap.py)
        sms = 1.0
        if phase == "prefill" and calibration.normal_sms:  # the normal kernels hold SMs while they overlap
            _check("hardware", hw.sms > calibration.normal_sms, f"{hw.name} has {hw.sms} SMs, the communication "
                   f"kernels take {calibration.normal_sms}")
            sms = hw.sms / (hw.sms - calibration.normal_sms)
        steps = step_parts(rows / 2, requests / 2).scaled(2.0 * sms, 2.0)
        compute, comm = sum(steps.compute.values()), sum(steps.comm.values())
        mtp = moe_layer(mtp_tokens(rows / 2, requests / 2), requests / 2, "mtp_drafts")
        layers = ([moe_layer(rows / 2, requests / 2).scaled(sms, 1.0).ops] * shapes.num_moe_layers
                  + [mtp.scaled(sms, 1.0).ops] * passes)
        in_layers = 2.0 * sum(t for layer in layers for op, t in layer.items() if op not in steps.comm)
        step = compute - in_layers + timeline(PROGRAMS[phase], layers)  # the rest: two microbatches in turn
        waits = max(step - compute, 0.0)  # the compute stream waiting for transfers the schedule does not hide
    else:
        steps = step_parts(rows, requests)
        compute, comm = sum(steps.compute.values()), sum(steps.comm.values())
        step, waits = compute + comm, comm
    parts = {**steps.compute, **steps.comm}
    # The resource taking the largest share of the step: communication counts what the compute stream waits for it.
    resources = dict(steps.resources(), communication=waits)
    bound = max(resources, key=resources.get)

    memory = _memory(cfg, shapes, phase, experts_per_gpu, tp, drafts, requests, rows, context_len, prompt_len,
                     fp8_dispatch, weight_bytes)
    total = sum(memory.values())
    _check("memory", total <= hw.hbm_bytes, f"the deployment needs {total / 1e9:.1f} GB per GPU ("
           + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in memory.items())
           + f"), {hw.name} has {hw.hbm_gb:g} GB: fewer requests or tokens per GPU, or more GPUs")
    out = dict(phase=phase, step_s=step, bound=bound, memory_per_gpu_bytes=total,
               memory=dict(memory, headroom_bytes=hw.hbm_bytes - total),
               parts=parts, compute_s=compute, communication_s=comm, communication_wait_s=waits)
    if phase == "decode":
        gained = sum(mtp_acceptance ** j for j in range(drafts + 1)) if drafts else 1.0  # tokens per step
        out.update(tok_s_per_gpu=requests_per_gpu * gained / step, tpot_s=step / gained, tokens_per_step=gained)
    else:
        out.update(tok_s_per_gpu=tokens_per_gpu / step, ttft_s=step * math.ceil(prompt_len / tokens_per_gpu))
    out["tok_s_per_node"] = out["tok_s_per_gpu"] * min(gpn, ep)
    out["inputs"] = dict(model=cfg, hardware=hw.name, phase=phase, ep=ep, dp=dp, requests_per_gpu=requests_per_gpu,
                         tokens_per_gpu=tokens_per_gpu, context_len=context_len, prompt_len=prompt_len,
                         gpus_per_node=gpn, num_redundant_experts=num_redundant_experts, fp8_dispatch=fp8_dispatch,
                         dbo=dbo, mtp_acceptance=mtp_acceptance, mtp_drafts=drafts, cache_hit_rate=cache_hit_rate,
                         expert_imbalance=imbalance, weight_bytes=weight_bytes)
    return out


def _times(n: int, t: tuple[float, str]) -> tuple[float, str]:
    return n * t[0], t[1]


def _hit_share(experts: int, held: float, topk: int) -> float:
    """The chance that a token's top-k of ``experts`` (chosen uniformly, without repeats) include one of ``held``
    of them."""
    miss = 1.0
    for j in range(topk):
        miss *= max(experts - held - j, 0.0) / (experts - j)
    return 1.0 - miss


def _comm_seconds(low_latency: bool, kind: str, rows: float, cfg: ModelConfig, ep: int, gpn: int, hw: Hardware,
                  cal: Calibration, fp8: bool) -> float:
    """One MoE layer's dispatch or combine of ``rows`` tokens per GPU.

    Low-latency kernels (decode): one message per (token, expert) pair, ``ll_remote_share`` of them across nodes;
    the slower link class bounds it. Normal kernels (prefill): a token goes once to each node holding one of its
    experts (RDMA, other nodes only) and once to each GPU holding one (NVLink forwarding within the node)."""
    if ep == 1 or rows == 0:
        return 0.0
    payload = dispatch_payload_bytes(cfg.hidden_size, fp8)
    if low_latency:
        pairs = rows * cfg.num_experts_per_tok
        remote = ll_remote_share(ep, gpn)
        nvlink, rdma = getattr(cal, f"ll_{kind}_nvlink"), getattr(cal, f"ll_{kind}_rdma")
        return max(pairs * (1 - remote) * payload / (hw.nvlink_bw * nvlink),
                   pairs * remote * payload / (hw.net_bw * rdma) if remote else 0.0)
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    nodes = max(1, ep // gpn)
    ranks_hit = ep * _hit_share(experts, experts / ep, k)
    remote_nodes_hit = (nodes - 1) * _hit_share(experts, experts / nodes, k)
    return max(rows * remote_nodes_hit * payload / (hw.net_bw * cal.normal_rdma),
               rows * ranks_hit * payload / (hw.nvlink_bw * cal.normal_nvlink))


def _memory(cfg: ModelConfig | V4Config, shapes: Shapes | V4Shapes, phase: str, experts_per_gpu: int, tp: int,
            drafts: int, requests: float, rows: float, context_len: float, prompt_len: float | None, fp8_dispatch: bool,
            weight_bytes: int) -> dict[str, float]:
    """Bytes per GPU: weights (FP8 products, bf16 embedding and head, the MTP module when drafting), the latent
    cache of the GPU's requests (a TP group's each GPU holds all of them), and buffers (hidden states, expert rows,
    dispatch receive buffers)."""
    moe_layer = ((shapes.attention_params / tp + cfg.n_shared_experts * shapes.expert_params) * weight_bytes
                 + experts_per_gpu * shapes.expert_params * shapes.expert_bytes(weight_bytes))
    weights = (shapes.num_dense_layers * (shapes.attention_params / tp + shapes.dense_mlp_params) * weight_bytes
               + shapes.num_moe_layers * moe_layer + shapes.embedding_params * HEAD_DTYPE_BYTES)
    weights += moe_layer + shapes.mtp_extra_params * weight_bytes if drafts else 0.0
    layers = cfg.num_hidden_layers + (1 if drafts else 0)
    cached = context_len if phase == "decode" else prompt_len  # tokens each of the step's requests holds
    kv = requests * tp * shapes.kv_bytes_per_request(cached, KV_DTYPE_BYTES) * layers / cfg.num_hidden_layers
    pairs = rows * cfg.num_experts_per_tok
    per_pair = (dispatch_payload_bytes(cfg.hidden_size, fp8_dispatch) + dispatch_payload_bytes(cfg.hidden_size, False)
                + 3 * cfg.moe_intermediate_size * 2)  # received rows, combine rows, gate / up / act in bf16
    buffers = rows * ACTIVATION_COPIES * cfg.hidden_size * 2 + 2 * pairs * per_pair  # receive buffers padded 2x
    return {"weights": weights, "kv_cache": kv, "buffers": buffers}
