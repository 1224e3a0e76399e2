"""``LLMEngine``: requests in, outputs out, one step at a time (vLLM's ``LLMEngine``: add_request, step,
abort_request, has_unfinished_requests; docs/architecture.md "The engine step").

``step()`` schedules and dispatches step n + 1 (Scheduler.schedule -> ModelRunner.execute) before it applies step n's
tokens (ModelRunner.fetch -> Scheduler.update_from_output -> detokenization and stop strings), so the host's work
overlaps the device's (vLLM v1's async scheduling); the tokens a step samples come back one ``step()`` later. A
step in flight that sampled for a request with penalties is applied first: its next step counts the real tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import time
from collections.abc import Iterable

import numpy as np

from jaxinfer import default_model, jit_mappings
from jaxinfer.checkpoint.fingerprint import weights_digest
from jaxinfer.compile_cache import enable_compilation_cache
from jaxinfer.engine.balance import ROLES
from jaxinfer.engine.buckets import PREFILL_BLOCK
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.handover import Handover, handover, restore
from jaxinfer.engine.outputs import EngineStats, RequestOutput, RequestOutputKind, RequestState
from jaxinfer.engine.runner import InFlight, ModelRunner
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.scheduler_output import SchedulerOutput
from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.engine.speculative import step_cost
from jaxinfer.engine.step_log import step_record
from jaxinfer.engine.structured_output import Grammars
from jaxinfer.engine.tokenizer import Tokenizer
from jaxinfer.kv.page_allocator import PAGE_SIZE
from jaxinfer.kv.page_store import DirectoryPageStore, model_salt
from jaxinfer.kv.paged_cache import latent_width
from jaxinfer.model import load_model
from jaxinfer.rebalance import rebalance_model


@dataclasses.dataclass
class _Dispatched:
    output: SchedulerOutput
    handle: InFlight
    sync: bool  # a sampled request uses penalties: apply this step before building the next one


class LLMEngine:
    """The serving engine over one model on a mesh. ``LLMEngine(model=None, mesh=None, dtype=None, **options)``
    takes ``EngineConfig``'s fields; ``LLMEngine.from_config(config)`` an EngineConfig.

    Request ids are the caller's strings. Unseeded sampling is keyed on the engine's internal sequence ids (one per
    request, then one per sample, in the order requests are added), so an engine reproduces its tokens for the
    same requests in the same order.
    """

    def __init__(self, model=None, mesh=None, dtype: str | None = None, **engine_options):
        self._setup(EngineConfig.from_options("LLMEngine()", dict(model=model, mesh=mesh, dtype=dtype,
                                                                   **engine_options)))

    @classmethod
    def from_config(cls, config: EngineConfig, role: str = "colocated") -> LLMEngine:
        """role: "colocated" (prefill and decode steps on this engine's mesh), or one side of prefill/decode
        disaggregation (engine/disaggregated.py): "prefill" (prefill steps only; a request whose prompt is computed
        and first token sampled is handed over: ``take_handovers``) or "decode" (takes ``add_prefilled``)."""
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        engine = cls.__new__(cls)
        engine._setup(config, role)
        return engine

    def _setup(self, config: EngineConfig, role: str = "colocated") -> None:
        self.role = role
        enable_compilation_cache(config.compilation_cache)  # before anything compiles
        self._programs_seen = jit_mappings.programs_loaded()
        self.model = load_model(config.model or default_model.path(), mesh=config.mesh,
                                dtype=config.dtype or "bfloat16", fp8_compute=config.fp8_compute,
                                num_redundant_experts=config.num_redundant_experts,
                                moe_path=config.moe_path or "auto")
        self.config = config = config.resolve(self.model)
        if config.rebalance_every_n_steps and not self.model.config.num_moe_layers:
            raise ValueError(f"rebalance_every_n_steps={config.rebalance_every_n_steps}: {config.model} has no MoE "
                             f"layers, so no experts to rebalance")
        self.model_path = config.model
        self.tokenizer = Tokenizer.from_dir(config.model)
        eos = self.tokenizer.eos_token_id if self.tokenizer else (self.model.config.eos_token_ids or (None,))[0]
        spec = config.speculative_config
        if spec is not None and not self.model.has_mtp:
            raise ValueError(f"speculative_config method {spec.method!r} needs the checkpoint's MTP module, and "
                             f"{config.model} has none (no model.layers.{self.model.config.num_hidden_layers}"
                             f".eh_proj.weight, or num_nextn_predict_layers = 0)")
        self.num_drafts = spec.num_speculative_tokens if spec else 0
        self.kv_store = self._kv_store(config)
        self.scheduler = Scheduler(self.model.dp_size, config.num_kv_pages, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len,
                                   enable_prefix_caching=config.enable_prefix_caching, eos_token_id=eos,
                                   num_scheduler_steps=config.num_scheduler_steps, speculative=spec is not None,
                                   confidence_verify=spec is not None and spec.verify == "confidence",
                                   num_drafts=self.num_drafts,
                                   step_cost=step_cost(self.model.mesh.devices.flat[0].platform),
                                   prefill_block=(PREFILL_BLOCK if config.prefill_layout == "blocks" and spec is None
                                                  else None),  # speculative prefill steps stay grids (drafter.py)
                                   storage=self.kv_store, role=role)
        self.runner = ModelRunner(self.model, config.num_kv_pages, attention_backend=config.attention_backend,
                                  max_num_seqs=config.max_num_seqs, prefill_capacity=self.scheduler.prefill_capacity,
                                  min_prefill_t=self.scheduler.min_prefill_t, engine_seed=config.seed,
                                  # no wider than the vocabulary (add_request caps each request's logprobs alike)
                                  max_logprobs=min(config.max_logprobs, self.model.config.vocab_size),
                                  expert_load_window=config.expert_load_window,
                                  num_scheduler_steps=config.num_scheduler_steps, eos_token_id=eos,
                                  greedy_screening=config.greedy_screening, num_drafts=self.num_drafts,
                                  prefill_block=self.scheduler.prefill_block, compile_ahead=config.compile_ahead,
                                  max_pages=-(-config.max_model_len // self.scheduler.page_size),
                                  kv_store=self.kv_store, max_model_len=config.max_model_len)
        self.grammars = (Grammars(self.tokenizer.to_json(), self.model.config.vocab_size, eos)
                         if self.tokenizer else None)
        self.stats = EngineStats(accepted_per_position=[0] * self.num_drafts)
        self._requests: dict[str, RequestState] = {}       # added, final output not yet returned
        self._seqs: dict[int, tuple[RequestState, int]] = {}  # seq_id -> (request, child)
        self._ready: dict[str, RequestState] = {}          # progressed since the last step() returned
        self._ids = itertools.count()
        self._in_flight: _Dispatched | None = None
        self._steps_since_rebalance = 0
        self._handovers: list[Handover] = []  # a prefill engine's, until take_handovers()

    def _kv_store(self, config: EngineConfig) -> DirectoryPageStore | None:
        """The KV storage tier of ``config.kv_cache_dir`` (kv/page_store.py), or None (off, or the directory is not
        writable: a warning): pages of every layer (the MTP module's cache too with speculative decoding) in the
        model's dtype, salted with the model's identity (its config, dtype, FP8 mode and weights' content:
        checkpoint/fingerprint.py, the digests cached in the directory)."""
        if config.kv_cache_dir is None:
            return None
        mc = self.model.config
        shape = (mc.num_hidden_layers + (1 if self.num_drafts else 0), PAGE_SIZE, latent_width(mc))
        path = pathlib.Path(config.kv_cache_dir).expanduser()
        store = DirectoryPageStore(path, salt=b"", dtype=self.model.dtype, shape=shape,
                                   max_bytes=config.kv_cache_max_bytes)
        if not store.enabled:
            return None  # it warned: the engine runs without the tier (and the weights are not hashed)
        weights = weights_digest(config.model, path / "weights-digests.json")
        store.salt = model_salt(mc, self.model.dtype, self.model.layout.get("fp8", "off"), weights, shape)
        return store

    def cache_stats(self) -> dict:
        """Prefix-cache counters since the engine was built, as DeepSeek reports them: prompt_tokens (of the
        admissions), device_hit_tokens, storage_hit_tokens, hit_rate (both hits over prompt_tokens), and the
        storage tier's storage_bytes_read, storage_bytes_written, storage_rejected_files, storage_bytes (its
        directory now, every writer's); the tier's counts are 0 without it. Waits for the tier's queued writes."""
        stats = [c.stats for c in self.scheduler.caches]
        prompt = sum(s.query_tokens for s in stats)
        device = sum(s.hit_tokens for s in stats)
        storage = self.scheduler.storage_hit_tokens
        out = dict(prompt_tokens=prompt, device_hit_tokens=device, storage_hit_tokens=storage,
                   hit_rate=(device + storage) / prompt if prompt else 0.0, storage_bytes_read=0,
                   storage_bytes_written=0, storage_rejected_files=0, storage_bytes=0)
        if self.kv_store is not None:
            self.runner.page_io.flush()
            st = self.kv_store.stats
            out.update(storage_bytes_read=st.bytes_read, storage_bytes_written=st.bytes_written,
                       storage_rejected_files=st.rejected_files,
                       storage_bytes=self.kv_store.size_bytes())
        return out

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    sampling_params: SamplingParams | None = None, *,
                    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE) -> None:
        """Queues a request. prompt: text (needs the checkpoint's tokenizer), token ids, or {"prompt_token_ids": ids,
        "prompt": the text they encode (optional)} (vLLM's TokensPrompt; LLM.generate encodes a call's texts in
        one batch and passes them so). output_kind: what ``step()`` returns of it (outputs.RequestOutputKind:
        "cumulative", "delta" or "final_only").

        Raises ValueError for a non-str request_id, the id of an unfinished request (one whose finished output
        was not returned yet), a prompt of the wrong type or sampling_params that are not SamplingParams. A
        request whose content cannot run (empty, too long, a token id outside the vocabulary, more logprobs than
        max_logprobs, more KV pages than a rank has) is not an exception: the next ``step()`` returns it
        finished with reason "error" and a message."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is the id of an unfinished request")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        vocab = self.model.config.vocab_size  # a vocabulary has no more tokens to rank (max_logprobs still applies)
        if params.logprobs is not None and vocab < params.logprobs <= self.config.max_logprobs:
            params = dataclasses.replace(params, logprobs=vocab)
        if params.structured_outputs is not None and self.grammars is None:
            raise ValueError(f"structured_outputs needs the checkpoint's tokenizer.json, and {self.model_path} "
                             f"has none")
        try:
            output_kind = RequestOutputKind(output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {[k.value for k in RequestOutputKind]}, "
                             f"got {output_kind!r}") from None
        text, ids = self._prompt_ids(prompt)
        next(self._ids)  # the request's own internal id: unseeded sampling keys stay what they were
        seqs = [Sequence(next(self._ids), ids, params, child_index=child) for child in range(params.n)]
        error = self._content_error(ids, params)
        # No decoder for a request that fails here: its ids may not even decode (a negative id overflows).
        request = RequestState(request_id, text, ids, params, seqs, self.tokenizer if error is None else None,
                               time.perf_counter(), output_kind)
        self._requests[request_id] = request
        if error is None and params.structured_outputs is not None:
            error = self.grammars.add([seq.seq_id for seq in seqs], params.structured_outputs)
        if error is None:
            for child, seq in enumerate(seqs):
                self.scheduler.add(seq)
                if seq.is_finished:  # rejected at admission: empty, too long, can never fit
                    error = seq.error
                    break
                self._seqs[seq.seq_id] = (request, child)
        if error is None and params.structured_outputs is not None:
            # A grammar's forced start is computed with the prompt (its first token: after it), and may complete a
            # stop string.
            for child, seq in enumerate(seqs):
                ended = self._fast_forward(seq)
                if ended is not None:
                    self._finish_late(seq, *ended)
                self._stop_at_stop_string(request, child)
            self._close_finished([seq.seq_id for seq in seqs])
        if error is not None:
            for seq in seqs:
                if not seq.is_finished and seq.seq_id in self._seqs:
                    self.scheduler.finish(seq, "error", error)
                self._seqs.pop(seq.seq_id, None)
                self._drop_grammar(seq.seq_id)
            request.fail(error)
            self._ready[request_id] = request

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Finishes requests now and frees their pages; no output is returned for them afterwards. Unknown ids
        are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self._requests.pop(rid, None)
            if request is None:
                continue
            self._ready.pop(rid, None)
            for c in request.completions:
                if self._seqs.pop(c.seq.seq_id, None) is not None and not c.seq.is_finished:
                    self.scheduler.finish(c.seq, "abort")
                self._drop_grammar(c.seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        """True until every request's finished output has been returned by ``step()``."""
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        """The ids of the requests whose finished output ``step()`` has not returned yet, in the order added."""
        return list(self._requests)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need tokenizer.json beside the checkpoint; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # vLLM's TokensPrompt: ids, and the text they encode if known
            if "prompt_token_ids" not in prompt or set(prompt) - {"prompt", "prompt_token_ids"}:
                raise ValueError(f"a dict prompt has 'prompt_token_ids' and optionally 'prompt', got keys "
                                 f"{sorted(prompt)}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt['prompt'] must be a str, got {type(text).__name__}")
            return text, self._prompt_ids(prompt["prompt_token_ids"])[1]
        ids = np.asarray(prompt if prompt is not None else [])
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        return None, [int(t) for t in ids]

    def _content_error(self, ids: list[int], p: SamplingParams) -> str | None:
        """Why a request can never run, before the scheduler's own checks (length, pages), or None."""
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {self.model.config.vocab_size})"
        if p.logprobs is not None and p.logprobs > self.config.max_logprobs:
            return f"logprobs={p.logprobs} exceeds max_logprobs={self.config.max_logprobs}"
        return None

    # ---- steps -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches the next step, applies the previous one's tokens, and returns the requests that
        progressed (each finished request exactly once with finished=True; [] while work is in flight)."""
        if self._in_flight is not None and self._in_flight.sync:
            self._apply(self._in_flight)  # penalties count the real tokens: no overlap for this step
            self._in_flight = None
        self._watch_mappings()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        dispatched = None
        if out is not None:
            self.stats.preemptions += len(out.preempted_req_ids)
            self._close_finished(out.finished_req_ids)  # e.g. a preempted request that can no longer fit
            if not out.is_empty:
                every = self.config.rebalance_every_n_steps
                if every and self._steps_since_rebalance >= every:
                    self.rebalance_experts()  # between steps: the dispatched one keeps the weights it was given
                dispatched = self._dispatch(out)
        self.stats.host_s += time.perf_counter() - t0
        if self._in_flight is not None:
            self._apply(self._in_flight)
        elif dispatched is None and self.scheduler.has_unfinished() and not (out and out.finished_req_ids):
            raise RuntimeError(f"scheduler stalled with {self.scheduler.num_unfinished()} unfinished sequences")
        self._in_flight = dispatched
        return self._outputs()

    def _watch_mappings(self) -> None:
        """After steps that compiled or loaded programs: if the process nears Linux's limit on memory mappings
        (XLA:CPU maps each program's kernels; jit_mappings.py), drops JAX's compiled programs (the step in flight
        finishes correctly; the next steps compile or load theirs again)."""
        loaded = jit_mappings.programs_loaded()
        if loaded != self._programs_seen:
            self._programs_seen = loaded
            jit_mappings.relieve()

    def _drop_grammar(self, seq_id: int) -> None:
        if self.grammars:
            self.grammars.drop(seq_id)

    def _dispatch(self, out: SchedulerOutput) -> _Dispatched:
        allowed = None
        if self.grammars:  # constrained sequences exist: their masks (per verified column), a step without any too
            allowed = self.grammars.masks([r.req_id for r in out.all_requests() if r.num_sampled],
                                          {r.req_id: r.draft_token_ids for r in out.all_requests()
                                           if r.draft_token_ids})
        handle = self.runner.execute(out, allowed)
        self.stats.log_step(step_record(out, self.scheduler, self.role, time.perf_counter()))
        self.runner.store_pages(self.scheduler.take_stores())  # pages this step computes: copied after it
        self._steps_since_rebalance += 1
        self.stats.steps += 1
        self.stats.scheduled_tokens += out.num_scheduled_tokens
        self.stats.prefill_tokens += out.num_scheduled_tokens if out.kind == "prefill" else 0
        # Applied before the next step is built: every step without async scheduling; a step sampling for
        # penalties, which count every token (a constrained sequence waits for its own tokens instead: scheduler.py
        # "Constrained sequences"; the next verification follows a speculative step on device: "Speculative steps
        # in flight").
        sync = (not self.config.async_scheduling
                or any(self._seqs[r.req_id][0].params.uses_penalties
                       for r in out.all_requests() if r.num_sampled and r.req_id in self._seqs))
        return _Dispatched(out, handle, sync)

    def _apply(self, step: _Dispatched) -> None:
        """Brings a dispatched step's tokens to the host and applies them: the scheduler's update, logprobs, stop
        strings, completed sequences."""
        t0 = time.perf_counter()
        result = self.runner.fetch(step.handle)
        t1 = time.perf_counter()
        self.stats.wait_s += t1 - t0
        updates = self.scheduler.update_from_output(step.output, result)
        self.runner.store_pages(self.scheduler.take_stores())  # pages whose tokens this update made known
        touched = set()
        for update in updates:
            for drafts, accepted in update.rounds:
                self.stats.count_round(drafts, accepted, self.num_drafts)
            seq = update.seq
            entry = self._seqs.get(seq.seq_id)
            if entry is None or update.num == 0:
                continue
            request, child = entry
            touched.add(request.request_id)
            if self.grammars and seq.seq_id in self.grammars:  # before the text: it may append forced tokens
                self._advance_grammar(seq, update.num)
            logprobs = result.logprobs.get(seq.seq_id)
            request.tokens_arrived(child, t1, None if logprobs is None else logprobs[:update.num])
            self._stop_at_stop_string(request, child)
            self._ready[request.request_id] = request
        self._close_finished([u.seq.seq_id for u in updates])
        if self.role == "prefill":
            self._hand_over(touched)
        self.stats.host_s += time.perf_counter() - t1

    # ---- prefill/decode disaggregation (engine/disaggregated.py) --------------------------------------------
    def _hand_over(self, request_ids: Iterable[str]) -> None:
        """A prefill engine: requests whose samples all finished or decode (prompt computed, first token known)
        leave this engine as Handovers with their prompts' latents (gathered by a program dispatched now, before
        any later step could reuse the pages, which are freed at once). A request of finished samples only is
        returned as usual."""
        for rid in sorted(request_ids):
            request = self._requests.get(rid)
            if request is None:
                continue
            seqs = [c.seq for c in request.completions]
            if all(s.is_finished for s in seqs) or any(
                    not s.is_finished and (s.status is not SequenceStatus.RUNNING or s.is_prefilling
                                           or s.num_placeholders) for s in seqs):
                continue
            latents = {s.seq_id: self.runner.gather_pages(s.rank, s.pages[:-(-s.num_computed_tokens // PAGE_SIZE)])
                       for s in seqs if not s.is_finished}
            self._handovers.append(handover(request, latents))
            self.abort_request(rid)  # frees its pages and state; no output returned for it here

    def take_handovers(self) -> list[Handover]:
        """The requests a prefill engine handed over since the last call (engine/handover.py)."""
        out, self._handovers = self._handovers, []
        return out

    def add_prefilled(self, h: Handover) -> None:
        """A decode engine: continues a request a prefill engine handed over; ``h``'s latents must be on this
        engine's devices (e.g. ``jax.device_put`` to a replicated sharding of its mesh). A sample that can never
        fit (more pages than a rank has) finishes with "error". Raises ValueError for the id of an unfinished
        request."""
        if h.request_id in self._requests:
            raise ValueError(f"request_id {h.request_id!r} is the id of an unfinished request")
        request = restore(h, self.tokenizer)
        self._requests[h.request_id] = request
        self.stats.kv_transfer_bytes += h.num_latent_bytes
        for child, (c, ch) in enumerate(zip(request.completions, h.children)):
            seq = c.seq
            if ch.finish_reason is not None:
                continue
            constraint = h.params.structured_outputs
            if constraint is not None:  # the matcher, advanced over the outputs the prefill engine chose
                self.grammars.add([seq.seq_id], constraint)
                self.grammars.consume(seq.seq_id, seq.output_token_ids)
            self.scheduler.add_prefilled(seq, ch.latents, ch.num_kv_tokens)
            if seq.is_finished:
                self._drop_grammar(seq.seq_id)
                request.close(child)
            else:
                self._seqs[seq.seq_id] = (request, child)
        self._ready[h.request_id] = request

    def _advance_grammar(self, seq: Sequence, num: int) -> None:
        """Feeds a constrained sequence's new tokens to its matcher, then appends the tokens its grammar forces
        (``_fast_forward``); a complete grammar ends the output with "stop" (even with ignore_eos), a token it
        rejects (impossible under its masks) with "error"."""
        ended = self.grammars.consume(seq.seq_id, seq.output_token_ids[seq.num_output_tokens - num:
                                                                        seq.num_output_tokens])
        if ended is None:
            ended = self._fast_forward(seq)
        if ended is not None:
            self._finish_late(seq, *ended)

    def _fast_forward(self, seq: Sequence) -> tuple[str, str | None] | None:
        """Appends the tokens a constrained sequence's grammar forces next (llguidance's fast-forward tokens) as
        outputs without sampling them: its next step computes them in one chunk and samples the token after them
        (scheduler.py "Known tokens"), so a JSON object's keys and punctuation cost no step each. Each is what
        sampling would give (the only token its mask allows); not for requests with logprobs (they get one per
        sampled token) or speculative engines (their rounds verify MTP drafts). Returns ``consume``'s ending."""
        if (self.scheduler.speculative or seq.params.logprobs is not None or seq.is_finished
                or seq.num_placeholders):
            return None
        forced = self.grammars.forced(seq.seq_id)
        if not forced:
            return None
        n = self.scheduler.append_outputs(seq, forced)
        return self.grammars.consume(seq.seq_id, forced[:n])

    def _stop_at_stop_string(self, request: RequestState, child: int) -> None:
        """Finishes sample ``child`` with "stop" if its outputs so far complete a stop string, dropping the outputs
        after the one that completed it (RequestState.find_stop_string)."""
        keep = request.find_stop_string(child) if request.params.stop else None
        if keep is not None:
            seq = request.completions[child].seq
            self._finish_late(seq, "stop")
            del seq.output_token_ids[keep:]  # outputs after the stop string's (their logprobs: ``close``)

    def _finish_late(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Ends a sequence for what its applied tokens showed (a stop string, a grammar's end): it may already be
        finished by length as the step was committed, and then "stop" wins; "error" (e.g. stopped by the EOS a
        stuck grammar was given: the output is not valid) wins over any reason."""
        if not seq.is_finished:
            self.scheduler.finish(seq, reason, error)
        elif reason == "error":
            seq.finish_reason, seq.error = "error", error
        elif seq.finish_reason == "length":
            seq.finish_reason = "stop"

    def _close_finished(self, seq_ids: Iterable[int]) -> None:
        """Closes the completions whose sequences are finished and hold no placeholder."""
        for seq_id in seq_ids:
            entry = self._seqs.get(seq_id)
            if entry is None:
                continue
            request, child = entry
            seq = request.completions[child].seq
            if not seq.is_finished or seq.num_placeholders:
                continue
            del self._seqs[seq_id]
            self._drop_grammar(seq_id)
            request.close(child)
            self.stats.finished_input_tokens += seq.num_prompt_tokens
            self.stats.finished_output_tokens += seq.num_output_tokens
            self._ready[request.request_id] = request

    def _outputs(self) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for rid, request in self._ready.items():
            out = request.output(now)
            if out is not None:
                outputs.append(out)
            if request.returned_final:
                self._requests.pop(rid, None)
        self._ready = {}
        return outputs

    def clear_step_log(self) -> None:
        """Empties ``stats.step_log`` (LLM.generate does, so that its stats log the call's steps)."""
        self.stats.step_log.clear()

    def wait_for_compilations(self) -> None:
        """Blocks until the step programs compiled ahead in the background (EngineConfig.compile_ahead) are ready:
        after it, steps of any prefill block count run without compiling."""
        self.runner.wait_for_compilations()

    # ---- expert load balancing (DeepSeek's EPLB) -----------------------------------------------------------
    def expert_load(self) -> np.ndarray:
        """np.int64 [num_moe_layers, n_routed_experts]: (token, expert) choices routed to each logical expert of
        each MoE layer over the last expert_load_window engine steps (prompt and generated tokens the steps
        computed; padding excluded). Waits for the dispatched steps."""
        return self.runner.expert_load()

    def rebalance_experts(self, num_nodes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Re-places the routed experts from ``expert_load()`` with EPLB (jaxinfer/rebalance.py): slots =
        n_routed_experts + num_redundant_experts, GPUs = the mesh's `expert` axis, groups = n_group, num_nodes
        hosts. Outputs do not change (every copy of an expert is equal); only which expert rank computes what.
        Returns EPLB's (phy2log [L, S], log2phy [L, E, max_replicas], logcnt [L, E])."""
        placement = rebalance_model(self.model, self.expert_load(), num_nodes)
        self.runner.refresh_state()
        self._steps_since_rebalance = 0
        return placement
