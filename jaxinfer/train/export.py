"""A trained model -> an HF checkpoint directory in DeepSeek's FP8 release format.

Tensor names are the ones jaxinfer's loader reads (checkpoint/hf_loader.py ``source_for``), so export and load
are each other's inverse by construction. Dtypes follow DeepSeek-V3's release (and the tests' hf_oracle.py
``convert_to_fp8``): the 2-D projections of attention, dense MLPs, shared and routed experts and the MTP
``eh_proj`` in float8_e4m3fn with float32 ``weight_scale_inv`` per 128x128 block (checkpoint/fp8.py
``quantize_blockwise``); router ``e_score_correction_bias`` in float32; everything else (embeddings, lm_head,
norms, router ``gate.weight``) in bfloat16. The MTP module's copies of ``embed_tokens`` and ``shared_head.head``
that releases carry are left out: they equal the main model's, jaxinfer ignores them and transformers' MTP
loader takes the main model's.
"""

from __future__ import annotations

import json
import pathlib
import re

import ml_dtypes
import numpy as np
from flax import nnx

from jaxinfer.checkpoint.fp8 import quantize_blockwise
from jaxinfer.checkpoint.hf_loader import source_for
from jaxinfer.checkpoint.safetensors_io import write_safetensors
from jaxinfer.checkpoint.tree import flatten_tree
from jaxinfer.config import ModelConfig
from jaxinfer.parallel.placement import PLACEMENT_LEAVES

FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|eh_proj)\.weight$"
)
SAFETENSORS_FILE = "model.safetensors"


def named_tensors(config: ModelConfig, model: nnx.Module) -> dict[str, np.ndarray]:
    """float32 numpy tensors under their checkpoint names (stacked experts split per expert)."""
    out = {}
    for path, value in flatten_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param))):
        if path[-1] in PLACEMENT_LEAVES:
            continue
        value = np.asarray(value, np.float32)
        src = source_for(config, path, set())
        if src.stacked:
            for e, name in enumerate(src.names):
                out[name] = value[e]
        else:
            out[src.names[0]] = value
    return out


def release_format(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 tensors -> DeepSeek's FP8 release dtypes (see the module docstring)."""
    out = {}
    for name, value in tensors.items():
        if FP8_WEIGHT.match(name):
            out[name], out[name + "_scale_inv"] = quantize_blockwise(value)
        elif name.endswith("e_score_correction_bias"):
            out[name] = value.astype(np.float32)
        else:
            out[name] = value.astype(ml_dtypes.bfloat16)
    return out


def hf_config(config: ModelConfig) -> dict:
    """config.json: transformers' DeepseekV3Config fields plus DeepSeek's quantization_config."""
    if config.quantization is None:
        raise ValueError("export writes DeepSeek's FP8 format: the config needs a quantization (QuantConfig())")
    cfg = config.to_hf_dict()
    cfg.update(dtype="bfloat16", initializer_range=0.02)
    return cfg


def generation_config(config: ModelConfig) -> dict:
    # Sampling defaults of DeepSeek-V3's generation_config.json (temperature 0.6, top_p 0.95).
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": True,
            "temperature": 0.6, "top_p": 0.95}


def export_hf(config: ModelConfig, model: nnx.Module, out_dir) -> pathlib.Path:
    """Writes config.json, generation_config.json and model.safetensors (FP8 release format) into out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = release_format(named_tensors(config, model))
    write_safetensors(out / SAFETENSORS_FILE, tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    return out
