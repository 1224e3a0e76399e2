"""MLA's two forms agree: expanded K/V (prefill) and absorbed attention over the latent cache (decode).

The expanded form is the one checked against transformers in test_parity_hf.py; here the absorbed form and the
cache path are checked against it: full-sequence logits, and prefill-then-decode token by token over the cache.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model import random_params
from jaxinfer.models.deepseek import DeepseekForCausalLM, init_cache

CONFIGS = {
    "v3-qlora-yarn": ModelConfig.tiny(),
    "v2-no-qlora": ModelConfig.tiny(model_type="deepseek_v2", q_lora_rank=None, scoring_func="softmax",
                                    topk_method="group_limited_greedy", num_attention_heads=5, v_head_dim=24,
                                    first_k_dense_replace=0, num_nextn_predict_layers=0),
}


def _model(config):
    """Random weights with non-trivial norms and router biases, so that every term of the math matters."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekForCausalLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(3)
    params = random_params(nnx.merge(graphdef, state), seed=3)
    for layer in params["layers"].values():
        for norm in ("input_layernorm", "post_attention_layernorm"):
            layer[norm]["weight"] = layer[norm]["weight"] + 0.3 * rng.standard_normal(config.hidden_size, np.float32)
        if "e_score_correction_bias" in layer["mlp"].get("gate", {}):
            layer["mlp"]["gate"]["e_score_correction_bias"] = 0.1 * rng.standard_normal(config.n_routed_experts,
                                                                                       np.float32)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def _jitted(model):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=4)
    def run(state, ids, pos, cache, form):
        return nnx.merge(graphdef, state)(ids, pos, cache, form)

    return lambda ids, pos, cache=None, form="expanded": run(state, ids, pos, cache, form)


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_absorbed_equals_expanded(name):
    config = CONFIGS[name]
    model = _jitted(_model(config))
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, config.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(9), ids.shape)
    expanded, _ = model(ids, pos, form="expanded")
    absorbed, _ = model(ids, pos, form="absorbed")
    assert _rel(absorbed, expanded) <= 1e-5


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_over_latent_cache_matches_full_forward(name):
    config = CONFIGS[name]
    model = _jitted(_model(config))
    b, t, prompt, max_len = 2, 8, 5, 12
    ids = jax.random.randint(jax.random.PRNGKey(1), (b, t), 0, config.vocab_size)
    full, _ = model(ids, jnp.broadcast_to(jnp.arange(t), ids.shape), form="expanded")
    cache = init_cache(config, b, max_len, jnp.float32)
    logits, cache = model(ids[:, :prompt], jnp.broadcast_to(jnp.arange(prompt), (b, prompt)), cache, "expanded")
    steps = [logits[:, -1]]
    for i in range(prompt, t - 1):
        logits, cache = model(ids[:, i: i + 1], jnp.full((b, 1), i), cache, "absorbed")
        steps.append(logits[:, -1])
    decoded = jnp.stack(steps, axis=1)  # logits at positions prompt-1 .. t-2
    assert _rel(decoded, full[:, prompt - 1: t - 1]) <= 1e-5
    # The cache holds exactly C + R values per token: [rms(c_kv) | roped k_pe].
    assert cache[0].shape == (b, max_len, config.kv_lora_rank + config.qk_rope_head_dim)
