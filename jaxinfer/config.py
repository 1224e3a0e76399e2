"""Model configuration: one frozen dataclass built from a Hugging Face ``config.json``, with presets.

Field names follow the HF / DeepSeek config files so that a reader can check them side by side. Sources:
DeepSeek-V3 ``config.json`` (deepseek-ai/DeepSeek-V3), DeepSeek-V2-Lite ``config.json``, Moonlight-16B-A3B
``config.json``, and transformers' ``DeepseekV3Config`` / ``DeepseekV2Config`` (rope_parameters handling).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import warnings
from typing import Any, Literal

RopeType = Literal["default", "yarn"]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters``; legacy configs: ``rope_theta`` + ``rope_scaling``)."""

    rope_type: RopeType = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """DeepSeek's FP8 release format (``quantization_config``): e4m3 weights with 128x128 block scales."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = None  # "ue8m0" in DeepSeek-V3.1: power-of-two scales


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V2/V3-family model. Dims: D hidden, H heads, C kv_lora_rank, R rope dim, E routed experts."""

    model_type: Literal["deepseek_v3", "deepseek_v2"] = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    scoring_func: Literal["sigmoid", "softmax"] = "sigmoid"
    topk_method: Literal["noaux_tc", "greedy", "group_limited_greedy"] = "noaux_tc"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope: RopeConfig = RopeConfig()
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    quantization: QuantConfig | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1

    def __post_init__(self):
        _validate(self)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5 * m**2 with m = yarn_get_mscale(factor, mscale_all_dim) (HF ``yarn_apply_mscale``)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json -----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, source: dict[str, Any] | str | pathlib.Path) -> ModelConfig:
        """Builds a config from an HF ``config.json`` (a dict, the file, or its directory)."""
        return from_hf_dict(_read_json(source))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form (transformers 5 ``rope_parameters``), readable by transformers."""
        return to_hf_dict(self)

    # ---- presets ------------------------------------------------------------------------------------
    @classmethod
    def deepseek_v3(cls) -> ModelConfig:
        """DeepSeek-V3 / R1 (671B total, 37B active), deepseek-ai/DeepSeek-V3 config.json."""
        return cls(
            rope=RopeConfig(rope_type="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
            num_nextn_predict_layers=1, quantization=QuantConfig(),
        )

    @classmethod
    def deepseek_v2_lite(cls) -> ModelConfig:
        """DeepSeek-V2-Lite (16B total, 2.4B active), deepseek-ai/DeepSeek-V2-Lite config.json."""
        return cls(
            model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
            moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None,
            n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
            first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax",
            topk_method="greedy",
            rope=RopeConfig(rope_type="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
            bos_token_id=100000, eos_token_id=100001,
        )

    @classmethod
    def moonlight_16b_a3b(cls) -> ModelConfig:
        """Moonlight-16B-A3B (moonshotai), the V3 architecture at V2-Lite size, config.json."""
        return cls(
            vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1,
            norm_topk_prob=True, routed_scaling_factor=2.446, rms_norm_eps=1e-5, max_position_embeddings=8192,
            rope=RopeConfig(theta=50000.0), bos_token_id=163584, eos_token_id=163585,
        )

    @classmethod
    def tiny(cls, **changes) -> ModelConfig:
        """A small V3-shaped test model: every feature on (q_lora, groups, dense + MoE layers, YaRN, MTP)."""
        base = cls(
            vocab_size=257, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, max_position_embeddings=2048,
            rope=RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, mscale=1.0,
                            mscale_all_dim=1.0),
            num_nextn_predict_layers=1,
        )
        return base.replace(**changes)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        presets = PRESETS
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()


PRESETS = {
    "deepseek-v3": ModelConfig.deepseek_v3,
    "deepseek-v2-lite": ModelConfig.deepseek_v2_lite,
    "moonlight-16b-a3b": ModelConfig.moonlight_16b_a3b,
    "tiny": ModelConfig.tiny,
}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature (YaRN paper, eq. 8 form used by DeepSeek-V2/V3 and HF)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# ---- validation ---------------------------------------------------------------------------------------


def _validate(c: ModelConfig) -> None:
    def need(ok: bool, field: str, msg: str):
        if not ok:
            raise ValueError(f"config field {field!r}: {msg}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size"):
        v = getattr(c, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive int, got {v!r}")
    need(c.model_type in ("deepseek_v3", "deepseek_v2"), "model_type",
         f"{c.model_type!r} is not supported (deepseek_v3 or deepseek_v2)")
    need(c.q_lora_rank is None or (isinstance(c.q_lora_rank, int) and c.q_lora_rank > 0), "q_lora_rank",
         f"must be null or a positive int, got {c.q_lora_rank!r}")
    need(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even (rotary pairs), got {c.qk_rope_head_dim}")
    need(c.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {c.hidden_act!r}")
    need(c.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {c.rms_norm_eps}")
    need(0 <= c.first_k_dense_replace <= c.num_hidden_layers, "first_k_dense_replace",
         f"{c.first_k_dense_replace} is outside [0, num_hidden_layers={c.num_hidden_layers}]")
    need(c.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", f"must be >= 0, got {c.num_nextn_predict_layers}")
    if c.num_moe_layers > 0:
        need(c.n_routed_experts > 0, "n_routed_experts", f"must be > 0 with MoE layers, got {c.n_routed_experts}")
        need(c.moe_intermediate_size > 0, "moe_intermediate_size", f"must be > 0, got {c.moe_intermediate_size}")
        need(c.n_shared_experts >= 0, "n_shared_experts", f"must be >= 0, got {c.n_shared_experts}")
        need(1 <= c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok",
             f"{c.num_experts_per_tok} is outside [1, n_routed_experts={c.n_routed_experts}]")
        need(c.n_group >= 1 and c.n_routed_experts % c.n_group == 0, "n_group",
             f"n_routed_experts={c.n_routed_experts} is not divisible by n_group={c.n_group}")
        need(1 <= c.topk_group <= c.n_group, "topk_group", f"{c.topk_group} is outside [1, n_group={c.n_group}]")
        per_group = c.n_routed_experts // c.n_group
        if c.topk_method == "noaux_tc":
            # V3 group score = sum of the top-2 biased scores in a group (HF DeepseekV3TopkRouter).
            need(per_group >= 2 or c.n_group == 1, "n_group",
                 f"noaux_tc needs >= 2 experts per group, got {per_group}")
        if c.topk_method in ("noaux_tc", "group_limited_greedy"):
            need(c.topk_group * per_group >= c.num_experts_per_tok, "topk_group",
                 f"topk_group={c.topk_group} groups of {per_group} experts hold fewer than "
                 f"num_experts_per_tok={c.num_experts_per_tok}")
    need(c.scoring_func in ("sigmoid", "softmax"), "scoring_func",
         f"{c.scoring_func!r} is not supported (sigmoid or softmax)")
    if c.scoring_func == "sigmoid":
        need(c.topk_method == "noaux_tc", "topk_method", f"sigmoid scoring goes with 'noaux_tc', got {c.topk_method!r}")
    else:
        need(c.topk_method in ("greedy", "group_limited_greedy"), "topk_method",
             f"softmax scoring goes with 'greedy' or 'group_limited_greedy', got {c.topk_method!r}")
    r = c.rope
    need(r.rope_type in ("default", "yarn"), "rope_parameters.rope_type",
         f"{r.rope_type!r} is not supported (default or yarn)")
    need(r.theta > 0, "rope_parameters.rope_theta", f"must be > 0, got {r.theta}")
    if r.rope_type == "yarn":
        need(r.factor > 0, "rope_parameters.factor", f"must be > 0, got {r.factor}")
        need(r.original_max_position_embeddings > 0, "rope_parameters.original_max_position_embeddings",
             f"must be > 0, got {r.original_max_position_embeddings}")
    if c.quantization is not None:
        q = c.quantization
        need(q.fmt == "e4m3", "quantization_config.fmt", f"only 'e4m3' is supported, got {q.fmt!r}")
        need(tuple(q.weight_block_size) == (128, 128), "quantization_config.weight_block_size",
             f"only [128, 128] is supported, got {list(q.weight_block_size)}")
        need(q.scale_fmt in (None, "ue8m0"), "quantization_config.scale_fmt",
             f"{q.scale_fmt!r} is not supported (null or 'ue8m0')")


# ---- HF config.json <-> ModelConfig --------------------------------------------------------------------

# Fields that real config files carry and jaxinfer reads or knowingly ignores.
_IGNORED = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "head_dim", "qk_head_dim",
    "pretraining_tp", "output_router_logits", "use_cache", "initializer_range", "attention_dropout",
    "aux_loss_alpha", "seq_aux", "ep_size", "pad_token_id", "_name_or_path", "num_key_value_heads",
    "moe_layer_freq", "attention_bias", "mlp_bias", "name_or_path", "id2label", "label2id", "return_dict",
    "output_hidden_states", "output_attentions", "is_encoder_decoder", "tie_encoder_decoder",
    "rope_theta", "rope_scaling", "rope_parameters", "quantization_config", "num_mtp_layers",
    "chunk_size_feed_forward", "problem_type", "_attn_implementation_autoset", "use_mla",
}

_DIRECT = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("rope", "quantization")]


def _read_json(source) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = pathlib.Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config field 'rope_parameters': must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if "factor" not in params or params["factor"] is None:
        # HF: DeepSeek-style configs without a factor use max_position_embeddings / original (modeling_rope_utils).
        orig = params.get("original_max_position_embeddings")
        if not orig:
            raise ValueError("config field 'rope_parameters.factor': missing for rope_type "
                             f"{rope_type!r} and no original_max_position_embeddings to derive it")
        params = {**params, "factor": d.get("max_position_embeddings", 4096) / orig}
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
    for k in params:
        if k not in known:
            warnings.warn(f"config field 'rope_parameters.{k}' is not used by jaxinfer", stacklevel=3)
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or d.get("max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _quant_from_hf(d: dict[str, Any]) -> QuantConfig | None:
    q = d.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method", "fp8") != "fp8":
        raise ValueError(f"config field 'quantization_config.quant_method': {q.get('quant_method')!r} is not "
                         "supported (DeepSeek's 'fp8' block format only)")
    return QuantConfig(
        fmt=q.get("fmt", "e4m3"),
        weight_block_size=tuple(q.get("weight_block_size", (128, 128))),
        activation_scheme=q.get("activation_scheme", "dynamic"),
        scale_fmt=q.get("scale_fmt"),
    )


def from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    """HF config dict -> ModelConfig. Unknown fields warn; unsupported values raise ValueError naming the field."""
    model_type = d.get("model_type", "deepseek_v3")
    if model_type not in ("deepseek_v3", "deepseek_v2"):
        raise ValueError(f"config field 'model_type': {model_type!r} is not supported (deepseek_v3 or deepseek_v2)")
    for k in sorted(set(d) - set(_DIRECT) - _IGNORED):
        warnings.warn(f"config field {k!r} is not used by jaxinfer and is ignored", stacklevel=3)
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config field 'moe_layer_freq': only 1 is supported, got {d['moe_layer_freq']!r}")
    for bias_field in ("attention_bias", "mlp_bias"):
        if d.get(bias_field):
            raise ValueError(f"config field {bias_field!r}: biases are not supported (DeepSeek checkpoints have none)")
    heads = d.get("num_attention_heads")
    kv_heads = d.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(f"config field 'num_key_value_heads': MLA expands keys per query head, so it must equal "
                         f"num_attention_heads={heads}, got {kv_heads}")
    defaults = ModelConfig.deepseek_v3() if model_type == "deepseek_v3" else ModelConfig.deepseek_v2_lite()
    kwargs: dict[str, Any] = {}
    for name in _DIRECT:
        if name in d:
            kwargs[name] = d[name]
    if "num_nextn_predict_layers" not in d and "num_mtp_layers" in d:
        kwargs["num_nextn_predict_layers"] = d["num_mtp_layers"]
    kwargs.setdefault("num_nextn_predict_layers", 0)
    if model_type == "deepseek_v2":
        kwargs.setdefault("scoring_func", "softmax")
        kwargs.setdefault("topk_method", "greedy")
        kwargs.setdefault("first_k_dense_replace", 0)  # transformers' DeepseekV2Config default
        kwargs.setdefault("norm_topk_prob", False)
        if kwargs.get("norm_topk_prob"):
            warnings.warn("DeepSeek-V2 family: norm_topk_prob is ignored, as in transformers' DeepseekV2 router",
                          stacklevel=2)
            kwargs["norm_topk_prob"] = False
    if kwargs.get("n_group") is None:
        kwargs["n_group"] = 1
    if kwargs.get("topk_group") is None:
        kwargs["topk_group"] = 1
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
    if kwargs.get("n_routed_experts") is None and "n_routed_experts" in kwargs:
        kwargs["n_routed_experts"] = 0
        kwargs["first_k_dense_replace"] = kwargs.get("num_hidden_layers", defaults.num_hidden_layers)
    for k in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
        if k in kwargs and kwargs[k] is None:
            kwargs[k] = getattr(defaults, k)
    config = defaults.replace(rope=_rope_from_hf(d), quantization=_quant_from_hf(d), **kwargs)
    return config


def to_hf_dict(c: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if c.model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": c.model_type,
        "num_key_value_heads": c.num_attention_heads,
    }
    for name in _DIRECT:
        value = getattr(c, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    r = c.rope
    rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "yarn":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        for k in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(r, k) is not None:
                rope[k] = getattr(r, k)
    out["rope_parameters"] = rope
    if c.quantization is not None:
        q = c.quantization
        out["quantization_config"] = {"quant_method": "fp8", "fmt": q.fmt, "activation_scheme": q.activation_scheme,
                                      "weight_block_size": list(q.weight_block_size)}
        if q.scale_fmt:
            out["quantization_config"]["scale_fmt"] = q.scale_fmt
    return out
