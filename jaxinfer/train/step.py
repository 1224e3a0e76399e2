"""Training the project's own model (models/deepseek.py) with optax: losses, optimizer, one jitted step.

Loss (DeepSeek-V3 report, sec. 2.2, eq. 24-25): L = L_main + lambda * L_MTP with L_MTP the mean cross-entropy of
the depth-1 MTP module (token t+2 from h_t and embed(t+1)); the report uses lambda = 0.3 early in training.

Load balancing (V3 report, sec. 2.1.2, "auxiliary-loss-free"): the router's e_score_correction_bias takes no
gradient (it only moves the top-k choice); after each step, b_i += gamma * sign(mean_j load_j - load_i), with
load_i the tokens the batch routed to expert i in that layer (counted by MoE's ``expert_load`` sow under
``nnx.capture``). The report uses gamma = 0.001 over ~14.3T tokens; see recipe.py for the value used here.

Optimizer (V3 report, sec. 4.2): AdamW with beta1 0.9, beta2 0.95, weight decay 0.1 (matrices only, norms and
biases excluded), global-norm gradient clipping at 1.0; linear warmup then cosine decay.

A batch is int32 [B, T + 2] token windows: inputs x[:, :T], next tokens x[:, 1:T+1] (main targets and MTP
inputs), second-next tokens x[:, 2:] (MTP targets).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxinfer.checkpoint.tree import flatten_tree, unflatten_tree
from jaxinfer.config import ModelConfig
from jaxinfer.model import random_params
from jaxinfer.models.deepseek import DeepseekForCausalLM

BIAS = nnx.PathContains("e_score_correction_bias")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule and batch settings (defaults: the V3 report's values where it gives them)."""

    steps: int = 1000
    batch: int = 16  # B windows per step
    seq_len: int = 256  # T predicted positions per window
    peak_lr: float = 2e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1  # cosine decay ends at this fraction of peak_lr
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    mtp_lambda: float = 0.3  # weight of the MTP loss
    bias_gamma: float = 0.001  # router bias update speed
    seed: int = 0  # parameter init and batch order


def init_model(config: ModelConfig, seed: int) -> DeepseekForCausalLM:
    """A float32 single-device model (no mesh) with MTP, host-drawn N(0, 0.02) weights (model.random_params)."""
    abstract = nnx.eval_shape(lambda: DeepseekForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, random_params(abstract, seed)))
    return nnx.merge(graphdef, state)


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.peak_lr, warmup_steps=tc.warmup_steps, decay_steps=tc.steps,
        end_value=tc.peak_lr * tc.final_lr_fraction)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(schedule, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits [B, T, V] float32, targets [B, T] -> per-token negative log-likelihood [B, T] (nats)."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    return logz - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def forward(model: DeepseekForCausalLM, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [B, T+2] -> (main logits [B, T, V], MTP logits [B, T, V], next tokens [B, T], second-next [B, T])."""
    ids, nxt, nxt2 = x[:, :-2], x[:, 1:-1], x[:, 2:]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    h = model.hidden_states(ids, positions)  # [B, T, D], final-normed
    return model.head(h), model.mtp_logits(h, nxt, positions), nxt, nxt2


def losses(model: DeepseekForCausalLM, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean main and MTP cross-entropies of a batch x [B, T+2]."""
    logits, mtp_logits, nxt, nxt2 = forward(model, x)
    return cross_entropy(logits, nxt).mean(), cross_entropy(mtp_logits, nxt2).mean()


def expert_loads(captured: nnx.State) -> dict[tuple, jax.Array]:
    """The ``expert_load`` sows of a capture -> {MoE module path: int [E] tokens per logical expert}."""
    out = {}
    for path, var in nnx.to_flat_state(captured):
        if path[-1] == "expert_load":
            out[tuple(path[:-1])] = var.get_value()[0]  # sow keeps a 1-tuple
    return out


def update_bias(bias: nnx.State, loads: dict[tuple, jax.Array], gamma: float) -> nnx.State:
    """V3's auxiliary-loss-free update of the e_score_correction_bias leaves (``bias``, an nnx.State):
    b += gamma * sign(mean(load) - load), per MoE module. Returns a new State."""
    flat = []
    for path, b in flatten_tree(nnx.to_pure_dict(bias)):
        load = loads[tuple(path[:-2])].astype(jnp.float32)  # path: (..., 'mlp', 'gate', 'e_score_correction_bias')
        flat.append((path, b + gamma * jnp.sign(load.mean() - load)))
    out = jax.tree.map(lambda x: x, bias)  # a copy to fill
    nnx.replace_by_pure_dict(out, unflatten_tree(flat))
    return out


class Trainer:
    """The split model (graph, trainable params, router biases, the rest: placement tables) and optimizer state;
    ``step(x)`` runs one jitted training step."""

    def __init__(self, model: DeepseekForCausalLM, tc: TrainConfig):
        self.tc = tc
        self.graphdef, self.bias, self.params, self.rest = nnx.split(model, BIAS, nnx.Param, ...)
        self.tx = optimizer(tc)
        self.opt_state = self.tx.init(self.params)
        self._jit_step = jax.jit(self._step, donate_argnums=(0, 1, 2))

    def model(self) -> DeepseekForCausalLM:
        return nnx.merge(self.graphdef, self.bias, self.params, self.rest, copy=True)

    def _step(self, bias, params, opt_state, x):
        tc = self.tc

        def loss_fn(p):
            model = nnx.merge(self.graphdef, bias, p, self.rest)
            (main, mtp), captured = nnx.capture(losses, nnx.Intermediate)(model, x)
            return main + tc.mtp_lambda * mtp, (main, mtp, expert_loads(captured))

        grads, (main, mtp, loads) = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        bias = update_bias(bias, loads, tc.bias_gamma)
        ratios = [load.max() / jnp.maximum(load.mean(), 1) for load in loads.values()]
        metrics = {"loss": main, "mtp_loss": mtp, "grad_norm": optax.tree.norm(grads),
                   "max_load_ratio": jnp.max(jnp.stack(ratios))}  # busiest expert / mean, worst MoE layer
        return bias, params, opt_state, metrics

    def step(self, x) -> dict[str, jax.Array]:
        """One optimizer step (+ router-bias update) on a batch x int [B, T+2]; returns scalar metrics."""
        self.bias, self.params, self.opt_state, metrics = self._jit_step(self.bias, self.params, self.opt_state,
                                                                         jnp.asarray(x, jnp.int32))
        return metrics
