"""MTP drafting on device (speculative decoding): the checkpoint's MTP module over the step's positions, then
chained K - 1 times on its own output, as SGLang's NEXTN and vLLM's deepseek_mtp proposer do with DeepSeek-V3's one
MTP layer.

Row layout (engine/inputs.py): a row's real columns are its last n of T; column c's MTP input is the main model's
final-normed hidden state h_c and the token after column c (``next_ids``), and the MTP module's latent for
column c goes into its own paged cache at the main model's slot for that position, so the module attends over
every earlier position of the sequence like a decoder layer. The anchor column (per row: the last column of a
prefill chunk; the last accepted column of a verification) gives draft 1 = argmax of the module's logits (a point
mass draft distribution: engine/rejection_sampler.py). Draft j + 1 is proposed at position anchor + j from the
module's output at the previous position and draft j.

The MTP cache is only read inside the step (the XLA backend's contract, models/attention.py): the latents of the
step's columns and of the chain live in a per-row ``DecodeWindow`` that starts at the row's first real column (or,
in a program of several rounds, at its first round's: the window then also holds the earlier rounds' latents),
and the engine writes the step's column latents after the step (the chain's are never written: the next round
recomputes those positions from the accepted tokens).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.engine.sampler import first_argmax
from jaxinfer.models.attention import AttentionMetadata
from kernels_pallas.mla import DecodeWindow


@dataclasses.dataclass(frozen=True)
class Drafts:
    """token_ids int32 [R, K]: the proposed drafts; probs float32 [R, K]: the MTP module's probability of each
    (DSpark's confidence, engine/speculative.py)."""

    token_ids: jax.Array
    probs: jax.Array


jax.tree_util.register_dataclass(Drafts, data_fields=["token_ids", "probs"], meta_fields=[])


def _argmax_and_prob(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [R, V] -> (argmax int32 [R], its softmax probability float32 [R])."""
    ids = first_argmax(logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return ids, jnp.exp(jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0])


def propose(model, h: jax.Array, next_ids: jax.Array, cache: jax.Array, md: AttentionMetadata, anchor: jax.Array,
            num_drafts: int, window: DecodeWindow | None = None) -> tuple[Drafts, jax.Array, jax.Array]:
    """Drafts for every row and the MTP latents of the step's columns.

    h [R, T, D]: the main model's final-normed hidden states; next_ids int32 [R, T]: the token after each column
    (meaningful up to the anchor); cache: the MTP module's paged latent cache [pages, 64, 1, C+R]; md: the main
    model's metadata of the step (right-aligned rows; slot -1 = padding); anchor int32 [R]: the column whose
    MTP output proposes draft 1; num_drafts: K; window: None, or the MTP latents of a multi-round program's
    earlier rounds (step_program.py ``verify_rounds``: latents [R, W, C+R] of positions start .., ``length`` of
    them before this round's first column; W covers this round's columns and the chain). Returns (Drafts [R, K],
    latents [R, T, C+R] to write at md.slots, the window with this round's real columns and the chain's positions
    written: a new one, from the row's first real column, when ``window`` is None).
    """
    r, t = next_ids.shape
    real = md.slots >= 0  # [R, T]
    live = jnp.any(real, axis=1)  # [R]: padding rows have no real column
    first = jnp.where(live, t - jnp.sum(real, axis=1), t - 1)  # [R]
    g, latents = model.paged_mtp(h, next_ids, cache, md, window=window)  # [R, T, D], [R, T, C+R]

    def at(x, col):  # [R, T, ...] -> [R, ...]
        return jnp.take_along_axis(x, col.reshape(r, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]

    token, prob = _argmax_and_prob(model.mtp_head(at(g, anchor)[:, None])[:, 0])
    # The window: the row's latents from its first real column on (or from the program's start), then the
    # chain's (written as it goes).
    if window is None:
        start = at(md.positions, first)  # [R] position of the row's first real column
        buf = jnp.zeros((r, t + num_drafts - 1, latents.shape[-1]), latents.dtype)
    else:
        start, buf = window.start, window.latents
    rows = jnp.arange(r)
    idx = jnp.where(real, md.positions - start[:, None], buf.shape[1])  # [R, T]: out of range for padding
    buf = buf.at[rows[:, None], idx].set(latents.astype(buf.dtype), mode="drop")
    if num_drafts == 1:
        return Drafts(token[:, None], prob[:, None]), latents, buf
    anchor_pos = at(md.positions, anchor)  # [R]

    def link(carry, j):  # draft j + 1 at position anchor + j (j = 1 .. K - 1)
        g_prev, token, buf = carry
        pos = anchor_pos + j  # [R]
        offset = pos - start  # [R]: the position's index in the window
        step_md = AttentionMetadata(positions=pos[:, None], block_table=md.block_table,
                                    seqlens=jnp.where(live, pos + 1, 0),
                                    slots=jnp.where(live, 0, -1)[:, None])  # slot >= 0 marks a real query
        g_new, lat = model.paged_mtp(g_prev[:, None], token[:, None], cache, step_md,
                                     window=DecodeWindow(buf, start, offset))
        buf = buf.at[rows, offset].set(lat[:, 0].astype(buf.dtype), mode="drop")
        token, prob = _argmax_and_prob(model.mtp_head(g_new)[:, 0])
        return (g_new[:, 0], token, buf), (token, prob)

    carry = (at(g, anchor), token, buf)
    (_, _, buf), (tokens, probs) = jax.lax.scan(link, carry, jnp.arange(1, num_drafts, dtype=jnp.int32))  # [K-1, R]
    return (Drafts(jnp.concatenate([token[:, None], tokens.T], axis=1),
                   jnp.concatenate([prob[:, None], probs.T], axis=1)), latents, buf)
