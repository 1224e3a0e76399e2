"""Rebalancing: an EPLB placement applied to a loaded model's expert slots on its mesh, between engine steps.

Input: the measured expert loads (``LLM.expert_load()``: int [L, E] per MoE layer and logical expert). EPLB
(``parallel.eplb.rebalance_experts``, DeepSeek's algorithm) gives each layer a new phy2log [S] over the same S
physical slots; each slot's weights become a copy of its new expert's weights, taken from any slot that holds that
expert now (``placement.slot_sources``), and the placement tables (phy2log, log2phy, logcnt) follow. Every shape,
dtype and sharding stays the same (slots split over `expert`, log2phy already as wide as any placement can need:
``placement.max_replicas``), so the engine's compiled steps are reused.

The algorithm and the tables are ``jaxinfer.parallel``'s (eplb, placement); this module applies them to a model's
state, whose tree (``DeepseekForCausalLM``'s MoE layers, the ``Experts`` projections) it knows, so it sits above
``jaxinfer.models`` (docs/architecture.md "Layers").

The gather runs as one jitted program per array shape: slot axis split over `expert` in and out; XLA moves the
weights between expert ranks (on CPU by gathering the layer's slots on every device: peak memory is one layer's
routed experts per device, between steps).

Dims: L MoE layers, E logical experts, S physical slots, W log2phy width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models.moe import Experts
from jaxinfer.parallel import eplb
from jaxinfer.parallel.multihost import global_array, to_host
from jaxinfer.parallel.placement import placement_tables, slot_sources


def moe_experts_paths(config: ModelConfig) -> list[tuple]:
    """State paths of the main model's routed experts, in MoE-layer order (the rows of ``LLM.expert_load()``);
    the MTP layers' experts are not run by the engine's step and keep their placement."""
    return [("layers", i, "mlp", "experts") for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def experts_state(state, path: tuple):
    """The sub-state at ``path`` (a ``moe_experts_paths`` entry): {gate_proj, ..., phy2log, log2phy, logcnt}."""
    return functools.reduce(lambda node, key: node[key], path, state)


def eplb_placement(load, config: ModelConfig, num_slots: int, num_gpus: int, num_nodes: int = 1
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB for the model's MoE layers: load [L, E] -> (phy2log [L, S], log2phy [L, E, max_replicas],
    logcnt [L, E]), num_replicas = S slots, num_groups = config.n_group (hierarchical when it divides by
    num_nodes), num_gpus = the `expert` axis size."""
    load = np.asarray(load)
    if load.shape != (config.num_moe_layers, config.n_routed_experts):
        raise ValueError(f"load must be [num_moe_layers, n_routed_experts] = "
                         f"{[config.num_moe_layers, config.n_routed_experts]}, got shape {list(load.shape)}")
    return eplb.rebalance_experts(load, num_slots, config.n_group, num_nodes, num_gpus)


@functools.partial(jax.jit, static_argnames="sharding")
def _take_slots(w: jax.Array, src: jax.Array, sharding) -> jax.Array:
    """w [S, ...] -> w[src] [S, ...] placed like w."""
    return jax.lax.with_sharding_constraint(jnp.take(w, src, axis=0, mode="clip"), sharding)


def rebalanced_state(state, config: ModelConfig, phy2log: np.ndarray):
    """A new model state (an nnx.State like ``state``; ``state`` itself is unchanged) with the MoE layers'
    slots holding phy2log [L, S]: expert weights (and FP8 block scales) gathered per slot, placement tables
    replaced. Shapes, dtypes and shardings of every leaf stay as they are."""
    paths = moe_experts_paths(config)
    phy2log = np.asarray(phy2log)
    if phy2log.ndim != 2 or phy2log.shape[0] != len(paths):
        raise ValueError(f"phy2log must be [num_moe_layers={len(paths)}, slots], got shape {list(phy2log.shape)}")
    new = jax.tree.map(lambda x: x, state)  # a copy whose variables we may set
    for path, layer_phy2log in zip(paths, phy2log):
        experts = experts_state(new, path)
        old_log2phy = experts["log2phy"].get_value()
        num_slots, width = experts["phy2log"].get_value().shape[0], old_log2phy.shape[1]
        if layer_phy2log.shape != (num_slots,):
            raise ValueError(f"phy2log rows must have {num_slots} slots (the model's), got {layer_phy2log.shape[0]}")
        src = slot_sources(to_host(old_log2phy), layer_phy2log)
        src = global_array(src, NamedSharding(old_log2phy.sharding.mesh, P()))  # replicated
        for name in experts:
            if name.removesuffix("_scale_inv") in Experts.PROJ:
                w = experts[name].get_value()
                experts[name].set_value(_take_slots(w, src, w.sharding))
        for name, value in placement_tables(layer_phy2log, config.n_routed_experts, width).items():
            old = experts[name].get_value()
            experts[name].set_value(global_array(value.astype(old.dtype), old.sharding))
    return new


def current_phy2log(state, config: ModelConfig) -> np.ndarray:
    """[L, S] int64: the logical expert in each slot of each MoE layer, read from a model state."""
    rows = [to_host(experts_state(state, path)["phy2log"].get_value()) for path in moe_experts_paths(config)]
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, 0), np.int64)


def rebalance_model(model, load, num_nodes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB from ``load`` [L, E] applied to ``model`` (a jaxinfer Model; its ``state`` is replaced). Returns
    EPLB's (phy2log [L, S], log2phy [L, E, max_replicas], logcnt [L, E]). Callers that cache the state's
    leaves (the engine's Runner) must read them again."""
    config = model.config
    if not config.num_moe_layers:
        raise ValueError(f"the model has no MoE layers (first_k_dense_replace = num_hidden_layers = "
                         f"{config.num_hidden_layers}): there are no experts to rebalance")
    num_slots = config.n_routed_experts + model.plan.num_redundant_experts
    placement = eplb_placement(load, config, num_slots, model.plan.expert_ranks, num_nodes)
    model.state = rebalanced_state(model.state, config, placement[0])
    return placement
