"""The jitted engine step: unpack the step's inputs, run the model over the paged latent cache
(DeepseekForCausalLM.paged_hidden_states with one AttentionMetadata, models/attention.py), the head and the sampler
on each row's last token (head.py), all on device; and the XLA backend's second program that writes the step's
latents.

One transfer per step: the step's host arrays and sampling tensors travel packed in one int32 array, unpacked
inside the jitted step (packing.py).

Multi-step decode (``num_scheduler_steps`` = k > 1, vLLM's multi-step scheduling): a decode step whose chunks
cover several tokens runs up to k iterations in one program (a ``lax.while_loop``, ``decode_loop``). Iteration j
computes position start + j of every row (its input: the token iteration j - 1 sampled) and samples the next
token; a row with fewer tokens than k is masked after its last one (no slot, no token to the buffer, outputs
dropped by the host), and so is a row once it samples a stop token. The loop ends when no row is active: a step
does not compute iterations whose tokens would all be thrown away. With the XLA backend the latents of the earlier
iterations are read from a per-layer window (AttentionMetadata.window_latents) and written after the program with the
others, so an iteration computes what a one-token step over the written cache would; the host's work per step is
then paid once per k tokens. Speculative decoding's verification steps likewise run up to k draft-verify rounds
in one program (``verify_rounds``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.engine import packing
from jaxinfer.engine.drafter import Drafts, propose
from jaxinfer.engine.head import head_sample
from jaxinfer.engine.rejection_sampler import verify
from jaxinfer.engine.sampler import advance, advance_columns, sample
from jaxinfer.models.attention import AttentionBackend, AttentionMetadata, write_latents
from kernels_pallas.mla import DecodeWindow

# How the XLA path's step programs compile (a backend that writes the cache in the step keeps XLA's defaults): XLA
# hoists loop-invariant work out of a multi-step decode loop, the weights' converts and transposes included, and a
# bf16 decode on CPU then reads float32 copies of every weight in every iteration (test_paged_forward.py).
XLA_PATH_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def is_stop(token_ids: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """token_ids [R], stop_ids [R, S] (-1 = none) -> bool [R]: the row's token is one of its stop tokens."""
    return jnp.any(token_ids[:, None] == stop_ids, axis=1)


def stops_in_run(after: jax.Array, first: jax.Array, anchor: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """after int32 [R, T] (a verification's token after each column), first / anchor int32 [R] (the row's first
    real column and its last accepted one), stop_ids [R, S] -> bool [R]: a token the row sampled, after[first ..
    anchor], is one of its stop tokens."""
    cols = jnp.arange(after.shape[1])[None, :]
    made = (cols >= first[:, None]) & (cols <= anchor[:, None])  # [R, T]
    return jnp.any(made[..., None] & (after[..., None] == stop_ids[:, None, :]), axis=(1, 2))


class StepProgram:
    """The step and write programs of one model structure and cache layout (``shared_program`` hands out one per
    layout, so that engines of the same model and settings share their traced and compiled steps).

    graphdef, treedef: the model's nnx GraphDef and its state's treedef (the weights are arguments of every
    program, never held here); vocab_size, dtype, mesh: the model's (mesh None: no parallel plan). backend: the
    attention backend (models/attention.py): "pallas" reads the cache written inside the step; "xla" writes it
    afterwards in a second program (``write``). ranks, max_rows: the token buffer's layout (slot rank * max_rows +
    row); prefill_capacity: a prefill step's tokens per rank at most; page_size: a KV page's positions.
    """

    def __init__(self, graphdef, treedef, vocab_size: int, dtype, mesh, *, backend: AttentionBackend, ranks: int,
                 max_rows: int, prefill_capacity: int, batch_sharding, page_size: int = 64):
        self.graphdef = graphdef
        self.treedef = treedef
        self.dtype = dtype
        self.mesh = mesh
        self.backend = backend
        self.ranks = ranks
        self.max_rows = max_rows
        self.prefill_capacity = prefill_capacity
        self.batch = batch_sharding
        self.page_size = page_size
        self.vocab_size = vocab_size

    @functools.cached_property
    def step(self):
        """step(state_leaves, layers, tokens, load_total, load_evict, packed, layout, screen) -> (sample output,
        layers (a backend that writes in the step) or (latents, slots) to write, tokens, (load_total, load))."""
        graphdef, treedef = self.graphdef, self.treedef
        backend = self.backend
        write_cache = backend.writes_in_step
        options = None if write_cache else XLA_PATH_OPTIONS

        @functools.partial(jax.jit, donate_argnums=((1, 2, 3) if write_cache else (2, 3)), static_argnums=6,
                           compiler_options=options)
        def step(state_leaves, layers, tokens, load_total, load_evict, packed, layout, screen):
            ids, src, positions, block_table, seqlens, slots, dest, stop_ids, *blocks, tensors = packing.unpack(
                packed, layout)  # blocks: [first_block] of a step in query blocks (inputs.py), else []
            ids = jnp.where(src >= 0, tokens[jnp.maximum(src, 0)], ids)  # [R, T] placeholders from the buffer
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))
            md = AttentionMetadata(positions, block_table, seqlens, slots, first_block=blocks[0] if blocks else None)
            if ids.shape[1] == 1 and slots.shape[1] > 1:  # a multi-step decode step: slots [R, k]
                # A row whose input token, sampled by the previous step, is a stop token has finished (the host
                # does not know yet: it dispatched this step first): it computes nothing here.
                stopped = (src[:, -1] >= 0) & is_stop(ids[:, -1], stop_ids)  # [R]
                out, layers, tokens, load, latents = self.decode_loop(
                    model, layers, tokens, ids, md, dest, tensors, load_total.shape, stop_ids, stopped, screen)
                n = self.max_rows * slots.shape[1]
            else:
                h, layers, load = model.paged_hidden_states(ids, layers, md, backend)
                out = head_sample(model, h[:, -1], tensors, screen)  # the last column: each row's last real token
                tokens = tokens.at[dest].set(out.token_ids, mode="drop")  # dest past the buffer: padding rows
                latents = layers
                n = self.max_rows if ids.shape[1] == 1 else self.prefill_capacity
            load = jnp.broadcast_to(load, load_total.shape)  # [ranks, L, E] ([1, 0, E] without MoE layers)
            load = jax.lax.with_sharding_constraint(load, self.batch)  # each rank keeps its own row
            load_total = load_total + load - load_evict
            if write_cache:
                return out, layers, tokens, (load_total, load)
            # This step's latents and slots, padded per rank to a fixed count: the write program compiles once per
            # kind of step (decode, multi-step decode, prefill).
            return (out, (tuple(self._pack(x, 0, n) for x in latents), self._pack(slots, -1, n)), tokens,
                    (load_total, load))

        return step

    @functools.cached_property
    def spec_step(self):
        """The step of speculative decoding (MTP drafts; engine/drafter.py, engine/rejection_sampler.py):
        spec_step(state_leaves, layers, mtp_layers, tokens, drafted, load_total, load_evict, packed, layout,
        verifying, num_drafts, rounds, screen) -> (output, Drafts [R, K], layers, (latents, slots) to write,
        tokens, drafted, a verification row's real columns in its first round [R], (load_total, load)).

        A prefill step (verifying=False) samples each row's next token as ``step`` does (a SampleOutput) and runs
        the MTP module over the chunk, the token after the chunk being ``next_ids`` (a host-known token) or the
        sample (-1). A verification step (verifying=True) scores every column of its rows (the last token and
        the drafts) and accepts a prefix of the drafts (a VerifyOutput); the MTP module then runs over the
        accepted tokens. Both propose K drafts from the row's last token. With rounds > 1 a verification step
        runs up to that many draft-verify rounds (``verify_rounds``; its outputs get a leading [rounds] axis). To
        write: the MTP latents at the step's slots, and the main layers' latents too when the backend does not
        write in the step.

        drafted int32 [ranks * max_rows, K + 2], a buffer like ``tokens`` (slot rank * max_rows + row): each
        sampling row's drafts, its positions not accepted (reserved minus computed) and whether it sampled a stop
        token (1 / 0), so that the next verification, dispatched before this step's results reach the host,
        follows on device (``follow_in_flight``)."""
        graphdef, treedef = self.graphdef, self.treedef
        backend = self.backend
        write_cache = backend.writes_in_step
        options = None if write_cache else XLA_PATH_OPTIONS

        @functools.partial(jax.jit, donate_argnums=((1, 3, 4, 5) if write_cache else (3, 4, 5)),
                           static_argnums=(8, 9, 10, 11), compiler_options=options)
        def step(state_leaves, layers, mtp_layers, tokens, drafted, load_total, load_evict, packed, layout,
                 verifying, num_drafts, rounds, screen):
            (ids, src, positions, block_table, seqlens, slots, dest, stop_ids, next_ids, follow, left, *reserve,
             tensors) = packing.unpack(packed, layout)  # reserve: [slots of the reserved positions] with rounds > 1
            ids = jnp.where(src >= 0, tokens[jnp.maximum(src, 0)], ids)  # [R, T]
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))
            md = AttentionMetadata(positions, block_table, seqlens, slots)
            columns = jnp.zeros(ids.shape[:1], jnp.int32)  # [R] a verification row's real columns in round 0
            if verifying:
                reserved = jnp.sum((reserve[0] if reserve else slots) >= 0, axis=1)  # [R] as the host laid out
                ids, md, reserve, tensors = self.follow_in_flight(drafted, follow, left, ids, md, reserve, tensors,
                                                                  rounds)
                slots = md.slots
                columns = jnp.sum(slots >= 0, axis=1)
            if verifying and rounds > 1:
                out, drafts, layers, latents, slots, last, load, ended = self.verify_rounds(
                    model, layers, mtp_layers[0], ids, md, reserve[0], tensors, stop_ids, num_drafts, rounds,
                    load_total.shape)
                unused = reserved - jnp.sum(slots >= 0, axis=1)  # [R]
                n = self.max_rows * slots.shape[1]
            else:
                r, t = ids.shape
                h, layers, load = model.paged_hidden_states(ids, layers, md, backend)  # h [R, T, D]
                if verifying:
                    first = t - jnp.sum(slots >= 0, axis=1)  # [R] (t for a padding row)
                    out = verify(model.head(h), ids, first, tensors)  # [R, T, V] logits -> VerifyOutput
                    anchor = jnp.minimum(first, t - 1) + out.num_accepted  # [R]
                    after = out.token_ids  # [R, T]: the token after each column, up to the anchor
                    last = jnp.take_along_axis(after, anchor[:, None], axis=1)[:, 0]  # [R]
                    unused = reserved - jnp.where(columns > 0, out.num_accepted + 1, 0)  # [R]
                    ended = stops_in_run(after, first, anchor, stop_ids)
                    n = self.max_rows * (num_drafts + 1)
                else:
                    out = head_sample(model, h[:, -1], tensors, screen)  # [R]
                    last = out.token_ids
                    after = jnp.concatenate([ids[:, 1:], jnp.where(next_ids >= 0, next_ids, last)[:, None]], axis=1)
                    anchor = jnp.full((r,), t - 1, jnp.int32)
                    unused = jnp.zeros((r,), jnp.int32)
                    ended = is_stop(last, stop_ids)
                    n = self.prefill_capacity
                drafts, mtp_latents, _ = propose(model, h, after, mtp_layers[0], md, anchor, num_drafts)
                latents = (mtp_latents,) if write_cache else (*layers, mtp_latents)
            tokens = tokens.at[dest].set(last, mode="drop")
            state = jnp.concatenate([drafts.token_ids, unused[:, None], ended[:, None].astype(jnp.int32)], axis=1)
            drafted = drafted.at[dest].set(state, mode="drop")  # [rows, K + 2]
            load = jnp.broadcast_to(load, load_total.shape)
            load = jax.lax.with_sharding_constraint(load, self.batch)
            load_total = load_total + load - load_evict
            writes = (tuple(self._pack(x, 0, n) for x in latents), self._pack(slots, -1, n))
            return (out, drafts, (layers if write_cache else None), writes, tokens, drafted, columns,
                    (load_total, load))

        return step

    def follow_in_flight(self, drafted, follow, left, ids, md: AttentionMetadata, reserve: list, tensors,
                         rounds: int):
        """Lays out the rows of a verification step scheduled while their previous step was in flight (async
        scheduling, scheduler.py "Speculative steps in flight") as the scheduler would have with that step applied.

        The host laid such a row out as if that step had computed every position it reserved, its drafts unknown.
        follow int32 [R]: the row's slot in ``drafted`` (that step's drafts, its reserved positions it did not
        compute and whether it sampled a stop token: ``spec_step``), -1 for a row laid out from known values
        (unchanged here). left int32 [R]: the tokens the row may still sample as the host counted them. With s
        positions not computed, the row starts s positions earlier and may sample left + s tokens: like the
        scheduler's ``_schedule_decode``, it verifies min(K, left + s - 1) drafts in its first round and reserves up
        to rounds - 1 later rounds of T positions, within left + s and within the positions its pages hold (the
        host's reservation + s); nothing once that step sampled a stop token (its sequence has ended). Its last
        token is the host's (read from the token buffer); positions, slots (through the block table, which covers
        the host's reservation), seqlens, reserved slots and sampling keys (``tensors.steps``: outputs before the
        row's first sample) follow. Returns (ids, md, reserve, tensors)."""
        r, t = ids.shape
        k = drafted.shape[1] - 2
        page = self.page_size
        prev = drafted[jnp.maximum(follow, 0)]  # [R, K + 2]
        on = follow >= 0  # [R]
        shift = jnp.where(on, prev[:, k], 0)  # [R]
        real = md.slots >= 0  # [R, T]
        col = jnp.minimum(t - jnp.sum(real, axis=1), t - 1)[:, None]  # [R, 1]: the host's last-token column
        last = jnp.take_along_axis(ids, col, axis=1)[:, 0]  # [R]
        start = jnp.take_along_axis(md.positions, col, axis=1)[:, 0] - shift  # [R]: the last token's position
        room = jnp.sum((reserve[0] if reserve else md.slots) >= 0, axis=1) + shift  # [R] positions paged
        budget = left + shift  # [R] tokens it may still sample
        num_drafts = jnp.clip(jnp.minimum(budget - 1, min(k, t - 1)), 0)  # [R]
        n = jnp.clip(jnp.minimum(jnp.minimum(1 + num_drafts + (rounds - 1) * t, budget), room), 0)  # [R]
        n = jnp.where(prev[:, k + 1] > 0, 0, n)
        first = t - jnp.minimum(n, 1 + num_drafts)  # [R]: t when the row computes nothing
        cols = jnp.arange(t)[None, :]
        d = cols - first[:, None] - 1  # [R, T]: the draft index of each column
        new_ids = jnp.where(d < 0, last[:, None], jnp.take_along_axis(prev[:, :k], jnp.clip(d, 0, k - 1), axis=1))
        new_real = cols >= first[:, None]  # [R, T]

        def slot_of(pos):  # [R, n] positions -> slots, through the block table
            pages = jnp.take_along_axis(md.block_table, jnp.clip(pos // page, 0, md.block_table.shape[1] - 1), axis=1)
            return pages * page + pos % page

        pos = jnp.where(new_real, start[:, None] + cols - first[:, None], 0)  # [R, T]
        md = dataclasses.replace(
            md, positions=jnp.where(on[:, None], pos, md.positions),
            slots=jnp.where(on[:, None], jnp.where(new_real, slot_of(pos), -1), md.slots),
            seqlens=jnp.where(on, jnp.where(first < t, start + t - first, 0), md.seqlens))
        if reserve:  # [R, W]: the reserved positions from the last token's on
            w = reserve[0].shape[1]
            at = start[:, None] + jnp.arange(w)[None, :]  # [R, W]
            reserve = [jnp.where(on[:, None], jnp.where(jnp.arange(w)[None, :] < n[:, None], slot_of(at), -1),
                                 reserve[0])]
        ids = jnp.where(on[:, None] & new_real, new_ids, ids)
        return ids, md, reserve, dataclasses.replace(tensors, steps=tensors.steps - shift)

    def verify_rounds(self, model, layers, mtp_cache, ids, md: AttentionMetadata, reserve, tensors, stop_ids,
                      num_drafts: int, rounds: int, load_shape: tuple[int, ...]):
        """Up to ``rounds`` draft-verify rounds in one program (vLLM's multi-step scheduling for speculative
        decoding: the host's work per step is paid once per program, not per round).

        Round 0 is the step's own: ids [R, T] and md as a one-round verification step lays them out (a row's last
        token and its drafts, right aligned; its first real column ``first``). Each later round verifies the
        drafts the previous one proposed: [its last token, drafts 1 .. T - 1] at the T positions after the row's
        accepted tokens (first = 0). reserve int32 [R, W] (W = rounds * T): the slots of the row's reserved
        positions start, start + 1, ... (start: round 0's first real column; -1 past the reservation), so a
        round's slots follow the accepted counts on device. A row takes part in a round while it has not sampled
        a stop token (stop_ids [R, S], -1: none) and the round's T positions are reserved (the scheduler reserves
        no more than the row may still sample). Tokens and penalty counts advance by each round's new tokens
        (``advance_columns``), so output index o draws the keys it would in one-round steps.

        Latents not yet in the cache live in windows from ``start`` (per layer [R, W, C+R] with the XLA backend;
        the pallas backend writes each round's latents into the cache at once; the MTP module's always, as in a
        one-round step), each round's columns written at their positions - start: a rejected draft's entry is
        overwritten by the next round's, which starts at the position after the accepted ones.

        Returns (VerifyOutput with a leading [rounds] axis, num_accepted -1 in rounds a row did not take part in;
        the last round's Drafts of each row; layers (pallas) or None; latents to write (per layer [R, W, C+R]
        (XLA), then the MTP module's); their slots [R, W] (-1 past the row's computed positions); each row's last
        token [R]; expert load summed over the rounds; whether the row sampled a stop token [R])."""
        backend = self.backend
        write_cache = backend.writes_in_step
        r, t = ids.shape
        w = reserve.shape[1]
        c = model.config
        width = c.kv_lora_rank + c.qk_rope_head_dim
        rows, cols = jnp.arange(r), jnp.arange(t)
        real0 = md.slots >= 0  # [R, T]
        live = jnp.any(real0, axis=1)  # [R]
        first0 = jnp.where(live, t - jnp.sum(real0, axis=1), t)  # [R]: t for a padding row
        start = jnp.take_along_axis(md.positions, jnp.minimum(first0, t - 1)[:, None], axis=1)[:, 0]  # [R]
        reserved = jnp.sum(reserve >= 0, axis=1)  # [R] positions reserved
        windows = None if write_cache else tuple(jnp.zeros((r, w, width), model.dtype) for _ in layers)
        mtp_window = jnp.zeros((r, w + num_drafts - 1, width), model.dtype)
        out_shapes = jax.eval_shape(verify, jax.ShapeDtypeStruct((r, t, c.vocab_size), jnp.float32), ids, first0,
                                    tensors)
        outs = jax.tree.map(lambda x: jnp.zeros((rounds, *x.shape), x.dtype), out_shapes)  # [rounds, R, ...]
        outs = dataclasses.replace(outs, num_accepted=jnp.full((rounds, r), -1, jnp.int32))  # rounds not run
        no_drafts = Drafts(jnp.zeros((r, num_drafts), jnp.int32), jnp.zeros((r, num_drafts), jnp.float32))
        cache = layers  # the XLA backend's: only read

        def body(carry):
            j, off, ids, active, layers, windows, mtp_window, tensors, outs, drafts, last, load_sum, ended = carry
            first = jnp.where(active, jnp.where(j == 0, first0, 0), t)  # [R]: t where the row sits out
            idx = off[:, None] + cols[None, :] - first[:, None]  # [R, T]: the columns' window offsets
            real = cols[None, :] >= first[:, None]  # [R, T]
            slots = jnp.where(real, jnp.take_along_axis(reserve, jnp.clip(idx, 0, w - 1), axis=1), -1)
            round_md = AttentionMetadata(positions=jnp.maximum(start[:, None] + idx, 0), block_table=md.block_table,
                                         seqlens=jnp.where(active, start + off + t - first, 0), slots=slots)
            if write_cache:
                h, layers, load = model.paged_hidden_states(ids, layers, round_md, backend)
            else:
                windowed = dataclasses.replace(round_md, window_latents=windows, window_start=start,
                                               window_length=off)
                h, new, load = model.paged_hidden_states(ids, cache, windowed, backend)
                at = jnp.where(real, idx, w)  # out of range: dropped
                windows = tuple(x.at[rows[:, None], at].set(y.astype(x.dtype), mode="drop")
                                for x, y in zip(windows, new))
            out = verify(model.head(h), ids, first, tensors)  # [R, T, V] logits -> VerifyOutput
            acc = out.num_accepted  # [R]
            anchor = jnp.minimum(first, t - 1) + acc  # [R]
            after = out.token_ids  # [R, T]
            new_last = jnp.take_along_axis(after, anchor[:, None], axis=1)[:, 0]  # [R]
            new_drafts, _, mtp_window = propose(model, h, after, mtp_cache, round_md, anchor, num_drafts,
                                                window=DecodeWindow(mtp_window, start, off))
            stopped = stops_in_run(after, first, anchor, stop_ids)  # [R]
            count = jnp.where(active, acc + 1, 0)  # [R]
            tensors = advance_columns(tensors, after, first, count)
            off = off + count
            out = dataclasses.replace(out, num_accepted=jnp.where(active, acc, -1))
            outs = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, j, 0), outs, out)
            drafts = jax.tree.map(lambda new, old: jnp.where(active[:, None], new, old), new_drafts, drafts)
            last = jnp.where(active, new_last, last)
            ids = jnp.concatenate([last[:, None], drafts.token_ids[:, :t - 1]], axis=1)  # the next round's
            load_sum = load_sum + jnp.broadcast_to(load, load_shape)
            active = active & ~stopped & (off + t <= reserved)
            return (j + 1, off, ids, active, layers, windows, mtp_window, tensors, outs, drafts, last, load_sum,
                    ended | stopped)

        def more(carry):
            return (carry[0] < rounds) & jnp.any(carry[3])

        carry = (jnp.int32(0), jnp.zeros((r,), jnp.int32), ids, live, layers if write_cache else None, windows,
                 mtp_window, tensors, outs, no_drafts, jnp.zeros((r,), jnp.int32), jnp.zeros(load_shape, jnp.int32),
                 jnp.zeros((r,), bool))
        _, off, _, _, layers, windows, mtp_window, _, outs, drafts, last, load, ended = jax.lax.while_loop(
            more, body, carry)
        slots = jnp.where(jnp.arange(w)[None, :] < off[:, None], reserve, -1)  # [R, W]: computed positions only
        latents = (mtp_window[:, :w],) if write_cache else (*windows, mtp_window[:, :w])
        return outs, drafts, (layers if write_cache else None), latents, slots, last, load, ended

    def decode_loop(self, model, layers, tokens, ids, md: AttentionMetadata, dest, tensors,
                    load_shape: tuple[int, ...], stop_ids, stopped, screen):
        """k decode iterations (md.slots [R, k]; see the module doc). ids [R, 1] and md.positions [R, 1]: each
        row's first token and its position; md.seqlens [R]: tokens in the cache after iteration 0 (0: padding
        row); stop_ids
        [R, S]: each row's stop tokens (-1: none); stopped [R]: rows finished before the step; screen: the
        head's int8 screen or None (``head_sample``). Returns
        (SampleOutput with a leading [k] axis, layers, tokens, expert load [load_shape] summed over the
        iterations, per layer the latents [R, k, C+R] of all iterations (the XLA backend; else None)).

        A row is active in iteration j while j < its token count and it has not sampled a stop token; the loop
        ends when no row is active (all rows at max_tokens before k, or all stopped, e.g. at EOS). Outputs of
        iterations not run are zeros and an inactive row writes no token to the buffer; the host reads a row's
        outputs up to its last token or its stop token only (Scheduler.update_from_output), and its tokens after
        a stop token are garbage either way."""
        backend = self.backend
        write_cache = backend.writes_in_step
        positions, seqlens, slots = md.positions, md.seqlens, md.slots
        r, k = slots.shape
        live = jnp.sum(slots >= 0, axis=1)  # [R] iterations with a token of the row's own
        start = positions[:, 0]  # [R]
        no_dest = self.ranks * self.max_rows  # out of the buffer: dropped
        c = model.config
        width = c.kv_lora_rank + c.qk_rope_head_dim
        windows = None if write_cache else tuple(jnp.zeros((r, k, width), self.dtype) for _ in layers)
        cache = layers
        out_shapes = jax.eval_shape(sample, jax.ShapeDtypeStruct((r, self.vocab_size), jnp.float32), tensors)
        outs = jax.tree.map(lambda x: jnp.zeros((k, *x.shape), x.dtype), out_shapes)  # [k, R, ...]

        def active(j, stopped):  # [R]
            return (j < live) & ~stopped

        def iteration(carry):
            j, ids, layers, windows, tokens, tensors, outs, load_sum, stopped = carry  # layers: with write_cache
            slot = jax.lax.dynamic_slice_in_dim(slots, j, 1, axis=1)  # [R, 1]
            lens = jnp.where(seqlens > 0, seqlens + j, 0)  # [R]
            step_md = dataclasses.replace(md, positions=positions + j, seqlens=lens, slots=slot)
            if write_cache:
                h, layers, load = model.paged_hidden_states(ids, layers, step_md, backend)
            else:
                step_md = dataclasses.replace(step_md, window_latents=windows, window_start=start, window_length=j)
                h, new, load = model.paged_hidden_states(ids, cache, step_md, backend)
                windows = tuple(jax.lax.dynamic_update_slice_in_dim(w, x.astype(w.dtype), j, axis=1)
                                for w, x in zip(windows, new))  # [R, k, C+R]
            out = head_sample(model, h[:, 0], tensors, screen)  # [R]
            now = active(j, stopped)
            tokens = tokens.at[jnp.where(now, dest, no_dest)].set(out.token_ids, mode="drop")
            stopped = stopped | (now & is_stop(out.token_ids, stop_ids))
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
    def write(self):
        """write(layers, latents, slots) -> layers: the XLA path's cache write after a step (layers donated)."""
        mesh = self.mesh

        @functools.partial(jax.jit, donate_argnums=0)
        def write(layers, latents, slots):
            return tuple(write_latents(mesh, c, new, slots) for c, new in zip(layers, latents))

        return write


@functools.lru_cache(maxsize=16)
def shared_program(graphdef, treedef, vocab_size: int, dtype, mesh, *, backend: AttentionBackend, ranks: int,
                   max_rows: int, prefill_capacity: int, batch_sharding, page_size: int) -> StepProgram:
    """The StepProgram of a model structure and layout (StepProgram's arguments, all hashable), one per process: a
    second engine of the same model and settings (a notebook's second LLM, a benchmark's engines, an engine rebuilt
    with other sampling defaults) reuses the first one's traced and compiled steps instead of tracing, lowering and
    compiling (or reading from the compilation cache) each again. It holds no weights, caches or engines."""
    return StepProgram(graphdef, treedef, vocab_size, dtype, mesh, backend=backend, ranks=ranks, max_rows=max_rows,
                       prefill_capacity=prefill_capacity, batch_sharding=batch_sharding, page_size=page_size)
