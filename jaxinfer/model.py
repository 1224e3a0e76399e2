"""``load_model``: a checkpoint directory (HF safetensors or jaxinfer's orbax form) -> a ``Model`` on a mesh.

``Model.logits(token_ids)`` is the public contract (docs/architecture.md "Public contract"): int [B, T] ->
np.float32 [B, T, vocab], a causal forward from position 0, the batch split over every device of the mesh
(data-parallel attention) and padded to a multiple of the DP size.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.hf_loader import checkpoint_layout, load_hf_params
from jaxinfer.checkpoint.tree import flatten_tree, unflatten_tree
from jaxinfer.checkpoint.orbax_io import is_orbax_dir, restore_pytree, save_pytree
from jaxinfer.checkpoint.safetensors_io import SafetensorsCheckpoint
from jaxinfer.config import ModelConfig
from jaxinfer.models.deepseek import DeepseekForCausalLM
from jaxinfer.models.layers import RMSNorm
from jaxinfer.models.moe import Experts
from jaxinfer.parallel.mesh import MeshSpec, make_mesh
from jaxinfer.parallel.multihost import barrier, global_array, to_host
from jaxinfer.parallel.placement import check_slots, placement_values
from jaxinfer.parallel.plan import ParallelPlan

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ORBAX_META = "jaxinfer.json"
ORBAX_PARAMS = "params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
BATCH = P(("data", "expert"))  # the batch is split over all devices: each one is a DP rank


def parse_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    for v in DTYPES.values():
        if np.dtype(dtype) == np.dtype(v):
            return v
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def param_sharding(mesh: jax.sharding.Mesh, path: tuple, shape: tuple) -> NamedSharding:
    """Where each parameter lives (docs/architecture.md "Mesh semantics"): routed-expert slots split over `expert` and
    replicated over `data`; attention, dense layers, shared experts, norms, embeddings and the placement tables
    replicated on every DP rank (data-parallel attention)."""
    del shape
    if len(path) >= 2 and path[-2] == "experts" and path[-1].removesuffix("_scale_inv") in Experts.PROJ:
        return NamedSharding(mesh, P("expert"))
    return NamedSharding(mesh, P())


def _build(config: ModelConfig, dtype, plan: ParallelPlan, **layout) -> tuple[nnx.GraphDef, nnx.State]:
    """The module's graph and an abstract state (no memory allocated)."""
    if config.num_moe_layers or layout.get("num_mtp_layers"):
        check_slots(config.n_routed_experts + plan.num_redundant_experts, plan.expert_ranks)
    elif plan.num_redundant_experts:
        raise ValueError(f"num_redundant_experts={plan.num_redundant_experts}: the model has no MoE layers "
                         f"(first_k_dense_replace = num_hidden_layers = {config.num_hidden_layers}), so no expert "
                         f"slots to add")
    abstract = nnx.eval_shape(
        lambda: DeepseekForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, plan=plan, **layout))
    return nnx.split(abstract)


class Model:
    """A DeepSeek model placed on a mesh, with its jitted forward functions."""

    def __init__(self, config: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, plan: ParallelPlan, dtype,
                 layout: dict[str, Any], path: pathlib.Path | None = None):
        self.config = config
        self.plan = plan
        self.mesh = plan.mesh
        self.dtype = dtype
        self.layout = layout
        self.path = path
        self.graphdef = graphdef
        self.state = state

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def random(cls, config: ModelConfig, mesh: MeshSpec = None, dtype="float32", seed: int = 0,
               **parallel) -> Model:
        """Random weights (normal, std 0.02): for smoke runs and benchmarks of architectures, not outputs.
        parallel: ParallelPlan options (fp8_dispatch, num_redundant_experts, moe_path)."""
        plan, dtype = ParallelPlan(make_mesh(mesh), **parallel), parse_dtype(dtype)
        layout = dict(fp8="off", num_mtp_layers=config.num_nextn_predict_layers, mtp_eh_proj_fp8="off")
        graphdef, state = _build(config, dtype, plan, **layout)
        params = random_params(nnx.merge(graphdef, state), seed)
        nnx.replace_by_pure_dict(state, unflatten_tree(
            [(p, global_array(v, param_sharding(plan.mesh, p, v.shape))) for p, v in flatten_tree(params)]))
        return cls(config, graphdef, state, plan, dtype, layout)

    @property
    def has_mtp(self) -> bool:
        return self.layout["num_mtp_layers"] > 0

    @property
    def dp_size(self) -> int:
        return self.mesh.size

    # ---- inputs ------------------------------------------------------------------------------------
    def check_token_ids(self, token_ids, name: str = "token_ids") -> np.ndarray:
        try:
            ids = np.asarray(token_ids)
        except ValueError:  # numpy's "inhomogeneous shape": rows of different lengths
            raise ValueError(f"{name} must be a 2-D integer array [B, T]: its rows have different lengths (pad them "
                             "to one length; every row is scored from position 0)") from None
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"{name} must be a non-empty 2-D integer array [B, T], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            b, t = np.argwhere(bad)[0]
            raise ValueError(f"{name}[{b}, {t}] = {ids[b, t]} is outside the vocabulary [0, {self.config.vocab_size})"
                             f" ({int(bad.sum())} such ids)")
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{name} has {ids.shape[1]} positions, more than max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        return ids.astype(np.int32)

    def _shard_batch(self, *arrays: np.ndarray) -> list[jax.Array]:
        """Pads B to a multiple of the DP size and splits it over all devices (every process passes the same
        host arrays; each fills only its own devices' rows)."""
        b = arrays[0].shape[0]
        padded = -(-b // self.dp_size) * self.dp_size
        sharding = NamedSharding(self.mesh, BATCH)
        return [global_array(np.pad(a, [(0, padded - b)] + [(0, 0)] * (a.ndim - 1)), sharding) for a in arrays]

    # ---- forward -----------------------------------------------------------------------------------
    @functools.cached_property
    def _jit_logits(self):
        graphdef = self.graphdef

        @jax.jit
        def run(state, ids):
            model = nnx.merge(graphdef, state)
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
            return model(ids, positions)

        return run

    @functools.cached_property
    def _jit_mtp(self):
        graphdef = self.graphdef

        @jax.jit
        def run(state, ids, next_ids):
            model = nnx.merge(graphdef, state)
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
            h = model.hidden_states(ids, positions)
            return model.mtp_logits(h, next_ids, positions)

        return run

    def logits(self, token_ids) -> np.ndarray:
        """int [B, T] -> np.float32 [B, T, vocab]: causal forward from position 0."""
        ids = self.check_token_ids(token_ids)
        (dev_ids,) = self._shard_batch(ids)
        out = self._jit_logits(self.state, dev_ids)
        return to_host(out)[: ids.shape[0]]  # the whole batch, in every process

    def mtp_logits(self, token_ids, next_token_ids) -> np.ndarray:
        """Draft logits of the first MTP module: row t combines the main model's final-normed h_t with
        embed(next_token_ids[:, t]) and predicts the token after next. int [B, T] x2 -> np.float32 [B, T, vocab]."""
        if not self.has_mtp:
            raise RuntimeError("this model has no MTP module (the checkpoint carries no MTP tensors, or the config "
                               "sets num_nextn_predict_layers = 0)")
        ids = self.check_token_ids(token_ids)
        nxt = self.check_token_ids(next_token_ids, "next_token_ids")
        if nxt.shape != ids.shape:
            raise ValueError(f"next_token_ids shape {nxt.shape} must equal token_ids shape {ids.shape}")
        dev_ids, dev_next = self._shard_batch(ids, nxt)
        out = self._jit_mtp(self.state, dev_ids, dev_next)
        return to_host(out)[: ids.shape[0]]

    # ---- orbax -------------------------------------------------------------------------------------
    def save(self, out_dir) -> pathlib.Path:
        """Writes jaxinfer's orbax form: config.json (HF form), jaxinfer.json (layout, dtype), params/ (orbax)
        and the tokenizer files of the source checkpoint.

        Multi-process runs: every process calls this with the same directory (on a filesystem they share); each
        writes its own shards, process 0 the small files."""
        out = pathlib.Path(out_dir)
        if out.exists() and any(out.iterdir()):
            raise CheckpointError(f"output directory {out} exists and is not empty")
        barrier("jaxinfer.Model.save: output directory checked")  # by every process, before process 0 writes
        out.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (out / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2))
            meta = dict(format="jaxinfer-orbax", version=1, dtype=np.dtype(self.dtype).name,
                        num_redundant_experts=self.plan.num_redundant_experts, **self.layout)
            (out / ORBAX_META).write_text(json.dumps(meta, indent=2))
        save_pytree(out / ORBAX_PARAMS, _str_keys(nnx.to_pure_dict(self.state)))
        if self.path is not None and jax.process_index() == 0:
            for name in TOKENIZER_FILES:
                if (self.path / name).is_file():
                    shutil.copy(self.path / name, out / name)
        return out


def random_params(abstract_module: nnx.Module, seed: int) -> dict:
    """Host-side random weights for an abstract module: N(0, 0.02) matrices, unit norms, zero router biases,
    the identity expert placement.

    Drawn with numpy because XLA:CPU compiles every jax.random call site separately, which makes even a tiny preset
    slow to initialise (docs/benchmarks.md "Test suite and compile times")."""
    rng = np.random.default_rng(seed)
    norms = {path for path, node in nnx.iter_graph(abstract_module) if isinstance(node, RMSNorm)}
    flat = flatten_tree(nnx.to_pure_dict(nnx.state(abstract_module)))
    placements = placement_values(abstract_module.config, dict(flat))
    out = []
    for path, leaf in flat:
        if path in placements:
            value = placements[path]
        elif path[:-1] in norms or str(path[-1]).endswith("scale_inv"):
            value = np.ones(leaf.shape, np.float32)
        elif path[-1] == "e_score_correction_bias":
            value = np.zeros(leaf.shape, np.float32)
        else:
            value = 0.02 * rng.standard_normal(leaf.shape, np.float32)
        out.append((path, value.astype(leaf.dtype)))
    return unflatten_tree(out)


def _str_keys(tree):
    return {str(k): _str_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _with_int_keys(tree, like):
    """Restores the integer list indices of ``like`` (nnx pure dicts) in a tree saved with string keys."""
    if not isinstance(like, dict):
        return tree
    return {k: _with_int_keys(tree[str(k)], v) for k, v in like.items()}


def is_jaxinfer_orbax(path) -> bool:
    """True for a directory written by ``Model.save`` / ``jaxinfer convert``."""
    path = pathlib.Path(path)
    return (path / ORBAX_META).is_file() and is_orbax_dir(path / ORBAX_PARAMS)


def load_model(path, mesh: MeshSpec = None, dtype="bfloat16", keep_fp8: bool = False, *,
               fp8_compute: bool | None = False, fp8_dispatch: bool = False,
               num_redundant_experts: int | None = None, moe_path: str = "auto") -> Model:
    """Loads an HF checkpoint directory (config.json + safetensors) or a jaxinfer orbax directory.

    dtype: "bfloat16" or "float32" (the compute and storage dtype of non-FP8 weights). keep_fp8: keep DeepSeek FP8
    weights as e4m3 + block scales (dequantized exactly on the fly) instead of dequantizing them at load time.
    fp8_compute: DeepSeek's deployment path for FP8 checkpoints: activations quantized per token per 128
    channels and FP8 GEMMs (implies keep_fp8); None = on for bfloat16 on GPU when the checkpoint is FP8.
    fp8_dispatch: send tokens to expert ranks in FP8 (DeepEP's format). num_redundant_experts: extra expert slots
    (identity placement until EPLB fills them; default 0, or what an orbax checkpoint was saved with).
    moe_path: the routed experts' compute path, "auto" (chosen per step shape) or forced (parallel/plan.py).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    dtype = parse_dtype(dtype)
    config = ModelConfig.from_hf_config(path)
    mesh = make_mesh(mesh)
    if is_jaxinfer_orbax(path):
        return _load_orbax(path, config, mesh, dtype, fp8_compute, fp8_dispatch, num_redundant_experts, moe_path)
    plan = ParallelPlan(mesh, fp8_dispatch, num_redundant_experts or 0, moe_path)
    ckpt = SafetensorsCheckpoint(path)
    layout = checkpoint_layout(config, ckpt)
    if config.num_nextn_predict_layers > layout["num_mtp_layers"]:
        first_missing = config.num_hidden_layers + layout["num_mtp_layers"]
        warnings.warn(f"config announces {config.num_nextn_predict_layers} MTP layer(s) but the checkpoint carries "
                      f"{layout['num_mtp_layers']} (no model.layers.{first_missing}.eh_proj.weight): MTP is "
                      "disabled for the missing ones", stacklevel=2)
    if fp8_compute is None:
        fp8_compute = layout["has_fp8"] and dtype == jnp.bfloat16 and mesh.devices.flat[0].platform == "gpu"
    if (keep_fp8 or fp8_compute) and not layout["has_fp8"]:
        raise ValueError("keep_fp8 / fp8_compute need an FP8 checkpoint (weight_scale_inv tensors); this one has none")
    fp8 = "compute" if fp8_compute else "weights" if keep_fp8 else "off"
    layout = dict(fp8=fp8, num_mtp_layers=layout["num_mtp_layers"],
                  mtp_eh_proj_fp8=fp8 if layout["mtp_eh_proj_quantized"] else "off")
    graphdef, state = _build(config, dtype, plan, **layout)
    abstract = nnx.to_pure_dict(state)
    params = load_hf_params(config, ckpt, abstract, functools.partial(param_sharding, mesh), layout["num_mtp_layers"])
    nnx.replace_by_pure_dict(state, params)
    return Model(config, graphdef, state, plan, dtype, layout, path)


def _load_orbax(path: pathlib.Path, config: ModelConfig, mesh, dtype, fp8_compute: bool | None,
                fp8_dispatch: bool, num_redundant_experts: int | None, moe_path: str) -> Model:
    meta = json.loads((path / ORBAX_META).read_text())
    layout = {k: meta[k] for k in ("fp8", "num_mtp_layers", "mtp_eh_proj_fp8")}
    if layout["fp8"] != "off" and fp8_compute is not None:  # FP8 weights: the compute mode is the caller's
        mode = "compute" if fp8_compute else "weights"
        layout["fp8"] = mode
        layout["mtp_eh_proj_fp8"] = mode if layout["mtp_eh_proj_fp8"] != "off" else "off"
    elif fp8_compute:
        raise ValueError(f"fp8_compute needs FP8 weights; {path} holds none")
    saved_redundant = meta.get("num_redundant_experts", 0)
    if num_redundant_experts not in (None, saved_redundant):
        raise ValueError(f"{path} was saved with num_redundant_experts={saved_redundant}; load it with that "
                         f"(got {num_redundant_experts}) or convert the HF checkpoint again")
    plan = ParallelPlan(mesh, fp8_dispatch, saved_redundant, moe_path)
    graphdef, state = _build(config, dtype, plan, **layout)
    abstract = nnx.to_pure_dict(state)
    wanted = unflatten_tree([(p, jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=param_sharding(mesh, p, v.shape)))
                         for p, v in flatten_tree(abstract)])
    # A model saved in bfloat16 may be asked for in float32 (and back): FP8 and float32 router leaves keep
    # their dtype in both, so only the floating-point weights are cast.
    restored = restore_pytree(path / ORBAX_PARAMS, _str_keys(wanted), allow_dtype_cast=True)
    nnx.replace_by_pure_dict(state, _with_int_keys(restored, abstract))
    return Model(config, graphdef, state, plan, dtype, layout, path)
