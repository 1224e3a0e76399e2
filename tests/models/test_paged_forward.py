"""The model over the paged latent cache (chunked prefill, then decode; on the XLA backend the first chunk in the
expanded MLA form, the rest absorbed) gives the logits of the plain full-sequence forward (the expanded form checked
against transformers in test_parity_hf.py), with either attention backend (the cache written inside the step and
read by mla_decode; or only read, the latents written after it), on one device and with every device a DP rank
holding its own pages, for a V3 and a V2 (no q_lora) configuration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import jaxinfer
from hlo_buffers import materialized_shapes
from jaxinfer.kv.paged_cache import cache_sharding, init_paged_cache
from jaxinfer.models import mla
from jaxinfer.models.attention import BACKENDS, AttentionMetadata, write_latents
from jaxinfer.parallel.dispatch import BATCH_AXES

PAGES_PER_RANK, LENGTH, PS = 4, 70, 64  # 70 tokens: a full page and a partial one
CONFIGS = {
    "v3": jaxinfer.ModelConfig.tiny(num_nextn_predict_layers=0),
    "v2-no-qlora": jaxinfer.ModelConfig.tiny(model_type="deepseek_v2", q_lora_rank=None, scoring_func="softmax",
                                             topk_method="group_limited_greedy", num_attention_heads=5,
                                             v_head_dim=24, first_k_dense_replace=0, num_nextn_predict_layers=0),
}


def paged_step(model, backend):
    """One engine step's model part, jitted: (state, layers, ids, metadata) -> (logits, layers written)."""
    graphdef, attention = model.graphdef, BACKENDS[backend]

    @jax.jit
    def step(state, layers, ids, md):
        m = nnx.merge(graphdef, state)
        h, out, _ = m.paged_hidden_states(ids, layers, md, attention)
        if not attention.writes_in_step:  # the XLA backend: the engine writes the latents after the step
            out = tuple(write_latents(model.mesh, c, new, md.slots) for c, new in zip(layers, out))
        return m.head(h), out

    return step


@pytest.mark.parametrize("mesh,name,backend,slice_rows", [
    ("1x1", "v3", "xla", None), ("2x4", "v3", "xla", None), ("2x4", "v3", "pallas", None),
    ("1x1", "v2-no-qlora", "pallas", None),
    ("1x1", "v3", "xla", 1),  # the absorbed products on W_UK / W_UV sliced out of kv_b_proj at every absorbed step
])
def test_chunked_prefill_and_decode_match_full_forward(mesh, name, backend, slice_rows, monkeypatch):
    if slice_rows is not None:
        monkeypatch.setattr(mla, "SLICE_ROWS", slice_rows)
    config = CONFIGS[name]
    model = jaxinfer.Model.random(config, mesh=mesh, dtype="float32", seed=2)
    batch = model.dp_size  # one sequence per DP rank
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, LENGTH)).astype(np.int32)
    full = model.logits(ids)  # [B, L, V]

    cache = init_paged_cache(config, PAGES_PER_RANK, jnp.float32, mesh=model.mesh)
    # Unwritten slots hold NaN (each rank's page 0, the null page, stays zero): results must not depend on them.
    cache = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan).at[::PAGES_PER_RANK].set(0.0), cache)
    block_table = np.tile(np.array([[1, 2]], np.int32), (batch, 1))  # rank-local page ids
    spec = NamedSharding(model.mesh, jax.sharding.PartitionSpec(BATCH_AXES))
    step = paged_step(model, backend)
    layers = cache.layers
    got = []
    for start, stop in [(0, 40), (40, 67), (67, 68), (68, 69), (69, 70)]:  # two prefill chunks, three decodes
        positions = np.tile(np.arange(start, stop, dtype=np.int32), (batch, 1))
        slots = np.take_along_axis(block_table, positions // PS, axis=1) * PS + positions % PS
        md = AttentionMetadata(*(jax.device_put(a, spec) for a in (positions, block_table,
                                                                   np.full(batch, stop, np.int32), slots)))
        logits, layers = step(model.state, layers, jax.device_put(ids[:, start:stop], spec), md)
        got.append(np.asarray(jax.device_get(logits)))
    got = np.concatenate(got, axis=1)
    assert np.isfinite(got).all()
    err = float(np.abs(got - full).max() / np.abs(full).max())
    assert err <= 1e-5, f"paged vs full forward: {err:.2e}"
    assert layers[0].sharding.is_equivalent_to(cache_sharding(model.mesh), 4)


def test_single_token_decode_reads_weights_in_place():
    """A batch-1 decode step on CPU (layers.matmul_nt's one-row form, moe's gather path) computes no array of any
    weight's shape or its transpose, nor of the concatenations that matmul_nt_many reads as one matrix: every
    weight is read where it lies, none is copied per step (a transposed copy of a weight costs a pass over its
    bytes in every step: docs/benchmarks.md "GEMM forms (CPU)"). The check sees a copy where there is one."""
    config = jaxinfer.ModelConfig.tiny(num_nextn_predict_layers=0)
    model = jaxinfer.Model.random(config, mesh="1x1", dtype="float32", seed=2)
    weights = [a for a in jax.tree.leaves(model.state) if a.ndim >= 2 and a.size >= 1024]
    c = config
    concatenated = [  # products that read several weights as one matvec (layers.matmul_nt_many)
        (2 * c.num_experts_per_tok * c.moe_intermediate_size, c.hidden_size),  # a row's routed gate/up (moe)
        (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),  # q_a and kv_a (mla)
        (2 * c.intermediate_size, c.hidden_size)]  # a dense MLP's gate and up
    dims = {tuple(a.shape) for a in weights} | {tuple(a.shape[::-1]) for a in weights}
    dims |= set(concatenated) | {d[::-1] for d in concatenated}
    weight_shapes = {f"f32[{','.join(map(str, d))}]" for d in dims}
    graphdef = model.graphdef
    cache = init_paged_cache(config, PAGES_PER_RANK, jnp.float32).layers

    def step(state, layers, ids, md):  # the engine's CPU step (step_program.py)
        m = nnx.merge(graphdef, state)
        h, latents, _ = m.paged_hidden_states(ids, layers, md, BACKENDS["xla"])
        return m.head(h), latents

    md = AttentionMetadata(np.full((1, 1), 5, np.int32), np.array([[1, 2]], np.int32), np.array([6], np.int32),
                           np.array([[5]], np.int32))
    hlo = jax.jit(step).lower(model.state, cache, np.ones((1, 1), np.int32), md).compile().as_text()
    assert not materialized_shapes(hlo) & weight_shapes
    w = weights[0]
    copying = jax.jit(lambda x, w: (x @ w.T, w.T * 2.0)).lower(jnp.zeros((1, w.shape[1])), w).compile().as_text()
    assert materialized_shapes(copying) & weight_shapes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_multi_step_decode_reads_weights_in_place(dtype):
    """The engine's multi-step decode program (step_program.py, a lax.while_loop over iterations) on the embedded
    model at batch 1 computes no array of a large weight's shape or its transpose, in the weights' dtype or float32:
    XLA's loop-invariant code motion hoists the weights' bf16 -> f32 converts and transposes out of the loop, so
    every iteration would read float32 copies (step_program.py turns that pass off)."""
    llm = jaxinfer.LLM(mesh="1x1", dtype=dtype, num_kv_pages=8, max_num_seqs=1, num_scheduler_steps=4)
    runner = llm.runner
    # The large weights (LM head, embedding, dense MLP, stacked experts): smaller ones share their shapes with
    # activations here (a [128, 256] chunk of cached keys is the shape of a [128, 256] weight).
    weights = [a for a in jax.tree.leaves(llm.model.state) if a.ndim >= 2 and a.size >= 65536]
    dims = {tuple(a.shape) for a in weights} | {tuple(a.shape[::-1]) for a in weights}
    weight_shapes = {f"{t}[{','.join(map(str, d))}]" for d in dims for t in ("f32", "bf16")}
    captured, run = [], runner._run
    runner._run = lambda packed, layout, *blocks: (captured.append((packed, layout)), run(packed, layout, *blocks))[1]
    llm.generate([[1, 2, 3]], jaxinfer.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    del runner._run
    packed, layout = next(c for c in captured if layout_iterations(c[1]) == 4)
    hlo = runner.program.step.lower(runner._state_leaves[0], runner.layers, runner.tokens, runner.load.total,
                                    runner.load.total, packed, layout, runner.head_screen).compile().as_text()
    assert "while" in hlo
    assert not materialized_shapes(hlo) & weight_shapes


def layout_iterations(layout) -> int:
    """Decode iterations of a captured step: the width of its slots column (packing.Layout; inputs.InputBatch)."""
    return layout.columns[5][2][0]
