"""Verification of draft tokens on device: greedy prefix acceptance, and exact rejection sampling (Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1; vLLM v1's ``RejectionSampler``).

One verification step scores T columns per row (engine/step_program.py): the row's real columns are its last
``n`` (first = T - n); column ``first`` holds its last known token and columns first + 1 .. T - 1 its drafts
x_1 .. x_{n-1}. The logits of column c give the target distribution p_c of the token after it, so draft
x = ids[c + 1] is judged by p_c.

Target distributions are the sampler's processed ones (engine/sampler.py, vLLM's order): a structured-output
row's grammar mask for column c (the tokens allowed after its outputs and the drafts before column c + 1;
engine/structured_output.py), penalties (at column c they count the row's outputs plus the drafts before column
c + 1, as if those were already output), then temperature, min-p, top-k and top-p. A draft the grammar rejects has
p_c(x) = 0: it is rejected, and the token drawn in its place is one the grammar allows. Drafts are the MTP
module's argmax (engine/drafter.py), a draft distribution q that is a point mass on x (vLLM's EAGLE and MTP
proposers pass no draft probabilities either):
  greedy row: accept while x == argmax p_c; the token after the accepted run is argmax p at its column.
  random row: accept x with probability min(1, p_c(x) / q(x)) = p_c(x); at the first rejection the token is
    drawn from the residual max(p_c - q, 0) normalised, i.e. p_c without x; after all drafts are accepted, the
    bonus token is drawn from p at the last column. Each output token is then distributed exactly as p.
Randomness (sampler.py's per-request keys): output index o of a row (its outputs before the token) uses
fold_in(fold_in(key(s), o), ACCEPT) for the acceptance uniform and fold_in(fold_in(key(s), o), RECOVER) for the
recovered or bonus token, so a seeded request draws the same tokens for the same drafts, whatever its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.engine.sampler import (_IMPL, SamplingTensors, apply_penalties, filter_logits, first_argmax,
                                     unpack_allowed)

ACCEPT, RECOVER = 1, 2  # fold-ins of an output index's key (DRAFT = 0 is kept for sampled drafts)


@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """Result of ``verify`` (a pytree). Column c of a row is the token after column c's position.

    token_ids: int32 [R, T]: columns first .. first + num_accepted hold the row's new tokens (the accepted drafts,
      then the recovered or bonus token); other columns are meaningless.
    num_accepted: int32 [R] drafts accepted (0 .. n - 1).
    logprobs, ranks: float32 / int32 [R, T], top_ids / top_logprobs [R, T, N]: the target's raw logprobs of each
      column's token (sampler.SampleOutput's fields per column), or None without logprobs.
    """

    token_ids: jax.Array
    num_accepted: jax.Array
    logprobs: jax.Array | None = None
    ranks: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


jax.tree_util.register_dataclass(VerifyOutput, data_fields=[f.name for f in dataclasses.fields(VerifyOutput)],
                                 meta_fields=[])


def _key(key_data: jax.Array, index: jax.Array, purpose: int) -> jax.Array:
    """One row's key for output index ``index`` and a purpose: fold_in(fold_in(key(s), index), purpose)."""
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=_IMPL), index)
    return jax.random.fold_in(key, purpose)


def _column_counts(tensors: SamplingTensors, ids: jax.Array, first: jax.Array) -> jax.Array:
    """int32 [R, T, V]: each column's penalty counts, the row's outputs plus its drafts up to that column."""
    _, t = ids.shape
    v = tensors.output_counts.shape[1]
    cols = jnp.arange(t)
    is_draft = (cols[None, :] > first[:, None])  # [R, T]: ids[:, c] is a draft
    onehot = jax.nn.one_hot(ids, v, dtype=jnp.int32) * is_draft[..., None]  # [R, T, V]
    # column c counts drafts at columns <= c (the tokens output before the token column c decides).
    before = jnp.cumsum(onehot, axis=1)  # [R, T, V]
    return tensors.output_counts[:, None, :] + before


def verify(logits: jax.Array, ids: jax.Array, first: jax.Array, tensors: SamplingTensors) -> VerifyOutput:
    """Accepts a prefix of each row's drafts and picks the token after it (the module doc).

    logits: float [R, T, V] target logits of every column; ids: int32 [R, T] the step's input tokens; first: int32
    [R] each row's first real column (its drafts: columns first + 1 .. T - 1; first = T - 1: no draft; padding
    rows are greedy and ignored); tensors: SamplingTensors of R rows, ``steps`` = the row's outputs before the
    token of column ``first``.
    """
    logits = logits.astype(jnp.float32)
    r, t, v = logits.shape
    first = jnp.minimum(first, t - 1)  # a padding row (no real column) is read as a row without drafts
    cols = jnp.arange(t)
    drafts = jnp.concatenate([ids[:, 1:], jnp.zeros((r, 1), ids.dtype)], axis=1)  # [R, T]: x judged by column c
    is_draft = (cols[None, :] >= first[:, None]) & (cols[None, :] < t - 1)  # [R, T]
    index = tensors.steps[:, None] + cols[None, :] - first[:, None]  # [R, T] output index each column decides

    def per_column(x):  # [R, ...] -> [R * T, ...]
        return jnp.repeat(x, t, axis=0)

    flat = jax.tree.map(per_column, dataclasses.replace(tensors, output_counts=None, prompt_mask=None, allowed=None))
    if tensors.output_counts is not None:
        counts = _column_counts(tensors, ids, first).reshape(r * t, v)
        flat = dataclasses.replace(flat, output_counts=counts, prompt_mask=per_column(tensors.prompt_mask))
    raw = logits.reshape(r * t, v)
    if tensors.allowed is not None:  # [R, T x W]: each column's grammar mask (structured output), as the sampler
        raw = jnp.where(unpack_allowed(tensors.allowed.reshape(r * t, -1), v), raw, -jnp.inf)
    processed = apply_penalties(raw, flat)  # [R * T, V]
    greedy_ids = first_argmax(processed).reshape(r, t)
    greedy_ok = greedy_ids == drafts  # [R, T]

    def random_path(processed):
        scaled = processed / flat.temperature[:, None]
        scaled = filter_logits(scaled, flat)
        logp = jax.nn.log_softmax(scaled, axis=-1).reshape(r, t, v)  # [R, T, V] processed target log-probs
        p_x = jnp.exp(jnp.take_along_axis(logp, drafts[..., None], axis=-1)[..., 0])  # [R, T]
        def uniform(key_data, i):
            return jax.random.uniform(_key(key_data, i, ACCEPT), (), jnp.float32)

        u = jax.vmap(jax.vmap(uniform, in_axes=(None, 0)))(tensors.key_data, index)  # [R, T]
        return logp, u < p_x

    logp, random_ok = jax.lax.cond(
        jnp.all(tensors.greedy), lambda x: (jnp.zeros((r, t, v), jnp.float32), jnp.zeros((r, t), bool)),
        random_path, processed)
    ok = jnp.where(tensors.greedy[:, None], greedy_ok, random_ok) & is_draft  # [R, T]
    run = jnp.cumprod(jnp.where(cols[None, :] < first[:, None], True, ok), axis=1)  # leading accepted columns
    num_accepted = (jnp.sum(run, axis=1) - first).astype(jnp.int32)  # [R]
    last = first + num_accepted  # [R]: the column whose token ends the run

    def pick(x):  # [R, T, ...] -> [R, ...] at column ``last``
        return jnp.take_along_axis(x, last.reshape(r, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]

    greedy_last = pick(greedy_ids)  # [R]

    def random_last(logp):
        lp = pick(logp)  # [R, V]
        rejected = last < t - 1  # stopped at a draft: it is excluded (the residual of a point mass)
        lp = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == pick(drafts)[:, None]), -jnp.inf, lp)
        def gumbel(key_data, i):
            return jax.random.gumbel(_key(key_data, i, RECOVER), (v,), jnp.float32)

        noise = jax.vmap(gumbel)(tensors.key_data, pick(index))  # [R, V]
        return first_argmax(lp + noise)

    sampled_last = jax.lax.cond(jnp.all(tensors.greedy), lambda _: greedy_last, random_last, logp)
    final = jnp.where(tensors.greedy, greedy_last, sampled_last)  # [R]
    token_ids = jnp.where(cols[None, :] < last[:, None], drafts, final[:, None]).astype(jnp.int32)  # [R, T]
    if tensors.max_logprobs is None:
        return VerifyOutput(token_ids, num_accepted)
    raw_logprobs = jax.nn.log_softmax(raw, axis=-1)  # [R * T, V]
    chosen = jnp.take_along_axis(raw_logprobs, token_ids.reshape(-1, 1), axis=-1)  # [R * T, 1]
    ranks = jnp.sum(raw_logprobs >= chosen, axis=-1).astype(jnp.int32)
    if tensors.max_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, tensors.max_logprobs)  # [R * T, N]
    else:
        top_lp, top_ids = jnp.zeros((r * t, 0), jnp.float32), jnp.zeros((r * t, 0), jnp.int32)
    n = top_lp.shape[1]
    return VerifyOutput(token_ids, num_accepted, chosen.reshape(r, t), ranks.reshape(r, t),
                        top_ids.astype(jnp.int32).reshape(r, t, n), top_lp.reshape(r, t, n))
