"""The LM head and the sampler on each row's last hidden state, with the greedy head screen (models/screened_head.py).

Greedy decode steps of one row per DP rank, with no penalties and no logprobs, take the head's argmax through its
int8 screen: the same tokens from a quarter of a float32 head's bytes (the matrix-vector regime, where the head's
bytes are the cost); the full logits whenever the screen cannot prove its answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.engine.sampler import SampleOutput, SamplingTensors, sample
from jaxinfer.models.layers import local_rows
from jaxinfer.models.screened_head import HeadScreen, screened_argmax


def head_sample(model, h: jax.Array, tensors: SamplingTensors, screen: HeadScreen | None) -> SampleOutput:
    """The head on each row's last hidden state h [R, D] and the sampler (screen: the head's int8 screen, or None
    for the full logits always)."""
    def full(_=None):
        return sample(model.head(h[:, None])[:, 0], tensors)  # [R, V] logits -> [R]

    if (screen is None or tensors.max_logprobs is not None or tensors.output_counts is not None
            or tensors.allowed is not None or local_rows(h.shape[0], model.row_shards) != 1):
        return full()

    def greedy(_):
        ids, proven = screened_argmax(h.astype(model.dtype), model.head_weight(), screen, model.row_shards)
        return jax.lax.cond(proven, lambda _: ids, lambda _: full().token_ids, None)

    return SampleOutput(token_ids=jax.lax.cond(jnp.all(tensors.greedy), greedy, lambda _: full().token_ids, None))
