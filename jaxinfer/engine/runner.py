"""ModelRunner: executes ``SchedulerOutput``s on the devices and returns ``RunnerOutput``s (docs/architecture.md "The
engine step").

It owns the device state of serving: the paged latent cache (per layer [R * pages_per_rank, 64, 1, C+R]), the
token buffer that carries sampled tokens from one step to the next on device (with speculative decoding also each
row's drafts and unused positions: ``drafted``), and the expert-load window; and its own per-request state
(inputs.InputBatch), updated from each SchedulerOutput: it never reads the scheduler's objects. ``execute``
dispatches a step and returns at once; ``fetch`` waits for its tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.engine import packing
from jaxinfer.engine.compile_ahead import CompiledFamily
from jaxinfer.engine.expert_load import ExpertLoadWindow
from jaxinfer.engine.inputs import InputBatch
from jaxinfer.engine.page_io import PageIO, put_on_rank, take_from_rank
from jaxinfer.engine.drafter import Drafts
from jaxinfer.engine.rejection_sampler import VerifyOutput
from jaxinfer.engine.sampler import SampleOutput
from jaxinfer.engine.buckets import MIN_PREFILL_T, bucket
from jaxinfer.engine.scheduler_output import RunnerOutput, SchedulerOutput
from jaxinfer.engine.step_program import StepProgram, shared_program
from jaxinfer.kv.page_store import PageStore
from jaxinfer.kv.paged_cache import init_paged_cache
from jaxinfer.models.attention import BACKENDS
from jaxinfer.models.screened_head import HeadScreen, build_head_screen
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.multihost import global_array, to_host


@dataclasses.dataclass
class InFlight:
    """A dispatched step: the (row, request id, tokens sampled at most) of every sampling row, the device outputs
    (a SampleOutput, or a VerifyOutput for a verification step: with a leading [rounds] axis for several rounds),
    the drafts it proposed (or None), and each verification row's real columns in its first round ([R], on
    device: a row following its step in flight is laid out there)."""

    sampled: list[tuple[int, int, int]]
    logprobs_width: dict[int, int]
    output: SampleOutput | VerifyOutput
    drafts: Drafts | None = None
    columns: jax.Array | None = None


class ModelRunner:
    """The device side of the engine.

    Args:
      model: a jaxinfer Model.
      num_pages_per_rank: KV pages per DP rank (the null page 0 included).
      attention_backend: "pallas" (the cache written inside the step, read by mla_decode) or "xla" (the cache only
        read inside the step, the latents written by a second program after it); models/attention.py.
      max_num_seqs: running sequences per rank at most (sizes the token buffer).
      prefill_capacity, min_prefill_t: the prefill grid (Scheduler.prefill_capacity, Scheduler.min_prefill_t).
      engine_seed: seed of unseeded requests (sampler.request_seed).
      max_logprobs: the logprobs width computed when any row asks for logprobs (vLLM's default 20).
      expert_load_window: ``expert_load`` covers the last this many steps.
      num_scheduler_steps: decode iterations per decode step at most (Scheduler.num_scheduler_steps).
      eos_token_id: the scheduler's EOS id: a multi-step decode step stops early when every row has sampled a
        stop token.
      greedy_screening: greedy steps of one row per device take the head's argmax through an int8 screen
        (head.py; the same tokens, a quarter of a float32 head's bytes, an int8 copy of the head kept).
      num_drafts: K of speculative decoding with the model's MTP module (0: off): a speculative step
        (``SchedulerOutput.speculative``) runs ``StepProgram.spec_step`` and proposes K drafts per sampling row;
        the MTP module gets its own paged latent cache (``mtp_layers``), which plain steps leave as it is.
      prefill_block, max_pages: prefill steps in query blocks of that many columns with block tables of max_pages
        (Scheduler.prefill_block; None: [rows, T] grids). compile_ahead: once a prefill block count first compiles,
        compile the others in a background thread (``_block_steps``).
      kv_store: the KV storage tier (kv/page_store.py) or None: pages move between it and the cache through
        ``page_io`` (``execute`` places a step's ``page_loads``; ``store_pages`` copies registered pages out).
      max_model_len: the engine's (InputBatch).
    """

    def __init__(self, model, num_pages_per_rank: int, *, attention_backend: str, max_num_seqs: int = 64,
                 prefill_capacity: int = 1024, min_prefill_t: int = MIN_PREFILL_T, page_size: int = 64,
                 engine_seed: int = 0, max_logprobs: int = 20, expert_load_window: int = 1000,
                 num_scheduler_steps: int = 1, eos_token_id: int | None = None, greedy_screening: bool = False,
                 num_drafts: int = 0, prefill_block: int | None = None, max_pages: int = 0,
                 compile_ahead: bool = True, kv_store: PageStore | None = None, max_model_len: int = 1 << 30):
        self.model = model
        self.backend = BACKENDS[attention_backend]
        self.greedy_screening = greedy_screening
        ranks = model.dp_size
        max_rows = bucket(max_num_seqs)  # a rank's sampling rows: one per running sequence at most
        self.inputs = InputBatch(ranks=ranks, max_rows=max_rows, page_size=page_size, min_prefill_t=min_prefill_t,
                                 prefill_capacity=prefill_capacity, num_scheduler_steps=num_scheduler_steps,
                                 eos_token_id=eos_token_id, vocab_size=model.config.vocab_size,
                                 engine_seed=engine_seed, max_logprobs=max_logprobs, num_drafts=num_drafts,
                                 prefill_block=prefill_block, max_pages=max_pages, max_model_len=max_model_len)
        self.num_drafts = num_drafts
        self.compile_ahead = compile_ahead
        self._batch = NamedSharding(model.mesh, P(BATCH_AXES))
        # The XLA backend's cache holds bit patterns (paged_cache's module doc: XLA:CPU upcasts bf16 scatters and
        # gathers over the whole cache); the Pallas kernel reads its own dtype.
        cache = functools.partial(init_paged_cache, model.config, num_pages_per_rank, model.dtype, mesh=model.mesh,
                                  page_size=page_size, as_bits=not self.backend.writes_in_step)
        self.layers = cache().layers
        # The MTP module's cache: one more layer over the same pages (only read inside a step: drafter.py).
        self.mtp_layers = cache().layers[:1] if num_drafts else ()
        self.page_io = PageIO(kv_store, num_pages_per_rank, model.dtype) if kv_store is not None else None
        self.num_pages_per_rank = num_pages_per_rank
        self.tokens = global_array(np.zeros(ranks * max_rows, np.int32), self._batch)
        # Speculative decoding: each row's drafts, positions not accepted and stop, by token-buffer slot (spec_step)
        self.drafted = (global_array(np.zeros((ranks * max_rows, num_drafts + 2), np.int32), self._batch)
                        if num_drafts else None)
        load_shape = (ranks, model.config.num_moe_layers, model.config.n_routed_experts)
        self.load = ExpertLoadWindow(load_shape, self._batch, expert_load_window)

    @functools.cached_property
    def _state_leaves(self) -> tuple[list, object]:
        """The model state as a flat list of arrays (+ its treedef), flattened once: flattening the nnx.State at
        every dispatch is host time in every step (docs/benchmarks.md "Engine steps and host overhead (CPU)")."""
        leaves, treedef = jax.tree.flatten(self.model.state)
        return leaves, treedef

    @functools.cached_property
    def head_screen(self) -> HeadScreen | None:
        """The head's int8 screen (models/screened_head.py), built from the current weights; None when off."""
        if not self.greedy_screening:
            return None
        return build_head_screen(nnx.merge(self.model.graphdef, self.model.state).head_weight())

    @functools.cached_property
    def program(self) -> StepProgram:
        m = self.model
        return shared_program(m.graphdef, self._state_leaves[1], m.config.vocab_size, m.dtype,
                              m.mesh if m.plan is not None else None, backend=self.backend, ranks=self.inputs.ranks,
                              max_rows=self.inputs.max_rows, prefill_capacity=self.inputs.prefill_capacity,
                              batch_sharding=self._batch, page_size=self.inputs.page_size)

    def refresh_state(self) -> None:
        """Reads the model state again at the next step (after it was changed in place, e.g. rebalanced experts).
        Shapes, dtypes and shardings must not change: the compiled steps are reused."""
        self.__dict__.pop("_state_leaves", None)
        self.__dict__.pop("head_screen", None)

    def execute(self, out: SchedulerOutput, allowed: dict[int, np.ndarray] | None = None) -> InFlight:
        """Starts the step of ``out`` on the devices and returns without waiting for it. allowed: constrained
        requests' allowed next tokens (``StepInputs.build``)."""
        if out.page_loads:  # pages read from the storage tier: in the cache before the step reads them
            self._set_cache(self.page_io.place(self.layers + self.mtp_layers, out.page_loads))
        for rank, pages, latents in out.kv_transfers:  # handed over by a prefill engine, likewise
            self._set_cache(put_on_rank(self.layers + self.mtp_layers, self.model.mesh, self.num_pages_per_rank, rank,
                                        pages, latents))
        self.inputs.update_states(out)
        step = self.inputs.build(out, allowed)
        packed, layout = packing.pack((*step.arrays, step.tensors))  # one transfer: packing.py says why
        widths = {req_id: self.inputs.requests[req_id].params.logprobs for _, req_id, _ in step.sampled}
        packed = global_array(packed, self._batch)
        if out.speculative:
            return InFlight(step.sampled, widths, *self._run_spec(packed, layout, step.verifying, step.rounds))
        return InFlight(step.sampled, widths, self._run(packed, layout, step.blocks))

    def gather_pages(self, rank: int, pages: list[int]) -> jax.Array:
        """The latents of rank-local ``pages`` of ``rank``, every layer (the MTP module's last):
        [len(pages), layers, page_size, width] in the cache's dtype, on the rank's device (a prefill engine's
        hand-over; page_io.take_from_rank). The gather is dispatched now, after the steps that wrote the pages and
        before any later step could reuse them."""
        layers, latents = take_from_rank(self.layers + self.mtp_layers, self.model.mesh, rank, pages)
        self._set_cache(layers)
        return latents

    def store_pages(self, stores: list[tuple[int, int, bytes]]) -> None:
        """Copies the pages ``stores`` ((rank, rank-local page, storage key): Scheduler.take_stores) to the storage
        tier: the copy is dispatched now, after the steps that wrote them; the files are written behind."""
        if stores and self.page_io is not None:
            self._set_cache(self.page_io.copy_out(self.layers + self.mtp_layers, stores))

    def _set_cache(self, layers: tuple) -> None:
        self.layers, self.mtp_layers = tuple(layers[:len(self.layers)]), tuple(layers[len(self.layers):])

    @functools.cached_property
    def _block_steps(self) -> CompiledFamily:
        """The step program for prefill steps in query blocks, compiled ahead for every block count (a power of
        two up to prefill_capacity // prefill_block per rank) once the first is needed (compile_ahead.py)."""
        per_rank = self.inputs.prefill_capacity // self.inputs.prefill_block
        sizes = [self.inputs.ranks * (1 << i) for i in range(per_rank.bit_length())] if self.compile_ahead else []
        return CompiledFamily(self.program.step, static_argnums=(6,), vary=5, sizes=sizes)

    def wait_for_compilations(self) -> None:
        """Blocks until the programs being compiled ahead (``_block_steps``) are ready."""
        if "_block_steps" in self.__dict__:
            self._block_steps.wait()

    def _run(self, packed: jax.Array, layout: packing.Layout, blocks: bool = False):
        """One step on the devices (asynchronous): updates the cache, the token buffer and the expert-load window,
        returns the samples. packed / layout: the step's host arrays and sampling tensors (``packing.pack``);
        blocks: a prefill step in query blocks."""
        program = self._block_steps if blocks else self.program.step
        out, new, self.tokens, (total, load) = program(
            self._state_leaves[0], self.layers, self.tokens, self.load.total, self.load.evicted(), packed, layout,
            self.head_screen)
        self.load.push(total, load)
        self.layers = new if self.backend.writes_in_step else self.program.write(self.layers, *new)
        return out

    def _run_spec(self, packed: jax.Array, layout: packing.Layout, verifying: bool, rounds: int):
        """``_run`` for speculative decoding (StepProgram.spec_step): returns (samples, drafts, round 0's columns)."""
        step = self.program.spec_step
        out, drafts, layers, (latents, slots), self.tokens, self.drafted, columns, (total, load) = step(
            self._state_leaves[0], self.layers, self.mtp_layers, self.tokens, self.drafted, self.load.total,
            self.load.evicted(), packed, layout, verifying, self.num_drafts, rounds, self.head_screen)
        self.load.push(total, load)
        if self.backend.writes_in_step:
            self.layers = layers
            self.mtp_layers = self.program.write(self.mtp_layers, latents, slots)
        else:
            written = self.program.write(self.layers + self.mtp_layers, latents, slots)
            self.layers, self.mtp_layers = written[:len(self.layers)], written[len(self.layers):]
        return out, drafts, columns

    def fetch(self, step: InFlight) -> RunnerOutput:
        """Waits for a dispatched step; returns its sampled tokens (and logprobs) by request id, and records them
        in the runner's own request state."""
        out = step.output
        verifying = isinstance(out, VerifyOutput)
        single = out.token_ids.ndim == 1  # one iteration: the fields get the [k = 1] axis of a multi-step step
        one_round = verifying and out.token_ids.ndim == 2  # [R, T]: the fields get the [rounds = 1] axis

        def host(x):
            x = to_host(x)
            if verifying:  # [rounds, R, T, ...] -> [rounds x T, R, ...]: a row's rounds' columns as its iterations
                x = np.moveaxis(x[None] if one_round else x, 1, 2)
                return x.reshape(-1, *x.shape[2:])
            return x[None] if single else x

        token_ids = host(out.token_ids)  # [k, R]
        verified = {}
        if verifying:  # round i's columns first .. first + accepted (first: T - n in round 0, then 0), while it ran
            accepted = to_host(out.num_accepted).reshape(-1, token_ids.shape[1])  # [rounds, R], -1: sat it out
            t = out.token_ids.shape[-1]
            columns = to_host(step.columns)  # [R]
            cols = {}
            for row, req_id, _ in step.sampled:
                n0 = int(columns[row])  # 0: a row following its step in flight whose sequence had ended
                cols[row], verified[req_id] = [], []
                for i, a in enumerate(int(a) for a in accepted[:, row] if a >= 0 and n0):
                    first = t - n0 if i == 0 else 0
                    cols[row].extend(i * t + c for c in range(first, first + a + 1))
                    verified[req_id].append((n0 - 1 if i == 0 else t - 1, a))
        else:  # a decode chunk of n tokens owns its row's first n iterations; any other sampling chunk the one
            cols = {row: range(n) for row, _, n in step.sampled}
        tokens = {req_id: [int(token_ids[i, row]) for i in cols[row]] for row, req_id, _ in step.sampled}
        logprobs = {}
        if out.logprobs is not None:
            chosen, top_ids, top_lp = (host(x) for x in (out.logprobs, out.top_ids, out.top_logprobs))
            for row, req_id, _ in step.sampled:
                width = step.logprobs_width[req_id]
                if width is None:
                    continue
                entries = []
                for i in cols[row]:
                    entry = {int(top_ids[i, row, j]): float(top_lp[i, row, j]) for j in range(width)}
                    entry[int(token_ids[i, row])] = float(chosen[i, row])
                    entries.append(entry)
                logprobs[req_id] = entries
        drafts, probs = {}, {}
        if step.drafts is not None:
            draft_ids, draft_probs = to_host(step.drafts.token_ids), to_host(step.drafts.probs)  # [R, K]
            for row, req_id, _ in step.sampled:
                drafts[req_id] = [int(x) for x in draft_ids[row]]
                probs[req_id] = [float(x) for x in draft_probs[row]]
        self.inputs.record(tokens)
        return RunnerOutput(tokens, logprobs, drafts, probs, verified)

    def expert_load(self) -> np.ndarray:
        """np.int64 [moe layers, experts] over the last ``expert_load_window`` steps (ExpertLoadWindow.read)."""
        return self.load.read()
