"""The arithmetic of a DeepSeek-V4-family model (V4-Flash, and V4.1-Flash, which DeepInfer serves): parameters,
FLOPs and bytes per token and per layer, with the interface predict.py reads from shapes.py's ``Shapes`` (pure
Python). jaxinfer's engine does not run these models; the planner prices them.

The layer, as V4-Flash's config.json and its public inference code describe it (the values of ``V4_FLASH``):

- Attention with one shared key-value head of head_dim (rotary part qk_rope_head_dim included) for all query
  heads: wq_a (hidden -> q_lora), wq_b (q_lora -> heads x head_dim), wkv (hidden -> head_dim), attention over the
  cache, then a grouped low-rank output: wo_a (each of o_groups groups of heads / o_groups heads x head_dim ->
  o_lora) and wo_b (o_groups x o_lora -> hidden). Scores and values are both head_dim wide (an MQA-form core, as
  FlashMLA's sparse kernels run it).
- Every layer keeps the last ``sliding_window`` tokens' entries. ``compress_ratios[l]`` sets what it sees beyond:
  0, the window only (SWA); 4, one compressed entry per 4 tokens of which a lightning indexer selects
  ``index_topk`` per query (CSA: the indexer scores every compressed entry with index_n_heads heads of
  index_head_dim over its own compressed keys); 128, one entry per 128 tokens, all of them attended (HCA). A
  compressor (wkv and wgate, hidden -> coff x head_dim each, coff 2 for the overlapping ratio-4 windows, else 1)
  builds the entries; the indexer has its own (head index_head_dim), a query projection (q_lora -> index heads x
  index_head_dim) and head weights (hidden -> index heads).
- Manifold-constrained hyper-connections: the residual stream is hc_mult copies of the hidden state, mixed into each
  sublayer's input and updated from its output (small mixing matrices: their bytes, not their FLOPs, count).
- MoE in every layer (the first ``num_hash_layers`` route by token id, at the same expert cost): top-k of the routed
  experts plus shared ones; routed experts in MXFP4 (``EXPERT_WEIGHT_BYTES``), the other products in FP8.

Checked against the published totals (tests/plan/test_v4.py): 284B parameters (13B active per token) and ~160 GB of
safetensors for V4-Flash (its model card and repository).

Cache entries (assumptions, stated where they are used): FlashMLA's "FP8 with scale" layout applied to head_dim
(e4m3 non-rotary values with a float32 scale per 128, bfloat16 rotary values: ``kv_entry_bytes``), and indexer
keys in e4m3 with one float32 scale (DeepSeek-V3.2's lightning indexer: ``index_entry_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from jaxinfer.plan.shapes import MoEShapes, quantize_bytes

# MXFP4 (OCP Microscaling Formats v1.0): 4-bit values with one 8-bit (E8M0) scale per block of 32.
EXPERT_WEIGHT_BYTES = 0.5 + 1 / 32


@dataclasses.dataclass(frozen=True)
class V4Config:
    """The fields of a DeepSeek-V4 config.json the planner reads (names as there). compress_ratios: one per main
    layer (a config.json may list more: its MTP layers'; ``from_hf_config`` keeps the first num_hidden_layers)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    vocab_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    hc_mult: int = 4
    num_hash_layers: int = 0
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v4"
    # No dense-MLP layers (every layer is MoE): predict.py's names for them.
    first_k_dense_replace: int = 0
    intermediate_size: int = 0

    def __post_init__(self):
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ValueError(f"compress_ratios: {len(self.compress_ratios)} ratios for {self.num_hidden_layers} layers")
        bad = sorted(set(self.compress_ratios) - {0, 4, 128})
        if bad:
            raise ValueError(f"compress_ratios: {bad} not among the ratios the model knows (0: window only, 4: "
                             "compressed and selected, 128: compressed)")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} does not divide the {self.num_attention_heads} heads")

    @classmethod
    def from_hf_config(cls, source: str | pathlib.Path | dict) -> V4Config:
        """From a config.json (a path, its directory, or the parsed dict). Raises ValueError naming a missing field."""
        if not isinstance(source, dict):
            path = pathlib.Path(source)
            source = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        names = {f.name for f in dataclasses.fields(cls)} - {"first_k_dense_replace", "intermediate_size"}
        missing = sorted(n for n in names if n not in source and cls.__dataclass_fields__[n].default
                         is dataclasses.MISSING)
        if missing:
            raise ValueError(f"DeepSeek-V4 config.json lacks {', '.join(missing)}")
        if source.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"num_key_value_heads={source['num_key_value_heads']}: the planner's DeepSeek-V4 layer "
                             "has one key-value head shared by all query heads")
        values = {n: source[n] for n in names if n in source}
        values["compress_ratios"] = tuple(source["compress_ratios"][:source["num_hidden_layers"]])
        return cls(**values)


# DeepSeek-V4-Flash's config.json (deepseek-ai/DeepSeek-V4-Flash): 43 layers, SWA for layers 0-1, then CSA and HCA
# alternating, CSA last.
V4_FLASH = V4Config(
    hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1024, o_lora_rank=1024, o_groups=8, vocab_size=129280, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=6, moe_intermediate_size=2048, index_n_heads=64, index_head_dim=128, index_topk=512,
    sliding_window=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4,), hc_mult=4, num_hash_layers=3,
    num_nextn_predict_layers=1)

# FlashMLA's "FP8 with scale" entry (README: e4m3 values, a float32 scale per 128 of them, bfloat16 rotary values),
# here for head_dim - rope non-rotary values.
QUANT = 128


def kv_entry_bytes(c: V4Config) -> int:
    nope = c.head_dim - c.qk_rope_head_dim
    return nope + 4 * -(-nope // QUANT) + 2 * c.qk_rope_head_dim


def index_entry_bytes(c: V4Config) -> int:
    return c.index_head_dim + 4   # e4m3 keys and one float32 scale (DeepSeek-V3.2's indexer cache)


@dataclasses.dataclass(frozen=True)
class V4Shapes(MoEShapes):
    """Per-layer parameter counts and per-token costs of a V4Config, as predict.py reads them (shapes.py's
    ``Shapes`` documents each method for the V3 family; per-layer figures here are means over the layer types)."""

    config: V4Config

    # ---- layer types -------------------------------------------------------------------------------------
    def _share(self, ratio: int) -> float:
        """The share of the layers with compress ratio ``ratio``."""
        return self.config.compress_ratios.count(ratio) / self.config.num_hidden_layers

    # ---- parameters -------------------------------------------------------------------------------------
    def attention_products(self, absorbed: bool) -> tuple[tuple[str, float, int, int, str], ...]:
        """(name, groups, k, n, stage) as Shapes.attention_products, groups the products per layer on average over
        the layer types (the compressors and the indexer run in the compressed layers only). wq_a and wkv read the
        same input and run as one product; nothing is absorbed (the core attends head_dim wide keys directly)."""
        c = self.config
        h, heads, d = c.hidden_size, c.num_attention_heads, c.head_dim
        csa, hca = self._share(4), self._share(128)
        return (("q_a_kv", 1, h, c.q_lora_rank + d, "prepare"),
                ("q_b", 1, c.q_lora_rank, heads * d, "prepare"),
                ("compressor", csa, h, 2 * 2 * d, "prepare"),     # wkv + wgate, overlapping windows (coff 2)
                ("compressor", hca, h, 2 * d, "prepare"),
                ("index_q", csa, c.q_lora_rank, c.index_n_heads * c.index_head_dim, "prepare"),
                ("index_weights", csa, h, c.index_n_heads, "prepare"),
                ("index_compressor", csa, h, 2 * 2 * c.index_head_dim, "prepare"),
                ("o_a", c.o_groups, heads // c.o_groups * d, c.o_lora_rank, "core"),
                ("o_b", 1, c.o_groups * c.o_lora_rank, h, "core"))

    def elementwise_bytes(self, absorbed: bool, quantized: bool, fp8_dispatch: bool, permute: bool) -> dict[str, float]:
        """As Shapes.elementwise_bytes, with the hyper-connections' residual traffic in place of V3's fused residual
        add + RMSNorm (two vectors read, two written): one fused kernel between two sublayers reads the hc_mult
        streams and the sublayer's output and writes the updated streams and the next sublayer's normed input,
        2 (hc_mult + 1) hidden-wide bfloat16 vectors (V3's count at hc_mult = 1)."""
        c = self.config
        h, heads, d, rope = c.hidden_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim

        def quant(width: float) -> float:
            return quantize_bytes(width, quantized)

        residual = 2 * (c.hc_mult + 1) * 2 * h
        csa = self._share(4)
        prepare = (residual + quant(h) + 2 * 2 * (c.q_lora_rank + d) + quant(c.q_lora_rank)
                   + 2 * 2 * rope * (heads + 1) + kv_entry_bytes(c)
                   + csa * (2 * 2 * c.index_n_heads * c.index_head_dim + index_entry_bytes(c)))
        return {
            "prepare": prepare,
            "core": quant(heads * d) + quant(c.o_groups * c.o_lora_rank) + residual,
            **self.moe_elementwise_bytes(quantized, fp8_dispatch, permute),
            "dense_mlp": 0.0,
        }

    @property
    def dense_mlp_params(self) -> int:
        return 0

    @property
    def router_params(self) -> int:
        return self.config.n_routed_experts * self.config.hidden_size

    @property
    def hyper_connection_params(self) -> int:
        """One layer's mixing parameters: (2 + hc) x hc x hidden per sublayer, two sublayers."""
        c = self.config
        return 2 * (2 + c.hc_mult) * c.hc_mult * c.hidden_size

    @property
    def num_dense_layers(self) -> int:
        return 0

    @property
    def num_moe_layers(self) -> int:
        return self.config.num_hidden_layers

    def total_params(self) -> float:
        """Every parameter of the main model (the MTP module apart), as its checkpoint holds them."""
        c = self.config
        layer = (self.attention_params + (c.n_routed_experts + c.n_shared_experts) * self.expert_params
                 + self.router_params + self.hyper_connection_params)
        return c.num_hidden_layers * layer + self.embedding_params

    def active_params(self) -> float:
        """Parameters one token multiplies in the main model: attention, top-k routed and the shared experts, the
        router, the LM head (the embedding is a lookup)."""
        c = self.config
        layer = (self.attention_params + (c.num_experts_per_tok + c.n_shared_experts) * self.expert_params
                 + self.router_params)
        return c.num_hidden_layers * layer + c.vocab_size * c.hidden_size

    def checkpoint_bytes(self) -> float:
        """The main model's weights as served: routed experts in MXFP4, embedding and head in bfloat16, the rest
        in FP8 (block scales of 128 x 128 left out: 0.006%)."""
        c = self.config
        routed = c.num_hidden_layers * c.n_routed_experts * self.expert_params
        return routed * EXPERT_WEIGHT_BYTES + 2 * self.embedding_params + (
            self.total_params() - routed - self.embedding_params)

    # ---- attention per token ----------------------------------------------------------------------------------
    def _visible(self, ratio: int, tokens: float) -> tuple[float, float]:
        """(entries read once per request, entries read per query token) by a query that sees ``tokens`` tokens,
        in a layer of compress ratio ``ratio``: its window; a CSA layer's index_topk selected entries are each
        query's own, an HCA layer's compressed entries all of the request's queries share."""
        c = self.config
        window = min(c.sliding_window, tokens)
        if ratio == 4:
            return window, min(c.index_topk, tokens / 4)
        if ratio == 128:
            return window + tokens / 128, 0.0
        return window, 0.0

    def decode_core(self, context: float, kv_dtype_bytes: int = 1) -> dict[str, float]:
        """One layer's attention core in a decode step (means over the layers), for a query token of a request
        with ``context`` cached tokens: flops_per_token (scores and values, head_dim wide, every head),
        bytes_per_request (entries the request's queries share), bytes_per_token (entries each query selects),
        index_flops_per_token (the indexer scoring the compressed entries, an FP8 product), index_bytes_per_request
        (the indexer's keys, read once a step). kv_dtype_bytes: not used (the entries' layout is fixed)."""
        c = self.config
        out = dict.fromkeys(("flops_per_token", "bytes_per_request", "bytes_per_token", "index_flops_per_token",
                             "index_bytes_per_request"), 0.0)
        entry = kv_entry_bytes(c)
        for ratio in c.compress_ratios:
            shared, own = self._visible(ratio, context)
            out["flops_per_token"] += 2.0 * c.num_attention_heads * (shared + own) * 2 * c.head_dim
            out["bytes_per_request"] += shared * entry
            out["bytes_per_token"] += own * entry
            if ratio == 4:
                out["index_flops_per_token"] += 2.0 * c.index_n_heads * c.index_head_dim * context / 4
                out["index_bytes_per_request"] += context / 4 * index_entry_bytes(c)
        return {k: v / c.num_hidden_layers for k, v in out.items()}

    def prefill_core(self, new: float, cached: float) -> tuple[float, float]:
        """(attention FLOPs, indexer FLOPs) of one layer (mean) for a chunk of ``new`` tokens after ``cached``
        ones: query i (1-based) sees cached + i tokens; its window, its selected or compressed entries; the CSA
        layers' indexer scores (cached + i) / 4 compressed keys per query. Sums in closed form over i."""
        c = self.config
        lo, hi = cached, cached + new

        def sum_min(cap: float, scale: float) -> float:  # sum over t in (lo, hi] of min(cap, t / scale)
            knee = min(max(cap * scale, lo), hi)          # t / scale reaches cap at t = cap * scale
            return (knee * knee - lo * lo) / (2 * scale) + ((hi - knee) * cap if hi > knee else 0.0)

        window = sum_min(c.sliding_window, 1)
        rows = {0: window, 4: window + sum_min(c.index_topk, 4), 128: window + sum_min(math.inf, 128)}
        per_row = 2.0 * c.num_attention_heads * 2 * c.head_dim
        attention = sum(rows[r] for r in c.compress_ratios) * per_row
        index = self._share(4) * 2.0 * c.index_n_heads * c.index_head_dim * sum_min(math.inf, 4)
        return attention / c.num_hidden_layers, index

    def decompress_flops(self, tokens: float) -> float:
        """Nothing to decompress: cached entries are attended as they are."""
        return 0.0

    def kv_bytes_per_request(self, context: float, kv_dtype_bytes: int = 1) -> float:
        """Cache bytes of a request with ``context`` tokens over all layers: each layer's window, the compressed
        entries (and the CSA layers' indexer keys). The entries' layout is fixed (module doc): kv_dtype_bytes,
        Shapes' argument, is not used."""
        c = self.config
        entry, total = kv_entry_bytes(c), 0.0
        for ratio in c.compress_ratios:
            total += min(c.sliding_window, context) * entry
            if ratio:
                total += context / ratio * (entry + (index_entry_bytes(c) if ratio == 4 else 0))
        return total

    def core_kernel(self, phase: str) -> str:
        """FlashMLA's sparse kernels, which read each query's selected entries (calibration.py)."""
        return f"sparse_{phase}"

    def expert_bytes(self, weight_bytes: float) -> float:
        """MXFP4 routed experts where the other products are FP8 (the checkpoint as served), else ``weight_bytes``."""
        return EXPERT_WEIGHT_BYTES if weight_bytes == 1 else weight_bytes
