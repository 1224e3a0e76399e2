"""Oracle side of the model tests: tiny random HF transformers DeepSeek models, their checkpoints, reference logits.

Everything here is independent of jaxinfer: models are HF ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``
(the reference implementation named in docs/architecture.md "Reference semantics"), checkpoints are written and
read with the official ``safetensors`` library through torch (which knows BF16 and F8_E4M3), and FP8 quantization
is plain numpy.

Checkpoints are built once per test session and shared between test modules through the caches below
(``build_case`` and ``load_jax_model``): pytest would build a session fixture imported into two modules twice.

Layout produced by ``save_pretrained`` in transformers 5 (checked): DeepSeek's per-expert names
``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` (HF fuses them into ``gate_up_proj`` in memory only),
``model.layers.L.mlp.gate.weight`` and ``model.layers.L.mlp.gate.e_score_correction_bias`` (V3).
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import re
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

# The reference models are tiny: on the 2-core test machines one torch thread is much faster than two, whose OpenMP
# workers contend with JAX's threads (docs/benchmarks.md "Test suite and compile times").
torch.set_num_threads(1)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # DeepSeek's weight_block_size [128, 128]
INDEX_NAME = "model.safetensors.index.json"

# 2-D projection weights that DeepSeek's FP8 release stores as e4m3 + weight_scale_inv (inference/convert.py and
# the released model.safetensors.index.json): attention, dense MLP, routed and shared experts.
_FP8_PATTERN = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$"
)
_EH_PROJ_PATTERN = re.compile(r"model\.layers\.\d+\.eh_proj\.weight$")


# ---- model construction ---------------------------------------------------------------------------------------


def hf_config(cfg: dict[str, Any]):
    """An HF config object from a config.json-style dict (``model_type`` picks V2 or V3)."""
    cfg = dict(cfg)
    cls = DeepseekV3Config if cfg.pop("model_type", "deepseek_v3") == "deepseek_v3" else DeepseekV2Config
    config = cls(**cfg)
    config._attn_implementation = "eager"  # plain softmax attention with an additive mask: the textbook oracle
    config._experts_implementation = "eager"  # HF's per-expert loop, not torch._grouped_mm
    return config


def build_hf_model(cfg: dict[str, Any], seed: int = 0, std_scale: float = 0.5, head_std: float = 3.0,
                   bias_std: float = 0.1):
    """A random float32 HF DeepSeek model whose outputs are far from flat.

    Every parameter is re-drawn (HF's default init, std 0.02 and unit norms, gives near-uniform logits and
    near-identical experts): linear weights with std std_scale / sqrt(fan_in), so activations stay O(1) through
    the layers; embeddings N(0, 1); RMSNorm weights 1 + N(0, 0.1) (so that swapping two norms changes the
    result); the lm_head std head_std / sqrt(hidden) so logits spread over ~head_std; V3 routers get a NON-ZERO
    e_score_correction_bias N(0, bias_std) (a zero buffer by default), big enough to change the chosen experts of
    some tokens (``routing_stats`` measures it).

    std_scale 0.5 (sublayer outputs about half the size of the unit-variance embeddings in the residual stream):
    measured with torch itself (HF model in bf16 vs f32), std_scale 1.0 makes these tiny random MoE models
    chaotic -- one bf16 rounding flips an expert choice and moves logits by ~25% of their range, 96% greedy
    agreement -- which measures the random model, not an implementation; at 0.5 torch's own bf16 agrees on
    100% of 128 positions, while f32 errors of any real bug (norms, RoPE, routing, scales) stay far above 1e-4.
    """
    config = hf_config(cfg)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # n_shared_experts 0: torch's default init of the width-0 shared MLP says so
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op", UserWarning)
        model = (DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else DeepseekV2ForCausalLM)(config)
    randomize_(model, seed, std_scale=std_scale, head_std=head_std, bias_std=bias_std)
    return model.eval()


def randomize_(module: torch.nn.Module, seed: int, std_scale: float = 0.5, head_std: float = 3.0,
               bias_std: float = 0.1) -> None:
    """Re-draws every parameter and router bias of ``module`` in place (see ``build_hf_model``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.numel() == 0:  # n_shared_experts 0: transformers builds a shared MLP of width 0
                continue
            if name.endswith("embed_tokens.weight"):
                std = 1.0
            elif name.endswith("lm_head.weight"):
                std = head_std / math.sqrt(p.shape[-1])
            elif "norm" in name.split(".")[-2]:  # *_layernorm, norm, enorm, hnorm, post_norm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                continue
            else:  # 2-D linear [out, in] or fused experts [E, out, in]: fan_in is the last dim
                std = std_scale / math.sqrt(p.shape[-1])
            p.copy_(std * torch.randn(p.shape, generator=gen))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn(b.shape, generator=gen))


@torch.no_grad()
def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    """HF logits [B, T, V] float32 for int ids [B, T] (causal, positions from 0, no padding)."""
    out = model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate of exactly n tokens after ``prompt`` (its own cache; no EOS stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def routing_stats(model, ids: np.ndarray) -> dict[str, float]:
    """Oracle sanity: for V3 routers, the fraction of (token, layer) whose chosen expert SET changes when the
    e_score_correction_bias is zeroed. Computed from the router inputs recorded during a forward pass."""
    inputs: list[tuple[Any, torch.Tensor]] = []
    hooks = []
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            hooks.append(m.register_forward_hook(lambda mod, args, out: inputs.append((mod, args[0]))))
    try:
        model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    changed = total = 0
    for router, x in inputs:
        _, _, idx_bias = router(x)
        saved = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        _, _, idx_zero = router(x)
        router.e_score_correction_bias.copy_(saved)
        a = idx_bias.sort(-1).values
        b = idx_zero.sort(-1).values
        changed += int((a != b).any(-1).sum())
        total += a.shape[0]
    return {"changed": changed, "total": total, "fraction": changed / max(total, 1)}


# ---- checkpoints ---------------------------------------------------------------------------------------------


def save_checkpoint(model, directory: pathlib.Path, max_shard_size: str | None = None) -> pathlib.Path:
    """``save_pretrained`` (float32 safetensors, HF config.json), optionally sharded with an index."""
    directory = pathlib.Path(directory)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def read_config(directory) -> dict[str, Any]:
    return json.loads((pathlib.Path(directory) / "config.json").read_text())


def write_config(directory, cfg: dict[str, Any]) -> None:
    (pathlib.Path(directory) / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def to_legacy_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The pre-transformers-5 config form: ``rope_theta`` at top level and ``rope_scaling`` with ``"type"``."""
    cfg = copy.deepcopy(cfg)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    if rope_type != "default":
        cfg["rope_scaling"] = {"type": rope_type, **params}
    return cfg


def checkpoint_files(directory) -> list[pathlib.Path]:
    return sorted(pathlib.Path(directory).glob("*.safetensors"))


def read_tensors(directory) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (official safetensors reader; keeps BF16 / F8_E4M3 dtypes)."""
    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(directory):
        out.update(load_file(str(f)))
    return out


def write_tensors(directory, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Replaces all safetensors files of ``directory`` with ``tensors`` in ``shards`` files plus an index."""
    directory = pathlib.Path(directory)
    for f in checkpoint_files(directory):
        f.unlink()
    (directory / INDEX_NAME).unlink(missing_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    _write_index(directory, weight_map)


def _write_index(directory: pathlib.Path, weight_map: dict[str, str]) -> None:
    size = sum(f.stat().st_size for f in checkpoint_files(directory))
    (directory / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def add_tensor_file(directory, tensors: dict[str, torch.Tensor], filename: str) -> None:
    """Adds one safetensors file to a checkpoint and creates / extends ``model.safetensors.index.json``."""
    directory = pathlib.Path(directory)
    index_path = directory / INDEX_NAME
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        weight_map = {}
        for f in checkpoint_files(directory):
            weight_map.update({k: f.name for k in load_file(str(f))})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / filename), metadata={"format": "pt"})
    weight_map.update({k: filename for k in tensors})
    _write_index(directory, weight_map)


def copy_checkpoint(src, dst) -> pathlib.Path:
    shutil.copytree(src, dst)
    return pathlib.Path(dst)


# ---- FP8 (DeepSeek release format) -------------------------------------------------------------------------


def quantize_block_fp8(w: np.ndarray, scale_fmt: str | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """Block-wise e4m3 quantization as in DeepSeek's release: per 128x128 block s = amax / 448
    (``ue8m0``: s = 2**ceil(log2(amax / 448)), DeepSeek-V3.1), q = clip(w / s, +-448) in e4m3, and the stored
    ``weight_scale_inv`` is s (so w ~ q * s). Returns (q as torch float8_e4m3fn [out, in], s float32
    [ceil(out/128), ceil(in/128)])."""
    w = np.asarray(w, np.float32)
    out_dim, in_dim = w.shape
    nb_o, nb_i = -(-out_dim // BLOCK), -(-in_dim // BLOCK)
    padded = np.zeros((nb_o * BLOCK, nb_i * BLOCK), np.float32)
    padded[:out_dim, :in_dim] = w
    blocks = padded.reshape(nb_o, BLOCK, nb_i, BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))  # [nb_o, nb_i]
    s = np.maximum(amax, 1e-10) / FP8_MAX
    if scale_fmt == "ue8m0":
        s = np.exp2(np.ceil(np.log2(s)))
    s = s.astype(np.float32)
    q = np.clip(blocks / s[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(padded.shape)[:out_dim, :in_dim]
    return torch.from_numpy(np.ascontiguousarray(q)).to(torch.float8_e4m3fn), s


def is_fp8_weight(name: str, tensor: torch.Tensor, quantize_eh_proj: bool) -> bool:
    if tensor.ndim != 2:
        return False
    return bool(_FP8_PATTERN.match(name) or (quantize_eh_proj and _EH_PROJ_PATTERN.match(name)))


def convert_to_fp8(directory, scale_fmt: str | None = None, quantize_eh_proj: bool = True,
                   other_dtype: torch.dtype = torch.bfloat16, shards: int = 1) -> dict[str, Any]:
    """Rewrites a checkpoint directory in place into DeepSeek's FP8 release format.

    Projection weights (``is_fp8_weight``) -> F8_E4M3 + sibling ``<name>_scale_inv`` float32 [ceil(out/128),
    ceil(in/128)]; the other float tensors (embeddings, lm_head, norms, router gate.weight, the MTP layer's copies)
    -> ``other_dtype`` (BF16 in the release), except ``e_score_correction_bias`` which stays float32 (as released).
    ``config.json`` gets DeepSeek's ``quantization_config``. Returns the quantization_config written."""
    tensors = read_tensors(directory)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_fp8_weight(name, t, quantize_eh_proj):
            q, s = quantize_block_fp8(t.float().numpy(), scale_fmt)
            out[name] = q
            out[name + "_scale_inv"] = torch.from_numpy(s)
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(other_dtype)
    write_tensors(directory, out, shards=shards)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if scale_fmt:
        qc["scale_fmt"] = scale_fmt
    cfg = read_config(directory)
    cfg["quantization_config"] = qc
    write_config(directory, cfg)
    return qc


# ---- loading a checkpoint into HF --------------------------------------------------------------------------


def load_hf_model(directory, dtype: torch.dtype = torch.float32):
    """HF's own from_pretrained of a float checkpoint dir (eager attention and experts)."""
    cfg = read_config(directory)
    cls = DeepseekV3ForCausalLM if cfg.get("model_type", "deepseek_v3") == "deepseek_v3" else DeepseekV2ForCausalLM
    model = cls.from_pretrained(str(directory), dtype=dtype, attn_implementation="eager",
                                experts_implementation="eager")
    return model.eval()


def load_state_into_hf(model, tensors: dict[str, np.ndarray | torch.Tensor]) -> None:
    """Writes DeepSeek-named float tensors (per-expert names) into an HF model in place; every model parameter and
    persistent buffer must be covered exactly once. Experts are fused the way HF holds them:
    gate_up_proj[e] = cat(gate_proj, up_proj) along the output dim, down_proj[e] = down_proj."""
    state = model.state_dict()
    expert = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    done = set()
    with torch.no_grad():
        for name, value in tensors.items():
            t = torch.as_tensor(np.asarray(value, np.float32) if isinstance(value, np.ndarray) else value).float()
            m = expert.match(name)
            if m:
                fused.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
                continue
            if name not in state:
                raise KeyError(f"{name} is not a tensor of the HF model")
            state[name].copy_(t)
            done.add(name)
        for prefix, per_expert in fused.items():
            num = len(per_expert)
            state[prefix + ".gate_up_proj"].copy_(torch.stack(
                [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]], 0) for e in range(num)]))
            state[prefix + ".down_proj"].copy_(torch.stack([per_expert[e]["down_proj"] for e in range(num)]))
            done.update({prefix + ".gate_up_proj", prefix + ".down_proj"})
    missing = set(state) - done
    if missing:
        raise KeyError(f"tensors not provided for {sorted(missing)}")


# ---- MTP ---------------------------------------------------------------------------------------------------


@dataclass
class MtpOracle:
    """An HF ``MtpLayer`` (enorm, hnorm, eh_proj, a DeepseekV3DecoderLayer, post_norm = shared_head.norm) bound to
    a main model, run exactly as DeepSeek's MTP module is defined (DeepSeek-V3 report, section 2.2)."""

    main: Any
    layer: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def logits(self, ids: np.ndarray, next_ids: np.ndarray) -> np.ndarray:
        ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        nxt = torch.as_tensor(np.asarray(next_ids), dtype=torch.long)
        bsz, t = ids_t.shape
        h = self.main.model(input_ids=ids_t, use_cache=False).last_hidden_state  # after the final norm
        emb = self.main.model.embed_tokens(nxt)  # [B, T, D]
        pos = torch.arange(t)[None].expand(bsz, t)
        cos_sin = self.main.model.rotary_emb(emb, pos)
        causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)  # additive: 0 on and below diagonal
        mask = causal[None, None].expand(bsz, 1, t, t)
        x = self.layer(inputs_embeds=emb, previous_hidden_state=h, position_embeddings=cos_sin,
                       attention_mask=mask, position_ids=pos, cache=None)  # post_norm applied inside
        return self.main.lm_head(x).float().numpy()


def build_mtp_oracle(main, seed: int = 1, bias_std: float = 0.1) -> MtpOracle:
    """A random MTP layer for ``main`` (a DeepseekV3ForCausalLM) at layer index num_hidden_layers, with its tensors
    under DeepSeek's checkpoint names (``MtpOracle.tensors``)."""
    from transformers.modeling_layers import MtpLayer

    config = main.config
    n = config.num_hidden_layers
    layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=n, use_post_norm=True)
    randomize_(layer, seed, bias_std=bias_std)
    layer.eval()
    pre = f"model.layers.{n}."
    tensors: dict[str, torch.Tensor] = {}
    for name, t in layer.state_dict().items():
        t = t.detach().clone().float()
        if name.startswith("mtp_block."):
            inner = name[len("mtp_block."):]
            if inner.endswith("mlp.experts.gate_up_proj"):
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    tensors[f"{pre}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                    tensors[f"{pre}mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
            elif inner.endswith("mlp.experts.down_proj"):
                for e in range(t.shape[0]):
                    tensors[f"{pre}mlp.experts.{e}.down_proj.weight"] = t[e].clone()
            else:
                tensors[pre + inner] = t
        elif name == "post_norm.weight":
            tensors[pre + "shared_head.norm.weight"] = t
        else:  # enorm.weight, hnorm.weight, eh_proj.weight
            tensors[pre + name] = t
    tensors[pre + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone().float()
    tensors[pre + "shared_head.head.weight"] = main.lm_head.weight.detach().clone().float()
    return MtpOracle(main=main, layer=layer, tensors=tensors)


def load_mtp_tensors(oracle: MtpOracle, tensors: dict[str, np.ndarray | torch.Tensor]) -> None:
    """Writes DeepSeek-named layer-N tensors (``MtpOracle.tensors`` layout) back into the oracle's MtpLayer, the
    inverse of ``build_mtp_oracle``; the embedding / head copies must equal the main model's (as released)."""
    n = oracle.main.config.num_hidden_layers
    pre = f"model.layers.{n}."
    state = oracle.layer.state_dict()
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    done = set()
    expert = re.compile(r"(mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    with torch.no_grad():
        for name, value in tensors.items():
            t = torch.as_tensor(np.asarray(value, np.float32) if isinstance(value, np.ndarray) else value).float()
            inner = name[len(pre):]
            if inner == "embed_tokens.weight":
                torch.testing.assert_close(t, oracle.main.model.embed_tokens.weight, rtol=0, atol=0)
                continue
            if inner == "shared_head.head.weight":
                torch.testing.assert_close(t, oracle.main.lm_head.weight, rtol=0, atol=0)
                continue
            if inner == "shared_head.norm.weight":
                key = "post_norm.weight"
            elif inner in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                key = inner
            else:
                m = expert.match(inner)
                if m:
                    fused.setdefault(int(m.group(2)), {})[m.group(3)] = t
                    continue
                key = "mtp_block." + inner
            state[key].copy_(t)
            done.add(key)
        if fused:
            num = len(fused)
            state["mtp_block.mlp.experts.gate_up_proj"].copy_(torch.stack(
                [torch.cat([fused[e]["gate_proj"], fused[e]["up_proj"]], 0) for e in range(num)]))
            state["mtp_block.mlp.experts.down_proj"].copy_(torch.stack([fused[e]["down_proj"] for e in range(num)]))
            done.update({"mtp_block.mlp.experts.gate_up_proj", "mtp_block.mlp.experts.down_proj"})
    missing = set(state) - done
    if missing:
        raise KeyError(f"MTP tensors not provided for {sorted(missing)}")


def add_mtp_to_checkpoint(directory, oracle: MtpOracle, filename: str = "model-mtp.safetensors") -> None:
    """MTP tensors as an extra safetensors file + index; ``num_nextn_predict_layers`` = 1 in config.json."""
    add_tensor_file(directory, oracle.tensors, filename)
    cfg = read_config(directory)
    cfg["num_nextn_predict_layers"] = 1
    write_config(directory, cfg)


# ---- tiny configurations ------------------------------------------------------------------------------------


def _yarn(factor, orig=4096, theta=10000.0, **extra):
    return {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": orig,
            "beta_fast": 32, "beta_slow": 1, **extra}


# Together these vary every feature the model code branches on (see test_parity_hf.py for the list). Each is a
# config.json-style dict (transformers 5 ``rope_parameters`` form); ``num_mtp_layers`` 0 keeps transformers from
# writing its default ``num_nextn_predict_layers`` 1 into configs that have no MTP tensors.
CONFIGS: dict[str, dict[str, Any]] = {
    # V3 with q_lora, YaRN (DeepSeek-V3's mscale = mscale_all_dim = 1), 4 groups / keep 2, 1 dense layer,
    # 5 heads, v_head_dim != qk_nope_head_dim, dims above 128 (hidden 160, intermediate 136, q_b out 240,
    # kv_b out 280): FP8 blocks are both partial and multiple. Also the base of the FP8 and MTP tests.
    "v3_qlora_yarn": dict(
        model_type="deepseek_v3", vocab_size=131, hidden_size=160, intermediate_size=136, moe_intermediate_size=72,
        num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=16384,
        rope_parameters=_yarn(4.0, mscale=1.0, mscale_all_dim=1.0), num_mtp_layers=0),
    # V3 without q_lora, default RoPE, n_group = 1, no top-k renormalisation, all layers MoE, 3 heads, 2 shared
    # experts, top-3, odd vocab 97. rms_norm_eps 1e-2 (large on purpose): using it for kv_a_layernorm (always
    # 1e-6 in HF and DeepSeek) or 1e-6 for the block norms moves the logits by ~1e-3, far above the tolerance.
    "v3_noqlora_default": dict(
        model_type="deepseek_v3", vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False,
        routed_scaling_factor=1.5, rms_norm_eps=1e-2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_mtp_layers=0),
    # V3 with 2 dense layers, 3 groups of 2 experts, no shared expert (transformers saves its width-0 MLP), YaRN
    # with mscale != mscale_all_dim (so HF's cos/sin attention_factor != 1 and the softmax scale uses
    # mscale_all_dim only), theta 50000, v_head_dim > nope.
    "v3_dense2_attnfactor": dict(
        model_type="deepseek_v3", vocab_size=113, hidden_size=96, intermediate_size=144, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=40, kv_lora_rank=48,
        qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=6, n_shared_experts=0,
        num_experts_per_tok=2, n_group=3, topk_group=2, first_k_dense_replace=2, norm_topk_prob=True,
        routed_scaling_factor=1.0, rms_norm_eps=1e-6, max_position_embeddings=16384,
        rope_parameters=_yarn(8.0, orig=2048, theta=50000.0, mscale=1.0, mscale_all_dim=0.8), num_mtp_layers=0),
    # V2 family: softmax router, greedy top-k, V2-Lite's YaRN (factor 40, mscale = mscale_all_dim = 0.707),
    # no q_lora, n_group / topk_group null as in V2-Lite-style configs.
    "v2_greedy": dict(
        model_type="deepseek_v2", vocab_size=131, hidden_size=96, intermediate_size=80, moe_intermediate_size=40,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, n_group=None, topk_group=None, topk_method="greedy", first_k_dense_replace=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_parameters=_yarn(40.0, mscale=0.707, mscale_all_dim=0.707)),
    # V2 family: group_limited_greedy (group score = max), q_lora, 5 heads, all layers MoE, YaRN without mscale
    # keys (attention_factor = 0.1 ln(factor) + 1 on cos/sin, plain softmax scale). norm_topk_prob true, which
    # HF's V2 router ignores (so must jaxinfer); rms_norm_eps 1e-2 as above, here with q_a_layernorm too.
    "v2_group_limited": dict(
        model_type="deepseek_v2", vocab_size=97, hidden_size=80, intermediate_size=72, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        first_k_dense_replace=0, norm_topk_prob=True, routed_scaling_factor=2.0, rms_norm_eps=1e-2,
        max_position_embeddings=8192, rope_parameters=_yarn(2.0)),
    # Written to disk in the legacy form (rope_theta + rope_scaling {"type": "yarn", ...}), see test_parity_hf.
    "v3_legacy_rope": dict(
        model_type="deepseek_v3", vocab_size=101, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=65536,
        rope_parameters=_yarn(16.0, theta=20000.0, mscale=0.9, mscale_all_dim=0.9), num_mtp_layers=0),
}
SEEDS = {name: i for i, name in enumerate(CONFIGS)}


@dataclass
class Case:
    """A tiny HF model and its checkpoint directory (HF's save_pretrained output, possibly edited)."""

    name: str
    model: Any
    path: pathlib.Path
    cfg: dict[str, Any]


# How some cases are written to disk: sharded by save_pretrained (index + several files), or with the legacy
# rope_theta + rope_scaling {"type": "yarn"} config form instead of transformers 5's rope_parameters.
BUILD_OPTIONS: dict[str, dict[str, Any]] = {
    "v2_group_limited": {"shard_size": "60KB"},
    "v3_legacy_rope": {"legacy_rope": True},
}


def build_case(name: str, tmp_path_factory) -> Case:
    """CONFIGS[name] built with its seed and saved (per BUILD_OPTIONS), once per session."""

    def build():
        opts = BUILD_OPTIONS.get(name, {})
        model = build_hf_model(CONFIGS[name], seed=SEEDS[name])
        path = save_checkpoint(model, tmp_path_factory.mktemp(name), max_shard_size=opts.get("shard_size"))
        if opts.get("legacy_rope"):
            write_config(path, to_legacy_rope(read_config(path)))
        return Case(name, model, path, CONFIGS[name])

    return cached(f"case:{name}", build)


# ---- shared, once-per-session builds ------------------------------------------------------------------------


_CASES: dict[str, Any] = {}
_MODELS: dict[tuple[str, str], Any] = {}


def cached(key: str, build: Callable[[], Any]) -> Any:
    """Builds ``key`` once per test session (shared by all test modules)."""
    if key not in _CASES:
        _CASES[key] = build()
    return _CASES[key]


def load_jax_model(path, dtype: str = "float32"):
    """``jaxinfer.load_model(path, mesh="1x1", dtype=dtype)``, loaded once per session per (path, dtype)."""
    import jaxinfer

    key = (str(path), dtype)
    if key not in _MODELS:
        _MODELS[key] = jaxinfer.load_model(str(path), mesh="1x1", dtype=dtype)
    return _MODELS[key]


def random_ids(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int64).astype(np.int32)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| (the f32 parity metric)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())
