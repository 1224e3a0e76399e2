"""Rotary position embedding for MLA's rope part, with YaRN (as in HF ``_compute_yarn_parameters``).

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (HF ``rope_interleave=True``); like HF's
``apply_rotary_pos_emb_interleave`` the result is written de-interleaved ([rotated evens | rotated odds]). Queries
and keys use the same layout, so dot products equal those of the interleaved form; the latent cache stores
k_pe in this layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, yarn_get_mscale


def inv_freq_and_scale(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [R/2] (float32, computed as HF does) and the cos/sin scale (YaRN attention_factor)."""
    r, dim = config.rope, config.qk_rope_head_dim
    pos_freqs = np.float32(r.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if r.rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    # YaRN (arXiv:2309.00071) with HF's defaults: beta_fast 32, beta_slow 1, truncate True.
    attention_factor = r.attention_factor
    if attention_factor is None:
        if r.mscale and r.mscale_all_dim:
            attention_factor = yarn_get_mscale(r.factor, r.mscale) / yarn_get_mscale(r.factor, r.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(r.factor)

    def correction_dim(num_rotations):
        return (dim * math.log(r.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(r.factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, R/2] in float32 for integer positions [B, T]."""
    inv_freq, scale = inv_freq_and_scale(config)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, R/2]
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool = True) -> jax.Array:
    """Rotates x [B, T, (H,) R] by cos/sin [B, T, R/2]; returns [rot(x1) | rot(x2)] in x's dtype."""
    if x.ndim == cos.ndim + 1:  # per-head input: broadcast over heads
        cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
