"""Runner: turns a scheduler StepPlan into padded, bucketed device arrays and runs one jitted step: the model over
the paged latent cache (DeepseekForCausalLM.paged_hidden_states -> kernels_pallas.mla_decode), the head on each
row's last token, and the sampler (engine/sampler.py), all on device; greedy steps of one row per device may find
the head's argmax through its int8 screen instead (``head_sample``, models/screened_head.py).

Layout of a step (every device is a DP rank; rank r owns rows [r * rows, (r + 1) * rows)): a chunk of n tokens
sits at the END of its row of T columns, so that mla_decode's causal rule (query i sees keys < seqlen - T + i + 1)
holds for every real token; padding columns write nothing (slot -1) and padding rows see no keys.

Bounded compilation: the step compiles once per (rows, T, pages) bucket, penalties on/off and logprobs on/off.
Decode steps: T = 1, rows per rank a power of two. Prefill steps: T a power of two >= scheduler.min_prefill_t
and rows per rank a power of two, rows * T <= scheduler.prefill_capacity (the scheduler keeps every rank's chunks
within that). Pages per row: a power of two >= MIN_PAGES. A prefill grid is no larger than its chunks need: one
64-token prompt runs a [1, 64] grid, not a full prefill_capacity one (1024 tokens by default: 16x the work).

One transfer per step: the step's host arrays and sampling tensors travel packed in one int32 array, unpacked
inside the jitted step (packing.py).

Tokens stay on device: every step writes its sampled tokens into a device buffer (slot rank * max_rows + row), and
a token the host does not know yet (a scheduler PLACEHOLDER) is read from that buffer by the next step, so the
host can schedule and dispatch step n+1 before step n's tokens come back (``dispatch`` returns at once; ``fetch``
waits).

Multi-step decode (``num_scheduler_steps`` = k > 1, vLLM's multi-step scheduling): a decode step whose chunks
cover several tokens runs up to k iterations in one program (a ``lax.while_loop``). Iteration j computes position
start + j of every row (its input: the token iteration j - 1 sampled) and samples the next token; a row with fewer
tokens than k is masked after its last one (no slot, no token to the buffer, outputs dropped by the host), and so
is a row once it samples a stop token. The loop ends when no row is active: a step does not compute iterations
whose tokens would all be thrown away (``_decode_loop``). The latents of the
earlier iterations are read from a per-layer window (paged_attention.DecodeWindow) and written after the
program with the others, so an iteration computes what a one-token step over the written cache would. On a
2-core CPU the host's work per step (arrays, the transfer, the dispatch, the bookkeeping: about 1 ms of CPU
time, taken from the device's threads) is then paid once per k tokens.

Expert load: every step also returns its per-DP-rank expert counts (int32 [ranks, moe layers, experts], padding
excluded; DeepseekForCausalLM.paged_hidden_states) and adds them on device to a running total over the last
``expert_load_window`` steps (the step n - window counts, kept as device arrays, are subtracted in the same step):
no host transfer and no cross-device reduction per step; ``expert_load`` sums the ranks when it is read.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.engine import packing
from jaxinfer.engine.sampler import SampleOutput, SamplingTensors, advance, sample, token_counts
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import MIN_PREFILL_T, ScheduledChunk, StepPlan, bucket
from jaxinfer.engine.sequence import PLACEHOLDER, SequenceStatus
from jaxinfer.kv.paged_cache import init_paged_cache
from jaxinfer.models.layers import local_rows
from jaxinfer.models.paged_attention import DecodeWindow, write_latents
from jaxinfer.models.screened_head import HeadScreen, build_head_screen, screened_argmax
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.multihost import global_array, to_host

# Stop ids a multi-step decode step checks on device per row (SamplingParams.stop_tokens: EOS first, then
# stop_token_ids): a row with more is checked for the first ones only, which is safe (the host's stop check
# decides; the device only stops early).
DEVICE_STOP_IDS = 8
MIN_PAGES = 2  # pages per row at least: fewer shapes; at batch 32 and 128-token contexts 4 cost 10% more per step
_PAD_PARAMS = SamplingParams(temperature=0.0)  # rows that sample nothing: greedy, never read


def head_sample(model, h: jax.Array, tensors: SamplingTensors, screen: HeadScreen | None) -> SampleOutput:
    """The head on each row's last hidden state h [R, D] and the sampler. A step whose rows are all greedy, with
    no penalties and no logprobs, takes the screened argmax (models/screened_head.py: the same tokens from a
    quarter of the head's float32 bytes) when a screen is given and each device holds one row (the matrix-vector
    regime, where the head's bytes are the cost); the full logits when the screen cannot prove its answer."""
    def full(_=None):
        return sample(model.head(h[:, None])[:, 0], tensors)  # [R, V] logits -> [R]

    if (screen is None or tensors.max_logprobs is not None or tensors.output_counts is not None
            or local_rows(h.shape[0], model.row_shards) != 1):
        return full()

    def greedy(_):
        ids, proven = screened_argmax(h.astype(model.dtype), model.head_weight(), screen, model.row_shards)
        return jax.lax.cond(proven, lambda _: ids, lambda _: full().token_ids, None)

    return SampleOutput(token_ids=jax.lax.cond(jnp.all(tensors.greedy), greedy, lambda _: full().token_ids, None))


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its plan, the (global row, chunk) of every sampling chunk, the device outputs."""

    plan: StepPlan
    sampled: list[tuple[int, ScheduledChunk]]
    output: SampleOutput


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host values of a step: per seq_id its sampled tokens (one, or one per iteration of a multi-step decode
    chunk); per seq_id the logprobs of each ({token: logprob}, sampled token included) for rows that asked."""

    tokens: dict[int, list[int]]
    logprobs: dict[int, list[dict[int, float]]]


class Runner:
    """Holds the model's paged latent cache (per layer [R * pages_per_rank, 64, 1, C+R]) and the token buffer.

    Args:
      model: a jaxinfer Model.
      num_pages_per_rank: KV pages per DP rank (the null page 0 included).
      max_num_seqs: running sequences per rank at most (sizes the token buffer).
      prefill_capacity, min_prefill_t: the prefill grid (Scheduler.prefill_capacity, Scheduler.min_prefill_t).
      engine_seed: seed of unseeded requests (sampler.request_seed).
      max_logprobs: the logprobs width computed when any row asks for logprobs (one static width bounds
        compilations; vLLM's ``max_logprobs`` default is 20).
      expert_load_window: ``expert_load`` covers the last this many steps.
      num_scheduler_steps: decode iterations per decode step at most (Scheduler.num_scheduler_steps).
      eos_token_id: the scheduler's EOS id (Scheduler.eos_token_id): a multi-step decode step stops early when
        every row has sampled a stop token (``_decode_loop``).
      greedy_screening: greedy steps of one row per device take the head's argmax through an int8 screen
        (``head_sample``; the same tokens, a quarter of a float32 head's bytes, an int8 copy of the head kept).
    """

    def __init__(self, model, num_pages_per_rank: int, *, max_num_seqs: int = 64, prefill_capacity: int = 1024,
                 min_prefill_t: int = MIN_PREFILL_T, page_size: int = 64, engine_seed: int = 0,
                 max_logprobs: int = 20, expert_load_window: int = 1000, num_scheduler_steps: int = 1,
                 eos_token_id: int | None = None, greedy_screening: bool = False):
        self.model = model
        self.page_size = page_size
        self.ranks = model.dp_size
        self.max_rows = bucket(max_num_seqs)  # a rank's sampling rows: one per running sequence at most
        self.prefill_capacity = prefill_capacity
        self.min_prefill_t = min_prefill_t
        self.engine_seed = engine_seed
        self.max_logprobs = max_logprobs
        self.num_scheduler_steps = num_scheduler_steps
        self.eos_token_id = eos_token_id
        self.greedy_screening = greedy_screening
        self.vocab_size = model.config.vocab_size
        self._batch = NamedSharding(model.mesh, P(BATCH_AXES))
        # The XLA path's cache holds bit patterns (paged_cache's module doc: XLA:CPU upcasts bf16 scatters and
        # gathers over the whole cache); the Pallas kernel reads its own dtype.
        self.layers = init_paged_cache(model.config, num_pages_per_rank, model.dtype, mesh=model.mesh,
                                       page_size=page_size, as_bits=not self._write_in_step).layers
        self.tokens = global_array(np.zeros(self.ranks * self.max_rows, np.int32), self._batch)
        self._feed: dict[int, int] = {}  # seq_id -> buffer slot of its token sampled by the last dispatched step
        self.expert_load_window = expert_load_window
        load_shape = (self.ranks, model.config.num_moe_layers, model.config.n_routed_experts)
        self._no_load = global_array(np.zeros(load_shape, np.int32), self._batch)  # subtracted while filling up
        self._load_total = global_array(np.zeros(load_shape, np.int32), self._batch)  # [ranks, L, E] over window
        self._load_steps: collections.deque = collections.deque()  # per-step counts in the window, oldest first

    @functools.cached_property
    def _write_in_step(self) -> bool:
        """The Pallas kernel (GPU) reads the cache written inside the step; the XLA path writes it afterwards in
        a second program (paged_attention.paged_mla explains why)."""
        return jax.default_backend() == "gpu"

    @functools.cached_property
    def _state_leaves(self) -> tuple[list, object]:
        """The model state as a flat list of arrays (+ its treedef): flattening the nnx.State at every dispatch
        costs about a millisecond, a tenth of a small model's decode step on CPU."""
        leaves, treedef = jax.tree.flatten(self.model.state)
        return leaves, treedef

    @functools.cached_property
    def _head_screen(self) -> HeadScreen | None:
        """The head's int8 screen (models/screened_head.py), built from the current weights; None when off."""
        if not self.greedy_screening:
            return None
        return build_head_screen(nnx.merge(self.model.graphdef, self.model.state).head_weight())

    def refresh_state(self) -> None:
        """Reads the model state again at the next step (after it was changed in place, e.g. rebalanced experts).
        Shapes, dtypes and shardings must not change: the compiled steps are reused."""
        self.__dict__.pop("_state_leaves", None)
        self.__dict__.pop("_head_screen", None)

    @functools.cached_property
    def _step(self):
        graphdef = self.model.graphdef
        treedef = self._state_leaves[1]
        write_cache = self._write_in_step
        batch = self._batch

        # XLA hoists loop-invariant work out of a multi-step decode loop, the weights' converts and transposes
        # included: a bf16 batch-1 decode on CPU then reads float32 copies of every weight in every iteration
        # (8.6 instead of 1.5 ms per token). Only the XLA path (write_cache=False) compiles with it off.
        options = None if write_cache else {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}

        @functools.partial(jax.jit, donate_argnums=((1, 2, 3) if write_cache else (2, 3)), static_argnums=6,
                           compiler_options=options)
        def step(state_leaves, layers, tokens, load_total, load_evict, packed, layout, screen):
            ids, src, positions, block_table, seqlens, slots, dest, stop_ids, tensors = packing.unpack(packed, layout)
            ids = jnp.where(src >= 0, tokens[jnp.maximum(src, 0)], ids)  # [R, T] placeholders from the buffer
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))
            if ids.shape[1] == 1 and slots.shape[1] > 1:  # a multi-step decode step: slots [R, k]
                # A row whose input token, sampled by the previous step, is a stop token has finished (the host
                # does not know yet: it dispatched this step first): it computes nothing here.
                stopped = (src[:, -1] >= 0) & _is_stop(ids[:, -1], stop_ids)  # [R]
                out, layers, tokens, load, latents = self._decode_loop(
                    model, layers, tokens, ids, positions, block_table, seqlens, slots, dest, tensors, write_cache,
                    load_total.shape, stop_ids, stopped, screen)
                n = self.max_rows * slots.shape[1]
            else:
                h, layers, load = model.paged_hidden_states(ids, positions, layers, block_table, seqlens, slots,
                                                            write_cache)
                out = head_sample(model, h[:, -1], tensors, screen)  # the last column: each row's last real token
                tokens = tokens.at[dest].set(out.token_ids, mode="drop")  # dest past the buffer: padding rows
                latents = layers
                n = self.max_rows if ids.shape[1] == 1 else self.prefill_capacity
            load = jnp.broadcast_to(load, load_total.shape)  # [ranks, L, E] ([1, 0, E] without MoE layers)
            load = jax.lax.with_sharding_constraint(load, batch)  # each rank keeps its own row
            load_total = load_total + load - load_evict
            if write_cache:
                return out, layers, tokens, (load_total, load)
            # This step's latents and slots, padded per rank to a fixed count: the write program compiles once per
            # kind of step (decode, multi-step decode, prefill).
            return (out, (tuple(self._pack(x, 0, n) for x in latents), self._pack(slots, -1, n)), tokens,
                    (load_total, load))

        return step

    def _decode_loop(self, model, layers, tokens, ids, positions, block_table, seqlens, slots, dest, tensors,
                     write_cache: bool, load_shape: tuple[int, ...], stop_ids, stopped, screen):
        """k decode iterations (slots [R, k]; see the module doc). ids, positions [R, 1]: each row's first
        token and its position; seqlens [R]: tokens in the cache after iteration 0 (0: padding row); stop_ids
        [R, S]: each row's stop tokens (-1: none); stopped [R]: rows finished before the step; screen: the
        head's int8 screen or None (``head_sample``). Returns
        (SampleOutput with a leading [k] axis, layers, tokens, expert load [load_shape] summed over the
        iterations, per layer the latents [R, k, C+R] of all iterations (write_cache=False; else None)).

        A row is active in iteration j while j < its token count and it has not sampled a stop token; the loop
        ends when no row is active (all rows at max_tokens before k, or all stopped, e.g. at EOS), so a step
        computes no iteration whose tokens would all be thrown away. Outputs of iterations not run are zeros and
        an inactive row writes no token to the buffer; the host reads a row's outputs up to its last token or its
        stop token only (Scheduler.resolve), and its tokens after a stop token are garbage either way."""
        r, k = slots.shape
        live = jnp.sum(slots >= 0, axis=1)  # [R] iterations with a token of the row's own
        start = positions[:, 0]  # [R]
        no_dest = self.ranks * self.max_rows  # out of the buffer: dropped
        c = model.config
        width = c.kv_lora_rank + c.qk_rope_head_dim
        windows = None if write_cache else tuple(jnp.zeros((r, k, width), self.model.dtype) for _ in layers)
        cache = layers
        out_shapes = jax.eval_shape(sample, jax.ShapeDtypeStruct((r, self.vocab_size), jnp.float32), tensors)
        outs = jax.tree.map(lambda x: jnp.zeros((k, *x.shape), x.dtype), out_shapes)  # [k, R, ...]

        def active(j, stopped):  # [R]
            return (j < live) & ~stopped

        def iteration(carry):
            j, ids, layers, windows, tokens, tensors, outs, load_sum, stopped = carry  # layers: with write_cache
            slot = jax.lax.dynamic_slice_in_dim(slots, j, 1, axis=1)  # [R, 1]
            lens = jnp.where(seqlens > 0, seqlens + j, 0)  # [R]
            if write_cache:
                h, layers, load = model.paged_hidden_states(ids, positions + j, layers, block_table, lens, slot, True)
            else:
                views = tuple(DecodeWindow(w, start, j) for w in windows)
                h, new, load = model.paged_hidden_states(ids, positions + j, cache, block_table, lens, slot, False,
                                                         views)
                windows = tuple(jax.lax.dynamic_update_slice_in_dim(w, x.astype(w.dtype), j, axis=1)
                                for w, x in zip(windows, new))  # [R, k, C+R]
            out = head_sample(model, h[:, 0], tensors, screen)  # [R]
            now = active(j, stopped)
            tokens = tokens.at[jnp.where(now, dest, no_dest)].set(out.token_ids, mode="drop")
            stopped = stopped | (now & _is_stop(out.token_ids, stop_ids))
            tensors = advance(tensors, out.token_ids)
            outs = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, j, 0), outs, out)
            load_sum = load_sum + jnp.broadcast_to(load, load_shape)  # [ranks, L, E]
            return j + 1, out.token_ids[:, None], layers, windows, tokens, tensors, outs, load_sum, stopped

        def more(carry):
            j, stopped = carry[0], carry[-1]
            return (j < k) & jnp.any(active(j, stopped))

        carry = (jnp.int32(0), ids, layers if write_cache else None, windows, tokens, tensors, outs,
                 jnp.zeros(load_shape, jnp.int32), stopped)
        _, _, layers, windows, tokens, _, outs, load, _ = jax.lax.while_loop(more, iteration, carry)
        return outs, (layers if write_cache else cache), tokens, load, windows

    def _pack(self, x: jax.Array, fill, n: int) -> jax.Array:
        """[ranks * rows, T, ...] -> [ranks * n, 1, ...]: each rank's rows * T tokens padded with fill to n, the
        most a step of its kind holds (decode: max_rows, times k for a multi-step one; prefill: prefill_capacity)."""
        ranks = self.ranks
        x = x.reshape(ranks, -1, *x.shape[2:])
        x = jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(ranks * n, 1, *x.shape[2:])

    @functools.cached_property
    def _write(self):
        mesh = self.model.mesh if self.model.plan is not None else None

        @functools.partial(jax.jit, donate_argnums=0)
        def write(layers, latents, slots):
            return tuple(write_latents(mesh, c, new, slots) for c, new in zip(layers, latents))

        return write

    def _run(self, packed: jax.Array, layout: packing.Layout):
        """One step on the devices (asynchronous): updates the cache, the token buffer and the expert load window,
        returns the samples. packed / layout: the step's host arrays and sampling tensors (``packing.pack``)."""
        full = len(self._load_steps) >= self.expert_load_window
        evict = self._load_steps.popleft() if full else self._no_load
        out, new, self.tokens, (self._load_total, load) = self._step(
            self._state_leaves[0], self.layers, self.tokens, self._load_total, evict, packed, layout,
            self._head_screen)
        self._load_steps.append(load)
        self.layers = new if self._write_in_step else self._write(self.layers, *new)
        return out

    def expert_load(self) -> np.ndarray:
        """np.int64 [moe layers, experts]: (token, choice) pairs routed to each logical expert over the last
        ``expert_load_window`` steps, real tokens only, summed over DP ranks (waits for the dispatched steps)."""
        return to_host(self._load_total).astype(np.int64).sum(0)

    def shapes(self, plan: StepPlan) -> tuple[int, int, int]:
        """(rows per rank, T, pages per row) of the step's bucketed arrays."""
        chunks = [ch for cs in plan.chunks for ch in cs]
        pages = bucket(max((len(ch.seq.pages) for ch in chunks), default=1), MIN_PAGES)
        if plan.kind == "decode":
            return bucket(max(len(c) for c in plan.chunks)), 1, pages
        t = bucket(max((ch.num_tokens for ch in chunks), default=1), self.min_prefill_t)
        rows = bucket(max(len(c) for c in plan.chunks))
        if rows * t > self.prefill_capacity:
            raise RuntimeError(f"prefill step of {[len(c) for c in plan.chunks]} chunks of up to {t} tokens exceeds "
                               f"{self.prefill_capacity} tokens per rank")
        return rows, t, pages

    def arrays(self, plan: StepPlan) -> tuple[list[np.ndarray], list[tuple[int, ScheduledChunk]], list]:
        """Host arrays of one step: (ids, src, positions, block_table, seqlens, slots, dest, stop_ids), the
        (row, chunk) of every sampling chunk, and each row's SamplingParams (padding rows: greedy). Chunks of
        sequences finished since ``schedule`` are left out. A multi-step decode step (chunks of more than one
        token) has slots [rows, k], column j for iteration j, and ids / positions [rows, 1] for each row's first
        token. stop_ids [rows, DEVICE_STOP_IDS]: each sampling row's stop tokens (-1: none)."""
        plan_chunks = [[ch for ch in cs if ch.seq.status is SequenceStatus.RUNNING] for cs in plan.chunks]
        rows, t, pages = self.shapes(dataclasses.replace(plan, chunks=plan_chunks))
        k = t
        if plan.kind == "decode":
            most = max((ch.num_tokens for cs in plan_chunks for ch in cs), default=1)
            if most > self.num_scheduler_steps:
                raise RuntimeError(f"decode chunk of {most} tokens exceeds num_scheduler_steps="
                                   f"{self.num_scheduler_steps}")
            k = 1 if most == 1 else self.num_scheduler_steps  # two programs per bucket: one step or k
        n_rows = self.ranks * rows
        ids = np.zeros((n_rows, t), np.int32)
        src = np.full((n_rows, t), -1, np.int32)
        positions = np.zeros((n_rows, t), np.int32)
        slots = np.full((n_rows, k), -1, np.int32)
        block_table = np.zeros((n_rows, pages), np.int32)  # page 0: each rank's null page
        seqlens = np.zeros((n_rows,), np.int32)
        dest = np.full((n_rows,), self.ranks * self.max_rows, np.int32)  # out of range: dropped
        stop_ids = np.full((n_rows, DEVICE_STOP_IDS), -1, np.int32)  # [rows, S]: -1 matches no token
        params = [_PAD_PARAMS] * n_rows
        sampled, feed = [], {}
        for rank, chunks in enumerate(plan_chunks):
            # Per row: few numpy calls on small arrays (a decode step's rows hold one token each; at batch 32 a
            # numpy call per token and field cost ~3 ms of host time per step on CPU).
            for i, ch in enumerate(chunks):
                row, n, seq = rank * rows + i, ch.num_tokens, ch.seq
                n_in = 1 if plan.kind == "decode" else n  # a decode chunk's later tokens are sampled in the step
                end = ch.start + n_in
                chunk_ids = seq.token_ids(ch.start, end)
                if PLACEHOLDER in chunk_ids:  # only ever the last token, sampled by the previous step
                    if chunk_ids.index(PLACEHOLDER) != n_in - 1 or seq.seq_id not in self._feed:
                        raise RuntimeError(f"seq {seq.seq_id}: unknown token ids in its chunk {chunk_ids}")
                    src[row, t - 1] = self._feed[seq.seq_id]
                    chunk_ids = chunk_ids[:-1] + [0]
                ids[row, t - n_in:] = chunk_ids
                positions[row, t - n_in:] = range(ch.start, end)
                block_table[row, : len(seq.pages)] = seq.pages
                pos = np.arange(ch.start, ch.start + n)  # [n] positions computed
                cols = slice(0, n) if plan.kind == "decode" else slice(t - n, t)
                slots[row, cols] = block_table[row, pos // self.page_size] * self.page_size + pos % self.page_size
                seqlens[row] = end
                if ch.sample:
                    sampled.append((row, ch))
                    params[row] = seq.params
                    dest[row] = rank * self.max_rows + i
                    feed[seq.seq_id] = int(dest[row])
                    stops = seq.params.stop_tokens(self.eos_token_id)[:DEVICE_STOP_IDS]
                    stop_ids[row, : len(stops)] = stops
        self._feed = feed
        return [ids, src, positions, block_table, seqlens, slots, dest, stop_ids], sampled, params

    def _tensors(self, params: list[SamplingParams], sampled) -> SamplingTensors:
        n_rows = len(params)
        seqs = [None] * n_rows
        for row, ch in sampled:
            seqs[row] = ch.seq
        kwargs = {}
        if any(p.uses_penalties for p in params):
            kwargs = dict(output_token_counts=token_counts([s.output_token_ids if s else [] for s in seqs],
                                                           self.vocab_size),
                          prompt_token_mask=token_counts([s.prompt_token_ids if s else [] for s in seqs],
                                                         self.vocab_size) > 0)
        wants_logprobs = any(p.logprobs is not None for p in params)
        return SamplingTensors.build(params, self.vocab_size,
                                     steps=[s.num_output_tokens if s else 0 for s in seqs],
                                     request_ids=[s.seq_id if s else 0 for s in seqs],
                                     child_indices=[s.child_index if s else 0 for s in seqs],
                                     engine_seed=self.engine_seed,
                                     max_logprobs=self.max_logprobs if wants_logprobs else None, **kwargs)

    def dispatch(self, plan: StepPlan) -> InFlight:
        """Starts the step of ``plan`` on the devices and returns without waiting for it.

        Sampling rows with penalties need their real output tokens: the caller resolves the previous step first
        (a PLACEHOLDER among a penalised row's outputs raises)."""
        host, sampled, params = self.arrays(plan)
        for _, ch in sampled:
            if ch.seq.params.uses_penalties and PLACEHOLDER in ch.seq.output_token_ids:
                raise RuntimeError(f"seq {ch.seq.seq_id} uses penalties: resolve the previous step first")
        packed, layout = packing.pack((*host, self._tensors(params, sampled)))  # one transfer: packing.py says why
        return InFlight(plan, sampled, self._run(global_array(packed, self._batch), layout))

    def fetch(self, step: InFlight) -> StepResult:
        """Waits for a dispatched step and returns its sampled tokens (and logprobs) by seq_id."""
        out = step.output
        single = out.token_ids.ndim == 1  # one iteration: the fields get the [k = 1] axis of a multi-step step

        def host(x):
            x = to_host(x)
            return x[None] if single else x

        token_ids = host(out.token_ids)  # [k, R]
        # A decode chunk of n tokens owns its row's first n iterations; any other sampling chunk the one.
        counts = [(row, ch, step.plan.num_sampled(ch)) for row, ch in step.sampled]
        tokens = {ch.seq.seq_id: [int(t) for t in token_ids[:n, row]] for row, ch, n in counts}
        logprobs = {}
        if out.logprobs is not None:
            chosen, top_ids, top_lp = (host(x) for x in (out.logprobs, out.top_ids, out.top_logprobs))
            for row, ch, n in counts:
                width = ch.seq.params.logprobs
                if width is None:
                    continue
                entries = []
                for i in range(n):
                    entry = {int(top_ids[i, row, j]): float(top_lp[i, row, j]) for j in range(width)}
                    entry[int(token_ids[i, row])] = float(chosen[i, row])
                    entries.append(entry)
                logprobs[ch.seq.seq_id] = entries
        return StepResult(tokens, logprobs)


def _is_stop(token_ids: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """token_ids [R], stop_ids [R, S] (-1 = none) -> bool [R]: the row's token is one of its stop tokens."""
    return jnp.any(token_ids[:, None] == stop_ids, axis=1)
