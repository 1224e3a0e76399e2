"""Hugging Face / DeepSeek checkpoint -> the model's parameter tree, placed straight onto its shardings.

Tensors are memory-mapped and read one at a time by ``jax.make_array_from_callback``: every device shard reads
only its own slice (for stacked experts: only its experts), so a 671B checkpoint never sits in host RAM whole.
FP8 weights (``F8_E4M3`` + ``weight_scale_inv``) are either kept with their scales (``quantized=True``) or
dequantized exactly (fp8 * scale_inv per 128x128 block; docs/architecture.md "Reference semantics") on the device,
after their bytes are placed. Whole tensors are read with positioned reads into page-aligned host arrays that
XLA:CPU keeps as device buffers (one copy from the page cache; stacked experts straight into their slots).

Names follow DeepSeek's release: ``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, MTP module k at ``model.layers.{num_hidden_layers + k}``
with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the block's own tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable

import jax
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.fp8 import dequantize_blockwise_jnp, scale_shape
from jaxinfer.checkpoint.safetensors_io import SafetensorsCheckpoint, StagingBuffers, host_array
from jaxinfer.checkpoint.tree import flatten_tree, unflatten_tree
from jaxinfer.config import ModelConfig
from jaxinfer.parallel.placement import identity_phy2log, placement_values

FP8_NP = np.dtype("float8_e4m3fn")
_FLOAT_KINDS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype("bfloat16"), np.dtype(np.float64)}
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one parameter comes from: a tensor name, or per-expert names stacked on axis 0."""

    names: tuple[str, ...]
    stacked: bool = False
    scale_names: tuple[str, ...] | None = None  # FP8 sibling scales to dequantize with


def checkpoint_layout(config: ModelConfig, ckpt: SafetensorsCheckpoint) -> dict[str, Any]:
    """Reads how the model must be built for this checkpoint: MTP presence and which weights are FP8."""
    n = config.num_hidden_layers
    mtp_layers = 0
    for k in range(config.num_nextn_predict_layers):
        if f"model.layers.{n + k}.eh_proj.weight" in ckpt:
            mtp_layers += 1
        else:
            break
    return dict(
        num_mtp_layers=mtp_layers,
        mtp_eh_proj_quantized=mtp_layers > 0 and f"model.layers.{n}.eh_proj.weight_scale_inv" in ckpt,
        has_fp8=any(name.endswith("weight_scale_inv") for name in ckpt.names()),
    )


def _module_prefix(config: ModelConfig, path: tuple) -> tuple[str, tuple]:
    """Model path -> (HF module prefix, remaining path inside that module)."""
    top = path[0]
    if top == "layers":
        return f"model.layers.{path[1]}", path[2:]
    if top == "mtp":
        prefix = f"model.layers.{config.num_hidden_layers + path[1]}"
        rest = path[2:]
        if rest[0] == "block":
            return prefix, rest[1:]
        if rest[0] == "shared_head_norm":
            return prefix + ".shared_head.norm", rest[1:]
        return prefix, rest
    if top == "embed_tokens":
        return "model", ("embed_tokens", "weight")
    if top == "norm":
        return "model.norm", path[1:]
    if top == "lm_head":
        return "lm_head", path[1:]
    raise KeyError(path)


def source_for(config: ModelConfig, path: tuple, ckpt_names: set[str] | SafetensorsCheckpoint,
               num_slots: int | None = None) -> Source:
    """The checkpoint tensor(s) for one model parameter path (e.g. ('layers', 3, 'mlp', 'experts', 'up_proj'));
    stacked experts have num_slots physical slots (default: n_routed_experts)."""
    prefix, rest = _module_prefix(config, path)
    rest = tuple(str(p) for p in rest)
    if len(rest) >= 2 and rest[-2] == "experts":  # ('mlp', 'experts', 'gate_proj' | 'gate_proj_scale_inv')
        proj = rest[-1].removesuffix("_scale_inv")
        suffix = "weight_scale_inv" if rest[-1].endswith("_scale_inv") else "weight"
        base = f"{prefix}.{'.'.join(rest[:-1])}"
        # physical slot s holds expert phy2log[s]; checkpoints are loaded in the identity placement (s mod E)
        num_slots = num_slots or config.n_routed_experts
        names = tuple(f"{base}.{e}.{proj}.{suffix}" for e in identity_phy2log(config.n_routed_experts, num_slots))
        scales = None
        if suffix == "weight" and all(f"{nm}_scale_inv" in ckpt_names for nm in names):
            scales = tuple(f"{nm}_scale_inv" for nm in names)
        return Source(names, stacked=True, scale_names=scales)
    name = f"{prefix}.{'.'.join(rest)}"
    scale = f"{name}_scale_inv"
    if rest[-1] == "weight" and scale in ckpt_names:
        return Source((name,), scale_names=(scale,))
    return Source((name,))


def ignorable(config: ModelConfig, name: str, num_mtp_layers: int) -> bool:
    """Tensors a checkpoint may carry that the model does not read."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= config.num_hidden_layers:
        k = int(m.group(1)) - config.num_hidden_layers
        if k >= num_mtp_layers:
            return True  # MTP modules we do not load (absent from the config, or disabled)
        # DeepSeek's releases carry copies of the embedding and the head in each MTP layer
        return name.endswith((".embed_tokens.weight", ".shared_head.head.weight"))
    return False


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if array.dtype == dtype:
        return np.asarray(array)
    if array.dtype == FP8_NP or dtype == FP8_NP:
        return np.asarray(array.astype(np.float32).astype(dtype))
    return np.asarray(array.astype(dtype))


def _sliced_shape(shape: tuple, index: tuple) -> tuple:
    """The shape of ``array[index]`` for an array of ``shape`` (index: slices and ints, as make_array_from_callback
    passes them)."""
    return tuple(len(range(*i.indices(n))) if isinstance(i, slice) else 1 for i, n in zip(index, shape)) + tuple(
        shape[len(index):])


def _reader(ckpt: SafetensorsCheckpoint, src: Source, dtype: np.dtype, pool: Executor | None = None,
            alloc: Callable[[tuple, np.dtype], np.ndarray] = host_array) -> Callable[[tuple], np.ndarray]:
    """A callback for make_array_from_callback: reads just the requested slice, cast to ``dtype`` (an FP8 source
    read as FP8 stays raw: ``load_hf_params`` dequantizes on the device).

    A whole tensor in its own dtype (the bulk of a checkpoint) is read with positioned reads into a page-aligned
    host array (``host_array``: XLA:CPU keeps it as the device buffer, no second copy); stacked experts are read
    straight into their slots of one such array. ``pool``: threads for the reads (pieces of a tensor, or experts);
    ``alloc(shape, dtype)``: those host arrays (``StagingBuffers.take`` for bytes that only pass through)."""

    def one(name: str, index: tuple, out: np.ndarray | None = None, pieces: Executor | None = None) -> np.ndarray:
        info = ckpt.info(name)
        if info.dtype == dtype and _sliced_shape(info.shape, index) == info.shape:
            out = alloc(info.shape, dtype) if out is None else out
            ckpt.read_into(name, out, pieces)
            return out
        value = _cast(ckpt.read(name)[index], dtype)
        if out is None:
            return value
        out[...] = value
        return out

    done: dict[str, np.ndarray] = {}  # replicated shards ask for the same slice once per device

    def read(index: tuple) -> np.ndarray:
        key = repr(index)
        if key not in done:
            if not src.stacked:
                done[key] = one(src.names[0], index, pieces=pool)
            else:
                experts = range(len(src.names))[index[0]]
                shape = _sliced_shape(ckpt.info(src.names[0]).shape, index[1:])
                out = alloc((len(experts), *shape), dtype)
                reads = [(src.names[e], index[1:], out[k]) for k, e in enumerate(experts)]
                if pool is None:
                    for args in reads:
                        one(*args)
                else:  # one expert per task, read in one piece (a task never waits on the pool)
                    for task in [pool.submit(one, *args) for args in reads]:
                        task.result()
                done[key] = out
        return done[key]

    return read


READ_THREADS = 8  # at most, for a checkpoint's reads (the first touches of fresh memory scale with cores)

# FP8 weights loaded in a float dtype: e4m3 bytes and scales placed, then one elementwise program per shape (XLA
# fuses the decode, the per-block product and the final cast; ~1.5 G elements/s on 2 CPU cores against ~0.1 for
# numpy's, docs/benchmarks.md "Checkpoint loading"). Elementwise, so the result has the weight's sharding.
_dequantize = jax.jit(functools.partial(dequantize_blockwise_jnp, lookup=True), static_argnames=("block", "dtype"))


def _check(ckpt: SafetensorsCheckpoint, src: Source, shape: tuple, dtype: np.dtype, problems: dict) -> None:
    want = shape[1:] if src.stacked else shape
    for i, name in enumerate(src.names):
        if name not in ckpt:
            problems["missing"].append(name)
            continue
        info = ckpt.info(name)
        if info.shape != tuple(want):
            problems["wrong shape"].append(f"{name}: {list(info.shape)} (expected {list(want)})")
            continue
        if dtype == FP8_NP or info.dtype == FP8_NP:
            if dtype == FP8_NP and info.dtype != FP8_NP:
                problems["wrong dtype"].append(f"{name}: {info.dtype} (expected F8_E4M3 with weight_scale_inv)")
            elif dtype != FP8_NP and not src.scale_names:
                problems["wrong dtype"].append(f"{name}: F8_E4M3 without a weight_scale_inv sibling")
            elif src.scale_names:
                scale = ckpt.info(src.scale_names[i])
                want_scale = scale_shape(tuple(want))
                if scale.shape != want_scale:
                    problems["wrong shape"].append(
                        f"{src.scale_names[i]}: {list(scale.shape)} (expected {list(want_scale)})")
        elif info.dtype not in _FLOAT_KINDS and np.dtype(dtype) in _FLOAT_KINDS | {np.dtype("bfloat16")}:
            problems["wrong dtype"].append(f"{name}: {info.dtype} (expected a float tensor)")


def load_hf_params(config: ModelConfig, ckpt: SafetensorsCheckpoint, abstract: dict,
                   sharding_for: Callable[[tuple, tuple], jax.sharding.Sharding], num_mtp_layers: int) -> dict:
    """Fills the abstract parameter tree (pure dict of ShapeDtypeStruct) from the checkpoint.

    sharding_for(path, shape) gives each parameter's target sharding. All problems (missing, unexpected,
    wrong-shape, wrong-dtype tensors) are collected and raised together as one CheckpointError."""
    names = set(ckpt.names())
    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "wrong shape": [], "wrong dtype": []}
    plan = []
    used: set[str] = set()
    flat = flatten_tree(abstract)
    placements = placement_values(config, dict(flat))  # not in checkpoints: the identity placement
    for path, leaf in flat:
        if path in placements:
            continue
        src = source_for(config, path, names, num_slots=leaf.shape[0] if leaf.shape else None)
        used.update(src.names)
        used.update(src.scale_names or ())
        dtype = np.dtype(leaf.dtype)
        _check(ckpt, src, tuple(leaf.shape), dtype, problems)
        plan.append((path, leaf, src, dtype))
    # A tensor with no elements holds nothing to read: transformers saves the width-0 shared MLP that
    # n_shared_experts 0 gives (and loads it back), where DeepSeek's own checkpoints have none.
    problems["unexpected"] = sorted(n for n in names - used if not ignorable(config, n, num_mtp_layers)
                                    and math.prod(ckpt.info(n).shape) > 0)
    if any(problems.values()):
        lines = [f"checkpoint {ckpt.path} does not match the model config:"]
        for kind, items in problems.items():
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {kind} ({len(items)}): " + ", ".join(shown))
        raise CheckpointError("\n".join(lines))
    out = [(path, jax.make_array_from_callback(value.shape, sharding_for(path, value.shape),
                                               lambda index, v=value: v[index])) for path, value in placements.items()]
    pending = None  # the last dequantization dispatched: one in flight, so FP8 bytes of at most two tensors live
    staging = StagingBuffers()  # those FP8 bytes: read into pages touched before, not fresh ones
    fp8_bytes = [math.prod(leaf.shape) if src.scale_names and dtype != FP8_NP else 0 for _, leaf, src, dtype in plan]
    # What staging may still serve after tensor i: the two largest FP8 tensors to come, as two buffers rotate (one
    # read by the product in flight while the next tensor is read into the other). Keeping only the largest left
    # one large tensor per layer to read into fresh pages (gate after down: the other buffer still in flight).
    keep_after, top2 = [0] * len(plan), (0, 0)
    for i in range(len(plan) - 1, -1, -1):
        keep_after[i] = sum(top2)
        top2 = tuple(sorted((*top2, fp8_bytes[i]))[1:])
    with ThreadPoolExecutor(min(READ_THREADS, os.cpu_count() or 1)) as pool:
        for i, (path, leaf, src, dtype) in enumerate(plan):
            shape = tuple(leaf.shape)
            sharding = sharding_for(path, shape)
            if src.scale_names and dtype != FP8_NP:  # dequantized on the device (see _dequantize)
                weight = jax.make_array_from_callback(shape, sharding, _reader(ckpt, src, FP8_NP, pool, staging.take))
                scale = jax.make_array_from_callback(scale_shape(shape), sharding,
                                                     _reader(ckpt, Source(src.scale_names, src.stacked), np.float32))
                if pending is not None:  # read while the previous product was computed; now that one is done
                    pending.block_until_ready()
                staging.release(keep=keep_after[i])  # the FP8 bytes of the product before (arrays deleted below)
                value = pending = _dequantize(weight, scale, dtype=dtype)
                del weight, scale  # their host buffers go as soon as the product is computed
            else:
                value = jax.make_array_from_callback(shape, sharding, _reader(ckpt, src, dtype, pool))
            out.append((path, value))
    return unflatten_tree(out)
