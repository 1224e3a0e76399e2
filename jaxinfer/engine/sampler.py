"""On-device batched sampler with vLLM v1 semantics: penalties, temperature, min-p, top-k, top-p, seeds, logprobs.

Dims: B rows (one per sequence being sampled; the engine expands n > 1 into n rows), V vocabulary, N logprobs width.

Host side: `SamplingTensors.build(params, vocab_size, ...)` packs per-row settings into numpy arrays (no JAX
ops, so building compiles nothing). Device side: `sample(logits, tensors)` is pure and jittable (static shapes,
no Python loop over rows); `advance(tensors, token_ids)` updates the penalty counts and step indices after a
step, so the engine can keep the tensors on device between decode steps and rebuild them only when the batch
changes.

Pipeline, in vLLM v1's order (vllm/v1/sample/sampler.py `Sampler.forward` / `sample`):
  raw logprobs (log-softmax of the logits as they arrive: vLLM's default `logprobs_mode="raw_logprobs"`)
  -> penalties (vllm/model_executor/layers/utils.py `apply_penalties`)
  -> greedy rows: argmax of the penalised logits (exact, no randomness)
  -> random rows: / temperature -> min-p (v1 `MinPLogitsProcessor`, on probabilities after temperature)
     -> top-k, then top-p on the renormalised top-k survivors (v1 `apply_top_k_top_p`) -> sample.
Sampling is Gumbel-max (argmax of logits + Gumbel noise), the same distribution as vLLM's exponential race
(argmax of probs / Exp(1)).

Randomness: each row's key is derived only from its own request, never from its position or its neighbours:
  row key = jax.random.fold_in(key(s), step), noise = jax.random.gumbel(row key, (V,))
  seeded row:   s = seed + child_index                      (vLLM gives parallel-sampling child i seed + i)
  unseeded row: s = the first 8 bytes (big-endian) of blake2b("{engine_seed}/{request_id}/{child_index}")
with key(s) the threefry2x32 key whose data is (s >> 32, s & 0xffffffff) (s taken mod 2**64; equal to
`jax.random.key(s, impl="threefry2x32")` for 0 <= s < 2**32) and step the number of tokens the row has generated
so far (so a preempted and recomputed request draws the same tokens again). The per-request part is derived on
the host (a hash, no JAX op) because every threefry call costs compile time on XLA:CPU (docs/benchmarks.md "Test
suite and compile times").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling_params import SamplingParams

_IMPL = "threefry2x32"  # fixed, so seeds mean the same whatever jax_default_prng_impl says


@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings as arrays (a pytree; `max_logprobs` is static).

    Fields (B rows, V vocabulary):
      temperature: float32 [B], 1.0 on greedy rows (so the division is harmless).
      greedy: bool [B], temperature < 1e-5 (vLLM `_SAMPLING_EPS`) and padding rows.
      top_k: int32 [B], in [1, V]; V when off.
      top_p: float32 [B], in (0, 1]; 1 when off.
      min_p: float32 [B], in [0, 1]; 0 when off.
      presence_penalty, frequency_penalty, repetition_penalty: float32 [B] (0, 0, 1 when off).
      output_counts: int32 [B, V] occurrences of each token among the row's generated tokens, or None when no
        row uses penalties (then penalties are skipped entirely).
      prompt_mask: bool [B, V] tokens present in the row's prompt, or None together with output_counts.
      key_data: uint32 [B, 2] the row's per-request threefry key data (module docstring).
      steps: int32 [B], tokens generated so far by the row (the fold-in for this step's key).
      num_logprobs: int32 [B], the row's requested top-N, -1 for None.
      allowed: int32 [B, ceil(V / 32)] llguidance bitmask words of each row's allowed tokens (all bits set on
        unconstrained rows; ``unpack_allowed``), or None when no row is constrained (structured output); a
        verification step's [B, T x ceil(V / 32)], one mask per column.
      max_logprobs: static int or None: the logprobs width N of the output; None = compute no logprobs.
    """

    temperature: jax.Array
    greedy: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    output_counts: jax.Array | None
    prompt_mask: jax.Array | None
    key_data: jax.Array
    steps: jax.Array
    num_logprobs: jax.Array
    allowed: jax.Array | None = None
    max_logprobs: int | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        *,
        num_rows: int | None = None,
        output_token_counts=None,
        prompt_token_mask=None,
        steps=None,
        request_ids=None,
        child_indices=None,
        engine_seed: int = 0,
        max_logprobs: int | None = None,
        allowed_token_words=None,
    ) -> SamplingTensors:
        """Packs per-row settings into numpy arrays (host only; no JAX op runs).

        Args:
          params: one SamplingParams per row (len(params) <= num_rows).
          vocab_size: V, the logits' last dimension.
          num_rows: B; rows past len(params) are padding (greedy, no penalties, no logprobs). Default len(params).
          output_token_counts: int [B, V] per-row counts of generated tokens (see `token_counts`). Required when
            any row uses a penalty; if given without penalties, penalties are still applied (as no-ops).
          prompt_token_mask: bool [B, V] per-row prompt-token presence (`token_counts(prompts, V) > 0`); given
            and required together with output_token_counts.
          steps: int [B] tokens generated so far per row (default 0): the per-step key fold-in.
          request_ids: int [B] per-request ids for unseeded rows (default 0): unique per request, so that
            unseeded requests draw different tokens.
          child_indices: int [B] index of each row's sample within its request, 0..n-1 (default 0).
          engine_seed: int, the engine-level seed of unseeded rows.
          max_logprobs: static logprobs width N (a fixed value bounds compilations); default: the largest
            requested `logprobs` in the batch, None when no row asks for logprobs.
          allowed_token_words: int32 [B, ceil(V / 32)] allowed-token bitmask words (structured output), or None;
            [B, T x ceil(V / 32)] for a verification step's T columns per row (engine/rejection_sampler.py).

        Raises:
          ValueError: bad sizes, array shapes, a row asking for more logprobs than max_logprobs, or penalties
            without the count arrays.
        """
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"{vocab_size=} must be an int >= 1")
        num_rows = len(params) if num_rows is None else num_rows
        if num_rows < max(len(params), 1):
            raise ValueError(f"{num_rows=} must be >= len(params)={len(params)} and >= 1")
        rows = list(params) + [None] * (num_rows - len(params))  # None = padding row
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] is {type(p).__name__}, expected SamplingParams")

        def col(fn, fill, dtype):
            return np.array([fill if p is None else fn(p) for p in rows], dtype=dtype)

        greedy = col(lambda p: p.greedy, True, np.bool_)
        temperature = np.where(greedy, 1.0, col(lambda p: p.temperature, 1.0, np.float64)).astype(np.float32)
        top_k = col(lambda p: vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size), vocab_size, np.int32)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        if max_logprobs is None:
            max_logprobs = max(requested) if requested else None
        elif not isinstance(max_logprobs, int) or max_logprobs < 0 or max(requested, default=0) > max_logprobs:
            raise ValueError(f"{max_logprobs=} must be an int >= 0 and >= every row's logprobs {requested}")

        any_penalty = any(p.uses_penalties for p in params)
        if (output_token_counts is None) != (prompt_token_mask is None):
            raise ValueError("output_token_counts and prompt_token_mask must be given together")
        if output_token_counts is None:
            if any_penalty:
                raise ValueError("a row uses presence/frequency/repetition penalties: pass output_token_counts "
                                 "[B, V] and prompt_token_mask [B, V]")
            counts = mask = None
        else:
            counts = _host_array("output_token_counts", output_token_counts, (num_rows, vocab_size), np.int32)
            mask = _host_array("prompt_token_mask", prompt_token_mask, (num_rows, vocab_size), np.bool_)

        children = _host_array("child_indices", child_indices, (num_rows,), np.int64, default=0)
        rids = _host_array("request_ids", request_ids, (num_rows,), np.int64, default=0)
        seeds = [p.seed + int(c) if p is not None and p.seed is not None else request_seed(engine_seed, r, c)
                 for p, r, c in zip(rows, rids, children)]
        return cls(
            temperature=temperature,
            greedy=greedy,
            top_k=top_k,
            top_p=col(lambda p: p.top_p, 1.0, np.float32),
            min_p=col(lambda p: p.min_p, 0.0, np.float32),
            presence_penalty=col(lambda p: p.presence_penalty, 0.0, np.float32),
            frequency_penalty=col(lambda p: p.frequency_penalty, 0.0, np.float32),
            repetition_penalty=col(lambda p: p.repetition_penalty, 1.0, np.float32),
            output_counts=counts,
            prompt_mask=mask,
            key_data=seeds_key_data(seeds),
            steps=_host_array("steps", steps, (num_rows,), np.int32, default=0),
            num_logprobs=col(lambda p: -1 if p.logprobs is None else p.logprobs, -1, np.int32),
            allowed=None if allowed_token_words is None else _allowed_words(allowed_token_words, num_rows,
                                                                               vocab_size),
            max_logprobs=max_logprobs,
        )


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Result of `sample` (a pytree). The logprob fields are None when `tensors.max_logprobs` is None.

    Fields:
      token_ids: int32 [B] sampled tokens.
      logprobs: float32 [B] the sampled token's logprob (raw distribution, see `sample`).
      ranks: int32 [B] the sampled token's rank, 1 = most likely (vLLM: number of tokens with logprob >= it).
      top_ids: int32 [B, N] the N most likely tokens, most likely first (ties: lower id first).
      top_logprobs: float32 [B, N] their logprobs. A row that asked for n < N uses the first n columns.
    """

    token_ids: jax.Array
    logprobs: jax.Array | None = None
    ranks: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


_TENSOR_FIELDS = [f.name for f in dataclasses.fields(SamplingTensors) if f.name != "max_logprobs"]
jax.tree_util.register_dataclass(SamplingTensors, data_fields=_TENSOR_FIELDS, meta_fields=["max_logprobs"])
jax.tree_util.register_dataclass(
    SampleOutput, data_fields=[f.name for f in dataclasses.fields(SampleOutput)], meta_fields=[])


def seed_key_data(seed: int) -> np.ndarray:
    """uint32 [2] threefry2x32 key data of an int seed: (s >> 32, s & 0xffffffff) with s = seed mod 2**64."""
    return seeds_key_data([seed])[0]


def seeds_key_data(seeds: Sequence[int]) -> np.ndarray:
    """uint32 [B, 2]: ``seed_key_data`` of each seed, in one numpy pass (the engine builds it every step)."""
    s = np.array([int(seed) % 2**64 for seed in seeds], dtype=np.uint64)  # [B]
    return np.stack([s >> np.uint64(32), s & np.uint64(0xFFFFFFFF)], axis=1).astype(np.uint32)


@functools.lru_cache(maxsize=4096)  # the same (request, child) asks again every step it samples
def request_seed(engine_seed: int, request_id: int, child_index: int = 0) -> int:
    """64-bit seed of an unseeded request: blake2b of "{engine_seed}/{request_id}/{child_index}" (host only)."""
    digest = hashlib.blake2b(f"{int(engine_seed)}/{int(request_id)}/{int(child_index)}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, num_rows: int | None = None) -> np.ndarray:
    """Host helper: int32 [B, V] occurrences of each token id in each row's list (rows past the lists: zeros).

    Use it for `output_token_counts` (generated tokens) and, with `> 0`, for `prompt_token_mask`.

    Raises:
      ValueError: a token id outside [0, vocab_size).
    """
    num_rows = len(token_ids) if num_rows is None else num_rows
    out = np.zeros((num_rows, vocab_size), np.int32)
    for i, ids in enumerate(token_ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0]
            raise ValueError(f"row {i}: token id {bad} outside [0, {vocab_size=})")
        np.add.at(out[i], ids, 1)
    return out


def _allowed_words(value, num_rows: int, vocab_size: int) -> np.ndarray:
    words = np.asarray(value)
    width = -(-vocab_size // 32)
    if words.ndim != 2 or words.shape[0] != num_rows or not words.shape[1] or words.shape[1] % width:
        raise ValueError(f"allowed_token_words has shape {words.shape}, expected ({num_rows}, a multiple of {width})")
    return words.astype(np.int32)


def _host_array(name, value, shape, dtype, default=None) -> np.ndarray:
    if value is None:
        if default is None:
            raise ValueError(f"{name} is required")
        return np.full(shape, default, dtype)
    value = np.asarray(value)
    if value.shape != shape:
        raise ValueError(f"{name} has shape {value.shape}, expected {shape}")
    return value.astype(dtype)


def apply_penalties(logits: jax.Array, tensors: SamplingTensors) -> jax.Array:
    """Presence, frequency and repetition penalties, vLLM's `apply_penalties` (model_executor/layers/utils.py).

    logits float32 [B, V] -> float32 [B, V]:
      repetition (CTRL; tokens in the prompt or the output): logit > 0 -> logit / r, else logit * r;
      then logit -= frequency * count_in_output; logit -= presence * (count_in_output > 0).
    Identity when `tensors.output_counts` is None.
    """
    if tensors.output_counts is None:
        return logits
    counts = tensors.output_counts  # [B, V]
    seen = tensors.prompt_mask | (counts > 0)  # [B, V]
    r = jnp.where(seen, tensors.repetition_penalty[:, None], 1.0)  # [B, V]
    logits = jnp.where(logits > 0, logits / r, logits * r)
    logits = logits - tensors.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - tensors.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def filter_logits(scaled: jax.Array, tensors: SamplingTensors) -> jax.Array:
    """min-p, then top-k and top-p, on temperature-scaled logits float32 [B, V]; dropped tokens become -inf.

    min-p: drop p_i < min_p * max_j p_j (vLLM v1 MinPLogitsProcessor), computed as l_i - max_j l_j < log(min_p).
    top-k and top-p: vLLM v1 `apply_top_k_top_p` on the ascending sort: drop values below the k-th largest;
    then, on the softmax of the survivors, drop sorted positions whose ascending cumulative probability is
    <= 1 - top_p (the largest is always kept). Applied here as one threshold per row (the smallest kept value),
    so tokens tied with the last kept one are kept too (vLLM's sort decides between ties arbitrarily).
    Rows with top_k = V, top_p = 1, min_p = 0 are unchanged (up to tokens of zero probability in float32).
    """
    _, v = scaled.shape
    row_max = jnp.max(scaled, axis=-1, keepdims=True)  # [B, 1]
    scaled = jnp.where(scaled - row_max < jnp.log(tensors.min_p)[:, None], -jnp.inf, scaled)
    asc = jnp.sort(scaled, axis=-1)  # [B, V] ascending
    kth = jnp.take_along_axis(asc, (v - tensors.top_k)[:, None], axis=-1)  # [B, 1] k-th largest
    asc = jnp.where(asc < kth, -jnp.inf, asc)
    cum = jnp.cumsum(jax.nn.softmax(asc, axis=-1), axis=-1)  # [B, V]
    drop = (cum <= 1.0 - tensors.top_p[:, None]).at[:, -1].set(False)
    cutoff = jnp.min(jnp.where(drop, jnp.inf, asc), axis=-1, keepdims=True)  # [B, 1] smallest kept value
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


ARGMAX_BLOCK = 128  # first_argmax's block width (V3's vocabulary, 129280, is 1010 blocks)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) of float [B, V] -> int32 [B], the same index: the first maximum, or the first NaN.

    Computed in two levels: each block of ARGMAX_BLOCK values keeps its max, the first block whose max is the
    row's max is found (jnp.argmax over V / 128 values; a block with a NaN counts as NaN, which argmax picks
    first), and then the first maximum within that block. Every earlier block's max is smaller (or the first
    maximum would be in it), so the index is argmax's. Why: XLA:CPU runs argmax over V as one scalar loop (it
    carries the value and the index); the block maxima are a vectorized reduce (docs/benchmarks.md "Engine steps
    and host overhead (CPU)")."""
    b, v = x.shape
    nb = -(-v // ARGMAX_BLOCK)
    blocks = jnp.pad(x, ((0, 0), (0, nb * ARGMAX_BLOCK - v)), constant_values=-jnp.inf)
    blocks = blocks.reshape(b, nb, ARGMAX_BLOCK)  # [B, nb, 128]; padding -inf never wins over a real value
    # XLA:CPU's max reduce may drop NaNs (fast min/max, its default); a block holding one gets NaN explicitly.
    block_max = jnp.where(jnp.any(jnp.isnan(blocks), axis=-1), jnp.nan, jnp.max(blocks, axis=-1))  # [B, nb]
    block = jnp.argmax(block_max, axis=-1)  # [B]: the first block holding a NaN, else the max
    within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, 128]
    return (block * ARGMAX_BLOCK + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def gumbel_noise(tensors: SamplingTensors, vocab_size: int) -> jax.Array:
    """float32 [B, V] Gumbel(0, 1) noise; row b uses only fold_in(key_data[b], steps[b]) (module docstring)."""

    def one(key_data, step):  # [2], [] -> [V]
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=_IMPL), step)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(one)(tensors.key_data, tensors.steps)


def unpack_allowed(words: jax.Array, vocab_size: int) -> jax.Array:
    """int32 [B, W] llguidance bitmask words -> bool [B, V]: token t allowed when bit t % 32 of word t // 32 is set
    (llguidance.numpy's order; engine/structured_output.py). Arithmetic shifts are fine: only the low bit is kept."""
    b, w = words.shape
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(b, w * 32)[:, :vocab_size].astype(jnp.bool_)  # [B, V]


def sample(logits: jax.Array, tensors: SamplingTensors, token_mask: jax.Array | None = None) -> SampleOutput:
    """Samples one token per row. Pure and jittable; compiled once per (B, V, max_logprobs, penalties on/off).

    Args:
      logits: float [B, V] next-token logits (cast to float32).
      tensors: SamplingTensors of B rows (from `SamplingTensors.build`, numpy or device arrays).
      token_mask: optional bool [B, V], False = never sample; ``tensors.allowed`` (a grammar's allowed tokens)
        is applied the same way (vLLM applies its structured-output bitmask before the sampler, so it also shows
        in the logprobs). Every row must allow at least one token.

    Returns:
      SampleOutput: token_ids int32 [B]; with max_logprobs set, the sampled token's logprob and rank and the
      top-N ids and logprobs, all from the log-softmax of the logits before penalties, temperature and
      filtering (vLLM's default `logprobs_mode="raw_logprobs"`).
    """
    logits = logits.astype(jnp.float32)  # [B, V]
    b, v = logits.shape
    if tensors.allowed is not None:
        allowed = unpack_allowed(tensors.allowed, v)  # [B, V]
        token_mask = allowed if token_mask is None else token_mask & allowed
    if token_mask is not None:
        logits = jnp.where(token_mask, logits, -jnp.inf)
    raw_logprobs = None if tensors.max_logprobs is None else jax.nn.log_softmax(logits, axis=-1)  # [B, V]

    logits = apply_penalties(logits, tensors)
    greedy_ids = first_argmax(logits)  # [B]

    def random_ids(logits):
        scaled = logits / tensors.temperature[:, None]  # [B, V]
        active = ~tensors.greedy & ((tensors.top_k < v) | (tensors.top_p < 1.0) | (tensors.min_p > 0.0))
        scaled = jax.lax.cond(jnp.any(active), filter_logits, lambda x, _: x, scaled, tensors)
        return first_argmax(scaled + gumbel_noise(tensors, v))

    # Skip the sort and the random bits when every row is greedy.
    sampled = jax.lax.cond(jnp.all(tensors.greedy), lambda _: greedy_ids, random_ids, logits)
    token_ids = jnp.where(tensors.greedy, greedy_ids, sampled)  # [B]
    if raw_logprobs is None:
        return SampleOutput(token_ids=token_ids)

    chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)  # [B, 1]
    ranks = jnp.sum(raw_logprobs >= chosen, axis=-1).astype(jnp.int32)  # [B]
    if tensors.max_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, tensors.max_logprobs)  # [B, N]
    else:  # N = 0: only the sampled token's logprob
        top_logprobs, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    return SampleOutput(token_ids=token_ids, logprobs=chosen[:, 0], ranks=ranks,
                        top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


def advance(tensors: SamplingTensors, token_ids: jax.Array) -> SamplingTensors:
    """After a step: count token_ids int32 [B] in output_counts and add 1 to steps. Jittable, on device.

    Padding rows are counted too; the engine overwrites rows when the batch changes.
    """
    counts = tensors.output_counts
    if counts is not None:
        counts = counts.at[jnp.arange(counts.shape[0]), token_ids].add(1)
    return dataclasses.replace(tensors, output_counts=counts, steps=tensors.steps + 1)


def advance_columns(tensors: SamplingTensors, token_ids: jax.Array, first: jax.Array,
                    count: jax.Array) -> SamplingTensors:
    """``advance`` by a variable number of tokens per row (a draft-verify round's output, step_program.py): count
    token_ids int32 [B, T] at columns first .. first + count - 1 (first, count int32 [B]) in output_counts and add
    count to steps. Jittable, on device."""
    counts = tensors.output_counts
    if counts is not None:
        cols = jnp.arange(token_ids.shape[1])[None, :]
        taken = (cols >= first[:, None]) & (cols < (first + count)[:, None])  # [B, T]
        counts = counts.at[jnp.arange(counts.shape[0])[:, None], token_ids].add(taken.astype(counts.dtype))
    return dataclasses.replace(tensors, output_counts=counts, steps=tensors.steps + count)
